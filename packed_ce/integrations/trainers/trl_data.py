"""The data of :class:`PackedSFTTrainer`: conversation weights and sources, split packing,
assistant-only labels under any chat template, and conversations with images.

trl's packing keeps no column beside the tokens, loses the target at each ``bfd_split`` cut, and
refuses ``assistant_only_loss`` without ``{% generation %}`` markers; here
:func:`assistant_labels`, :func:`pack` (:func:`collators.pack_dataset`) and
:class:`SequenceColumns` (the per-sequence tensors in trl's batches) do it exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from collators.collate import example_values, sequence_columns
from collators.images import IMAGE_COLUMN
from packed_ce.columns import (
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    IMAGES,
    INPUT_IDS,
    LABELS,
    SEQ_LENGTHS,
    SEQUENCE_COLUMNS,
)

from .data_checks import skip_or_refuse_without_targets


def assistant_labels(dataset, tokenizer, map_kwargs: dict) -> Any:
    """``input_ids`` and ``labels`` of conversational data, the assistant turns trained.

    Any chat template; with ``{% generation %}`` markers the labels of trl's
    ``assistant_only_loss``.
    """
    import collators
    from collators.chat import template_inputs

    def tokenize(example):
        return collators.tokenize_conversation(
            tokenizer, example["messages"], **template_inputs(example)
        )

    return dataset.map(tokenize, remove_columns=["messages"], **map_kwargs)


def as_the_template_reads(dataset, map_kwargs: dict, name: str):
    """``dataset`` with the columns trl 1.16 leaves out of the chat template moved where it reads
    them: ``documents`` into ``chat_template_kwargs``, a system prompt column
    (``collators.chat.SYSTEM_COLUMNS``) into the messages as their first turn; as
    ``collators.tokenize_dataset`` renders them. Data without them are returned as they are.
    """
    from collators.chat import system_column, with_system_prompt

    names = dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)))
    system = system_column(names, name)
    moved = [column for column in ("documents", system) if column in names]
    if not moved:
        return dataset

    def move(example, index):
        out = {}
        if "documents" in example:
            kwargs = dict(example.get("chat_template_kwargs") or {})
            out["chat_template_kwargs"] = {**kwargs, "documents": example["documents"]}
        if system is not None:
            where = f"`{name}` row {index}"
            out["messages"] = with_system_prompt(example["messages"], example[system], where)
        return out

    return dataset.map(move, with_indices=True, remove_columns=moved, **map_kwargs)


def pack(dataset, max_length: int, strategy: str, name: str, trainer: str):
    """Best-fit-decreasing rows of ``max_length`` tokens; ``"bfd_split"`` splits long conversations.

    Every target trains once and a split conversation weighs as one (:mod:`collators.packing`).
    Only the tokens and the data set columns of ``SEQUENCE_COLUMNS`` are packed (not trl's raw
    ``messages``).

    Raises:
        ValueError naming ``name`` and ``max_length``: no conversation has a target left after
            truncation to ``max_length`` (``"bfd"``), so nothing would train (the loss 0).
    """
    import collators

    overflow = "split" if strategy == "bfd_split" else "truncate"
    # an IterableDataset may not know its columns before its first row
    names = dataset.column_names if dataset.column_names is not None else list(next(iter(dataset)))
    carried = [column.column for column in SEQUENCE_COLUMNS if column.column]
    columns = [c for c in (INPUT_IDS, LABELS, *carried) if c in names]
    rows, stats = collators.pack_dataset(
        dataset.select_columns(columns), max_length, overflow=overflow, return_stats=True
    )
    if stats.num_packed and stats.num_without_targets == stats.num_packed:
        raise ValueError(
            f"{trainer}: no conversation of `{name}` has a target left after truncation to "
            f"max_length={max_length} ({stats.num_truncated} of {stats.num_packed} truncated, "
            f"{stats.num_without_targets} left without a target), so nothing would train: raise "
            "max_length, or use packing_strategy='bfd_split' (long conversations split across "
            "rows, every target trained once)"
        )
    return rows


def has_images(dataset) -> bool:
    """Whether ``dataset`` holds conversations with images: an ``images`` or ``image`` column (what
    trl reads as a vision data set).
    """
    if dataset is None:
        return False
    if isinstance(dataset, dict):
        return any(has_images(data) for data in dataset.values())
    names = getattr(dataset, "column_names", None)
    if names is None:  # an IterableDataset may not know its columns before its first row
        names = list(next(iter(dataset)))
    return IMAGES in names or IMAGE_COLUMN in names


def vision_rows(dataset, processor, args, packing: bool, name: str, trainer: str, skip: bool):
    """Conversations with images as :class:`PackedSFTTrainer` trains them: tokenized with the
    processor (:func:`collators.tokenize_dataset`: at most ``max_length`` tokens, cut before the
    first image that does not fit whole; the assistant turns trained with ``assistant_only_loss``,
    else every token but the images'), packed best-fit-decreasing with ``packing``. Rows tokenized
    already (``input_ids``) are used as they are.

    Raises:
        ValueError: data that is not conversational (``messages``), ``packing_strategy="bfd_split"``
            (a cut would fall where an image may lie), ``packing`` without ``max_length``.
    """
    import collators

    names = getattr(dataset, "column_names", None) or list(next(iter(dataset)))
    if INPUT_IDS in names:
        return dataset
    if "messages" not in names:
        raise ValueError(
            f"{trainer}: `{name}` has images but no `messages` column: data with images is "
            "trained as conversations (messages with {'type': 'image'} parts and an images "
            "column, trl's format)"
        )
    if packing and args.packing_strategy == "bfd_split":
        raise ValueError(
            f"{trainer}: packing_strategy='bfd_split' splits long conversations where a cut may "
            "fall inside an image; with images use packing_strategy='bfd' (a conversation longer "
            "than max_length is cut before the first image that does not fit whole)"
        )
    if packing and args.max_length is None:
        raise ValueError(f"{trainer}: packing=True needs max_length (the row length)")
    num_proc = {"num_proc": args.dataset_num_proc} if hasattr(dataset, "num_rows") else {}
    rows = collators.tokenize_dataset(
        dataset,
        processor,
        max_length=args.max_length,
        skip_no_assistant=skip,
        assistant_only=args.assistant_only_loss,
        **num_proc,
    )
    rows = skip_or_refuse_without_targets(rows, name, trainer, skip)
    return collators.pack_dataset(rows, args.max_length, **num_proc) if packing else rows


def is_packed(dataset) -> bool:
    """Whether ``dataset`` holds packed rows (a ``seq_lengths`` column: the rows of
    :func:`collators.pack_dataset`, :func:`collators.pack_stream` or ``packed-ce pack``).
    """
    names = getattr(dataset, "column_names", None)
    if names is None:  # an IterableDataset may not know its columns before its first row
        names = list(next(iter(dataset)))
    return SEQ_LENGTHS in names


def packed_rows(dataset, name: str, trainer: str, padding_free: bool):
    """Rows packed already, as they are: trl's collator restarts ``position_ids`` at every
    ``seq_lengths`` boundary and :class:`SequenceColumns` carries their per-sequence columns (trl's
    preparation would retokenise or repack each row as one conversation).

    Raises:
        ValueError: for padded batches (``padding_free=False`` without ``packing``), which would
            let a row's conversations attend to each other.
    """
    if not padding_free:
        raise ValueError(
            f"{trainer}: `{name}` holds packed rows (a seq_lengths column: collators.pack_dataset, "
            "pack_stream or packed-ce pack), whose conversations a padded batch would let attend "
            "to each other: pass packing=True (the rows are used as they are) or padding_free=True"
        )
    return dataset


class SequenceColumns:
    """TRL's collator, plus the per-sequence values of ``SEQUENCE_COLUMNS`` (target counts, weights,
    sources), aligned with the loss.

    Laid out as trl's batch: padding-free, the sequences back to back and one per padding token
    (``cu_seq_lens_q``); padded, one per row. Padding takes each column's ``padding`` value.

    Args:
        collator: trl's data collator.
        padding_free: whether ``collator`` flattens the examples into one row.
    """

    def __init__(self, collator: Callable, padding_free: bool):
        self.collator = collator
        self.padding_free = padding_free

    def __call__(self, examples: list[dict]) -> dict:
        # each column's per-sequence key and data set column (trl's collator reads seq_lengths)
        keys = [k for column in SEQUENCE_COLUMNS for k in (column.key, column.column) if k]
        extra = [{k: example.pop(k) for k in keys if k in example} for example in examples]
        batch = self.collator(examples)
        if not any(extra):
            return batch
        counts = [len(e[SEQ_LENGTHS]) if SEQ_LENGTHS in e else 1 for e in examples]
        values = [example_values(found, i, n) for i, (found, n) in enumerate(zip(extra, counts))]
        columns = sequence_columns(values, counts)  # target counts from every example or none
        if self.padding_free:
            cu_seqlens = batch[CU_SEQ_LENS_Q]
        else:
            rows, width = batch[INPUT_IDS].shape
            cu_seqlens = torch.arange(rows + 1, dtype=torch.int32) * width
        padding = cu_seqlens.numel() - 1 - sum(counts)
        batch[CU_SEQLENS] = cu_seqlens
        for column in SEQUENCE_COLUMNS:
            if column.key in columns:
                padded = column.padded(columns[column.key], padding)
                batch[column.key] = torch.from_numpy(padded) if column.dtype else padded
        return batch
