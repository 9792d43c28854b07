"""The data of :class:`PackedSFTTrainer`: conversation weights and sources, split packing, and
assistant-only labels under any chat template.

trl's packing keeps no column beside the tokens, loses the target at each ``bfd_split`` cut, and
refuses ``assistant_only_loss`` without ``{% generation %}`` markers; here
:func:`assistant_labels`, :func:`pack` (:func:`collators.pack_dataset`) and
:class:`SequenceColumns` (the per-sequence tensors in trl's batches) do it exactly.
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

    Any chat template; with ``{% generation %}`` markers the labels of trl's ``assistant_only_loss``.
    """
    import collators

    def tokenize(example):
        return collators.tokenize_conversation(
            tokenizer, example["messages"], tools=example.get("tools")
        )

    return dataset.map(tokenize, remove_columns=["messages"], **map_kwargs)


def pack(dataset, max_length: int, strategy: str):
    """Best-fit-decreasing rows of ``max_length`` tokens; ``"bfd_split"`` splits long conversations.

    Every target trains once and a split conversation weighs as one (:mod:`collators.packing`).
    Only the tokens, ``weight`` and ``source`` are packed (not trl's raw ``messages``).
    """
    import collators

    overflow = "split" if strategy == "bfd_split" else "truncate"
    # an IterableDataset may not know its columns before its first row
    names = dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)))
    columns = [c for c in (INPUT_IDS, LABELS, WEIGHT_COLUMN, SOURCE_COLUMN) if c in names]
    return collators.pack_dataset(dataset.select_columns(columns), max_length, overflow=overflow)


class SequenceColumns:
    """trl's collator, plus each sequence's weight, target count and source, aligned with the loss.

    Laid out as trl's batch: padding-free, the sequences back to back and one per padding token
    (``cu_seq_lens_q``); padded, one per row. Padding: weight 0, target count 1, no source.

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
