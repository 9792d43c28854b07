"""The data of :class:`PackedSFTTrainer`: conversation weights and sources, split packing, and
assistant-only labels under any chat template.

trl's data preparation tokenises, builds ``labels`` and packs with ``seq_lengths`` only: it keeps
no column beside the tokens when packing, cuts ``bfd_split`` pieces without repeating the token at
the cut (so the target there is lost), and refuses ``assistant_only_loss`` for a chat template
without ``{% generation %}`` markers. Here:

- :func:`assistant_labels` tokenises conversations with :func:`collators.tokenize_conversation`
  (the assistant turns and the tokens that end them are trained, under any template);
- :func:`pack` packs with :func:`collators.pack_dataset`, which carries ``weight`` (as
  ``seq_weights``), ``source`` (``seq_sources``) and, for split conversations, each piece's
  whole-conversation target count (``seq_targets``);
- :class:`SequenceColumns` adds those per-sequence tensors to the batches of trl's collator,
  aligned with the boundaries the loss reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from collators.collate import sequence_sources, sequence_weights
from collators.columns import (
    CU_SEQLENS, CU_SEQ_LENS_Q, INPUT_IDS, LABELS, ROW_COLUMNS, SEQ_LENGTHS, SEQ_SOURCES, SEQ_TARGETS,
    SEQ_WEIGHTS, SOURCE_COLUMN, WEIGHT_COLUMN,
)


def assistant_labels(dataset, tokenizer, map_kwargs: dict) -> Any:
    """``input_ids`` and ``labels`` of conversational data, the assistant turns trained.

    :func:`collators.tokenize_conversation` finds the assistant turns by rendering the
    conversation turn by turn, so any chat template works; with ``{% generation %}`` markers it
    gives the same labels as trl's ``assistant_only_loss`` (tested).
    """
    import collators

    def tokenize(example):
        return collators.tokenize_conversation(
            tokenizer, example["messages"], tools=example.get("tools")
        )

    return dataset.map(tokenize, remove_columns=["messages"], **map_kwargs)


def pack(dataset, max_length: int, strategy: str):
    """Best-fit-decreasing rows of ``max_length`` tokens; ``"bfd_split"`` splits long conversations.

    A piece after a cut repeats the token before the cut with label -100, so every target is
    trained exactly once, and carries its conversation's target count (``seq_targets``), so the
    conversation weighs as if it had not been split.

    As trl's own packer, it packs the tokens only, with the ``weight`` and ``source`` columns the
    trainer reads: trl's tokenised data set still holds the raw conversations (``messages``,
    ``prompt``, ...), which packed rows cannot carry.
    """
    import collators

    overflow = "split" if strategy == "bfd_split" else "truncate"
    # an IterableDataset may not know its columns before its first row
    names = dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)))
    columns = [c for c in (INPUT_IDS, LABELS, WEIGHT_COLUMN, SOURCE_COLUMN) if c in names]
    return collators.pack_dataset(dataset.select_columns(columns), max_length, overflow=overflow)


class SequenceColumns:
    """trl's collator, plus each sequence's weight, target count and source, aligned with the loss.

    The loss reads the boundaries of a batch from ``cu_seqlens``, and with it ``seq_targets`` and
    ``seq_weights`` (:func:`packed_ce.integrations.sequence_boundaries`); the trainer reads
    ``seq_sources``. trl's padding-free batches are one row of the examples' sequences back to
    back, then one sequence per padding token (their position ids restart at 0), which
    ``cu_seq_lens_q`` delimits; its padded batches are one conversation per row. The
    per-sequence values of the examples are laid out in the same order; padding gets weight 0,
    target count 1 and no source.

    Args:
        collator: trl's data collator.
        padding_free: whether ``collator`` flattens the examples into one row.
    """

    KEYS = ROW_COLUMNS[1:]  # all but seq_lengths, which trl's collator reads

    def __init__(self, collator: Callable, padding_free: bool):
        self.collator = collator
        self.padding_free = padding_free

    def __call__(self, examples: list[dict]) -> dict:
        extra = [{k: example.pop(k) for k in self.KEYS if k in example} for example in examples]
        batch = self.collator(examples)
        if not any(extra):
            return batch
        if len({values.get(SEQ_TARGETS) is None for values in extra}) > 1:
            raise ValueError(
                "some examples of the batch carry 'seq_targets' and some do not: give every "
                "packed row its sequences' target counts, or none"
            )
        targets, weights, sources = [], [], []
        for index, (example, values) in enumerate(zip(examples, extra)):
            count = len(example[SEQ_LENGTHS]) if SEQ_LENGTHS in example else 1
            targets += values.get(SEQ_TARGETS) or []
            given = sequence_weights(values, index, count)
            weights += [1.0] * count if given is None else given.tolist()
            sources += sequence_sources(values, index, count)
        if self.padding_free:
            cu_seqlens = batch[CU_SEQ_LENS_Q]
        else:
            rows, width = batch[INPUT_IDS].shape
            cu_seqlens = torch.arange(rows + 1, dtype=torch.int32) * width
        padding = cu_seqlens.numel() - 1 - len(weights)
        batch[CU_SEQLENS] = cu_seqlens
        if targets:  # pieces of split conversations (every row of a split packing)
            batch[SEQ_TARGETS] = torch.tensor(targets + [1] * padding, dtype=torch.int32)
        batch[SEQ_WEIGHTS] = torch.tensor(weights + [0.0] * padding, dtype=torch.float64)
        batch[SEQ_SOURCES] = sources + [None] * padding
        return batch
