"""The data of :class:`PackedSFTTrainer`: conversation weights and sources, split packing, and
assistant-only labels under any chat template.

trl's data preparation tokenises, builds ``labels`` and packs with ``seq_lengths`` only: it keeps
no column beside the tokens when packing, cuts ``bfd_split`` pieces without repeating the token at
the cut (so the target there is lost), and refuses ``assistant_only_loss`` for a chat template
without ``{% generation %}`` markers. Here:

- :func:`check_columns` refuses a bad ``weight`` / ``source`` column by row, before any
  tokenisation;
- :func:`assistant_labels` tokenises conversations with :func:`collators.tokenize_conversation`
  (the assistant turns and the tokens that end them are trained, under any template);
- :func:`pack` packs with :func:`collators.pack_dataset`, which carries ``weight`` (as
  ``seq_weights``), ``source`` (``seq_sources``) and, for split conversations, each piece's
  whole-conversation target count (``seq_targets``);
- :class:`SequenceColumns` adds those per-sequence tensors to the batches of trl's collator,
  aligned with the boundaries the loss reads.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch

WEIGHT, SOURCE = "weight", "source"
# Per-sequence columns of packed rows (collators.pack_dataset), and per-conversation ones of
# unpacked rows, that the trainer keeps for the collator.
ROW_COLUMNS = ("seq_lengths", "seq_targets", "seq_weights", "seq_sources", WEIGHT, SOURCE)
# The batch key of each sequence's source index (-1 where no source: padding).
SOURCE_IDS_KEY = "seq_source_ids"


def check_columns(dataset, name: str) -> list[str]:
    """Checks the optional ``weight`` and ``source`` columns of a data set; returns its sources.

    Args:
        dataset: a ``datasets.Dataset`` (an ``IterableDataset`` is not read here).
        name: how the data set is called in errors (``train_dataset``).

    Returns:
        the sorted distinct values of ``source`` ([] without the column).

    Raises:
        TypeError / ValueError naming the row and the fix: a weight that is not a real number, is
        NaN, infinite or negative; a source that is not a string.
    """
    columns = getattr(dataset, "column_names", None) or []
    if WEIGHT in columns:
        for row, weight in enumerate(dataset[WEIGHT]):
            if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
                raise TypeError(
                    f"{name}[{row}][{WEIGHT!r}] must be a real number (a conversation's weight), "
                    f"got {weight!r}"
                )
            if not math.isfinite(weight) or weight < 0:
                raise ValueError(
                    f"{name}[{row}][{WEIGHT!r}] must be finite and >= 0 (0 removes the "
                    f"conversation), got {weight!r}"
                )
    if SOURCE not in columns:
        return []
    sources = dataset[SOURCE]
    for row, source in enumerate(sources):
        if not isinstance(source, str):
            raise TypeError(
                f"{name}[{row}][{SOURCE!r}] must be a string naming the conversation's data "
                f"source, got {source!r}"
            )
    return sorted(set(sources))


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
    """
    import collators

    overflow = "split" if strategy == "bfd_split" else "truncate"
    return collators.pack_dataset(dataset, max_length, overflow=overflow)


class SequenceColumns:
    """trl's collator, plus each sequence's weight, target count and source, aligned with the loss.

    The loss reads the boundaries of a batch from ``cu_seqlens``; with it, ``seq_targets`` and
    ``seq_weights`` (:func:`packed_ce.integrations.sequence_boundaries`). trl's padding-free
    batches are one row of the examples' sequences back to back, then one sequence per padding
    token (their position ids restart at 0), which ``cu_seq_lens_q`` delimits; its padded batches
    are one conversation per row. The per-sequence values of the examples are laid out in the
    same order; padding gets weight 0, target count 1 and source -1.

    Args:
        collator: trl's data collator.
        sources: the trainer's source names; a sequence's id is its index here.
        padding_free: whether ``collator`` flattens the examples into one row.
    """

    def __init__(self, collator: Callable, sources: Sequence[str], padding_free: bool):
        self.collator = collator
        self.source_ids = {name: index for index, name in enumerate(sources)}
        self.padding_free = padding_free

    def __call__(self, examples: list[dict]) -> dict:
        keys = ("seq_targets", "seq_weights", "seq_sources", WEIGHT, SOURCE)
        extra = [{k: example.pop(k) for k in keys if k in example} for example in examples]
        batch = self.collator(examples)
        if not any(extra):
            return batch
        columns = {"seq_targets": [], "seq_weights": [], SOURCE_IDS_KEY: []}
        for example, values in zip(examples, extra):
            count = len(example["seq_lengths"]) if "seq_lengths" in example else 1
            columns["seq_targets"] += values.get("seq_targets", [])
            columns["seq_weights"] += values.get("seq_weights", [values.get(WEIGHT, 1.0)] * count)
            sources = values.get("seq_sources", [values.get(SOURCE)] * count)
            columns[SOURCE_IDS_KEY] += [self.source_ids.get(s, -1) for s in sources]
        if self.padding_free:
            cu_seqlens = batch["cu_seq_lens_q"]
        else:
            rows, width = batch["input_ids"].shape
            cu_seqlens = torch.arange(rows + 1, dtype=torch.int32) * width
        padding = cu_seqlens.numel() - 1 - len(columns["seq_weights"])
        batch["cu_seqlens"] = cu_seqlens
        if columns["seq_targets"]:  # pieces of split conversations (all rows of a split packing)
            batch["seq_targets"] = torch.tensor(columns["seq_targets"] + [1] * padding, dtype=torch.int32)
        batch["seq_weights"] = torch.tensor(columns["seq_weights"] + [0.0] * padding)
        batch[SOURCE_IDS_KEY] = torch.tensor(columns[SOURCE_IDS_KEY] + [-1] * padding)
        return batch
