"""Batches for training: packed (one row, exact boundaries) and padded (the unpacked baseline).

Both describe their sequences with ``cu_seqlens`` over the flattened tokens, count the sequences
that have a target in ``num_sequences``, and give each sequence its conversation's target count in
``seq_targets`` (and its weight in ``seq_weights`` when the data carry one), so one call

    packed_ce.cross_entropy(logits, batch["labels"], cu_seqlens=batch["cu_seqlens"],
                            seq_targets=batch["seq_targets"], is_packed=True, shift=True)

averages per conversation the same way for either batch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from packed_ce.columns import (
    ATTENTION_MASK,
    CU_SEQLENS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    MAX_SEQLEN,
    NUM_SEQUENCES,
    POSITION_IDS,
    SEQ_LENGTHS,
    SEQUENCE_COLUMNS,
)

from .checks import check_tokens, positive_int, targets_per_sequence, token_array


@dataclasses.dataclass
class _Example:
    """One example, checked: ``(L,)`` int64 tokens and labels, ``(S,)`` int64 sequence lengths, and
    its ``example_values``.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    values: dict


def _example(example, index: int, ignore_index: int) -> _Example:
    name = f"examples[{index}]"
    if not isinstance(example, Mapping) or INPUT_IDS not in example:
        raise TypeError(f"`{name}` must be a dict with 'input_ids', got {type(example).__name__}.")
    input_ids = token_array(example[INPUT_IDS], f"{name}['input_ids']")
    labels = (
        input_ids
        if example.get(LABELS) is None
        else token_array(example[LABELS], f"{name}['labels']")
    )
    check_tokens(input_ids, labels, ignore_index, name)
    lengths = example.get(SEQ_LENGTHS)
    lengths = (
        np.array([len(input_ids)])
        if lengths is None
        else token_array(lengths, f"{name}['seq_lengths']")
    )
    if len(labels) != len(input_ids) or lengths.sum() != len(input_ids) or (lengths < 0).any():
        raise ValueError(
            f"`{name}` has {len(input_ids)} input_ids, {len(labels)} labels and seq_lengths "
            f"{lengths.tolist()}: the lengths must be >= 0 and the three must agree."
        )
    return _Example(input_ids, labels, lengths, example_values(example, index, len(lengths)))


def example_values(example: Mapping, index: int, count: int) -> dict:
    """Per ``SEQUENCE_COLUMNS`` key, the ``count`` sequences' values of ``examples[index]`` or None
    (``SequenceColumn.of_example``).
    """
    return {column.key: column.of_example(example, index, count) for column in SEQUENCE_COLUMNS}


def sequence_columns(
    values: Sequence[dict], counts: Sequence[int], own: np.ndarray | None = None
) -> dict:
    """Each ``SEQUENCE_COLUMNS`` key's values over a batch's sequences, for the columns it carries.

    Args:
        values: per example, its ``example_values``.
        counts: per example, its number of sequences.
        own: ``(S,)`` int64, each sequence's own target count; None: target counts are given by
            every example or by none.

    Returns:
        per key, ``(S,)`` array (columns with a ``dtype``) or list, following each column's
        ``absent``: an absent target count is the sequence's own (a given one below it is refused: a
        target would weigh more than its conversation's share) and every count is at least 1; values
        given by some examples only are refused, or padded (sources, left out when none is given).
    """
    columns = {}
    for column in SEQUENCE_COLUMNS:
        given = [example[column.key] for example in values]
        has = [part is not None for part in given]
        if not any(has) and (column.absent != "count" or own is None):
            continue
        if not all(has) and (
            column.absent == "refuse" or (column.absent == "count" and own is None)
        ):
            index = has.index(not has[0])
            raise ValueError(
                f"`examples[{index}]` {'has' if has[index] else 'lacks'} {column.what}s, unlike "
                f"`examples[0]`: give {column.what}s to every example of the batch or to none."
            )
        parts, start = [], 0
        for index, (count, part) in enumerate(zip(counts, given)):
            stop = start + count
            if column.absent == "count" and own is not None:
                if part is None:
                    part = own[start:stop]
                elif (part < own[start:stop]).any():
                    raise ValueError(
                        f"`examples[{index}][{column.key!r}]` is {part.tolist()}, below the "
                        f"sequences' own target counts {own[start:stop].tolist()}: it must count "
                        "the targets of each whole conversation."
                    )
            elif part is None:
                part = column.padded([], count)
            parts.append(part)
            start = stop
        if column.dtype is None:
            parts = [value for part in parts for value in part]
            if all(value is None for value in parts):
                continue
        else:
            parts = np.concatenate(parts).astype(column.dtype)
        if column.absent == "count":
            # a sequence without targets: nothing to weigh, a finite divisor
            parts = np.maximum(parts, 1)
        columns[column.key] = parts
    return columns


class _Collator:
    """What both collators hold: the padding and the label of untrained tokens; the repr lists
    ``_FIELDS``, the constructor's arguments in its order.
    """

    _FIELDS: tuple[str, ...] = ()

    def __init__(self, pad_to_multiple_of: int | None, pad_token_id: int, ignore_index: int):
        if pad_to_multiple_of is not None:
            positive_int(pad_to_multiple_of, "pad_to_multiple_of")
        self.pad_to_multiple_of = pad_to_multiple_of
        self.pad_token_id = pad_token_id
        self.ignore_index = ignore_index

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)}" for name in self._FIELDS)
        return f"{type(self).__name__}({fields})"


class PackedCollator(_Collator):
    """Concatenate conversations into one row with exact sequence boundaries (padding-free batches).

    Takes tokenized conversations (``input_ids``, ``labels``) or rows of ``pack_dataset`` /
    ``pack_stream`` (with ``seq_lengths``) and returns one row of ``T`` tokens:

    - ``input_ids`` ``(1, T)`` int64, back to back.
    - ``labels`` ``(1, T)`` int64, aligned with ``input_ids``; the first label of every sequence is
      ``ignore_index``, so a plain shifted loss never trains the last token of one conversation on
      the first of the next.
    - ``position_ids`` ``(1, T)`` int64, restarting at 0 for every sequence.
    - ``cu_seqlens`` ``(S + 1,)`` int32 from 0 to ``T``; ``max_seqlen`` (``int``).
    - ``num_sequences`` (``int``): sequences with a target (a label after their first token), the
      per-sequence mean's denominator.
    - ``seq_targets`` ``(S,)`` int32: the target count of each sequence's whole conversation (given
      by the example for split pieces, else its own); 1 for a sequence without targets and for
      padding, so ``weight / seq_targets`` never divides by 0.
    - every other column of ``packed_ce.columns.SEQUENCE_COLUMNS`` the examples carry (per sequence,
      or one conversation's data set column), its ``padding`` for padding: ``seq_weights`` ``(S,)``
      float64 (from ``seq_weights`` or ``weight``, in every example or none; 0 for padding),
      ``seq_sources`` (list of ``str`` or None, from ``seq_sources`` or ``source``).
    - with ``return_varlen_kwargs``: ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``cu_seqlens``),
      ``max_length_q`` / ``max_length_k`` (``max_seqlen``) for flash attention.

    No ``attention_mask``: transformers builds the block-diagonal mask from ``position_ids`` only
    without one and without a KV cache, so call ``model(**batch, use_cache=False)``.
    ``pad_to_multiple_of`` adds a padding segment of ``pad_token_id`` tokens, a sequence of its own
    with every label ``ignore_index``.

    Args:
        pad_to_multiple_of: round ``T`` up to a multiple of this (fixed shapes help compiled
            kernels).
        pad_token_id: token of the padding segment.
        ignore_index: label of untrained tokens (default: -100).
        return_varlen_kwargs: add transformers' varlen keywords.

    Example:
        >>> from collators import PackedCollator
        >>> examples = [
        ...     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        ...     {"input_ids": [8, 9, 10, 11], "labels": [-100, -100, 10, 11]},
        ...     {"input_ids": [12, 13], "labels": [-100, -100]},
        ... ]
        >>> batch = PackedCollator()(examples)
        >>> batch["input_ids"]
        tensor([[ 5,  6,  7,  8,  9, 10, 11, 12, 13]])
        >>> batch["labels"]
        tensor([[-100,    6,    7, -100, -100,   10,   11, -100, -100]])
        >>> batch["position_ids"]
        tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
        >>> batch["cu_seqlens"], batch["max_seqlen"], batch["num_sequences"]
        (tensor([0, 3, 7, 9], dtype=torch.int32), 4, 2)
        >>> batch["seq_targets"]
        tensor([2, 2, 1], dtype=torch.int32)

        Two pieces of a split conversation of 4 targets, and a weighted conversation:

        >>> rows = [
        ...     {"input_ids": [4, 5, 6, 7], "labels": [-100, -100, 6, 7], "seq_lengths": [4],
        ...      "seq_targets": [4], "seq_weights": [0.5]},
        ...     {"input_ids": [7, 8, 9, 10, 11], "labels": [-100, 8, 9, -100, 11],
        ...      "seq_lengths": [3, 2], "seq_targets": [4, 1], "seq_weights": [0.5, 2.0]},
        ... ]
        >>> batch = PackedCollator(pad_to_multiple_of=5)(rows)
        >>> batch["cu_seqlens"]
        tensor([ 0,  4,  7,  9, 10], dtype=torch.int32)
        >>> batch["seq_targets"]
        tensor([4, 4, 1, 1], dtype=torch.int32)
        >>> batch["seq_weights"]
        tensor([0.5000, 0.5000, 2.0000, 0.0000], dtype=torch.float64)
    """

    _FIELDS = ("pad_to_multiple_of", "pad_token_id", "ignore_index", "return_varlen_kwargs")

    def __init__(
        self,
        *,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int = 0,
        ignore_index: int = IGNORE_INDEX,
        return_varlen_kwargs: bool = True,
    ):
        _Collator.__init__(self, pad_to_multiple_of, pad_token_id, ignore_index)
        self.return_varlen_kwargs = return_varlen_kwargs

    def __call__(self, examples: Sequence[Mapping]) -> dict:
        """Collate ``examples`` into one packed row.

        Each example: ``input_ids``, optionally ``labels`` (default: all trained), ``seq_lengths``
        (default: one sequence), ``seq_targets`` / ``seq_weights`` / ``seq_sources`` or one
        conversation's ``weight`` / ``source``.
        """
        parts = [
            _example(example, index, self.ignore_index) for index, example in enumerate(examples)
        ]
        if not parts:
            raise ValueError("`examples` is empty.")
        input_ids = np.concatenate([part.input_ids for part in parts])
        labels = np.concatenate([part.labels for part in parts])
        lengths = np.concatenate([part.lengths for part in parts])
        own = targets_per_sequence(labels, lengths, self.ignore_index)
        columns = sequence_columns(
            [part.values for part in parts], [len(part.lengths) for part in parts], own
        )
        # Empty sequences have no token to carry a position, a boundary or a value.
        nonempty = lengths > 0
        lengths = lengths[nonempty]
        columns = {
            key: values[nonempty]
            if isinstance(values, np.ndarray)
            else [value for value, keep in zip(values, nonempty) if keep]
            for key, values in columns.items()
        }
        if lengths.size == 0:
            raise ValueError("`examples` holds no token.")

        num_padding = -len(input_ids) % self.pad_to_multiple_of if self.pad_to_multiple_of else 0
        if num_padding:
            input_ids = np.concatenate(
                (input_ids, np.full(num_padding, self.pad_token_id, dtype=np.int64))
            )
            labels = np.concatenate(
                (labels, np.full(num_padding, self.ignore_index, dtype=np.int64))
            )
            lengths = np.append(lengths, num_padding)
            columns = {
                column.key: column.padded(columns[column.key])
                for column in SEQUENCE_COLUMNS
                if column.key in columns
            }

        cu_seqlens = np.concatenate(([0], np.cumsum(lengths)))
        starts = cu_seqlens[:-1]
        labels[starts] = self.ignore_index
        position_ids = np.arange(len(input_ids), dtype=np.int64) - np.repeat(starts, lengths)
        has_target = np.add.reduceat(labels != self.ignore_index, starts) > 0
        max_seqlen = int(lengths.max())

        cu_seqlens = torch.from_numpy(cu_seqlens.astype(np.int32))
        batch = {
            INPUT_IDS: torch.from_numpy(input_ids)[None],
            LABELS: torch.from_numpy(labels)[None],
            POSITION_IDS: torch.from_numpy(position_ids)[None],
            CU_SEQLENS: cu_seqlens,
            MAX_SEQLEN: max_seqlen,
            NUM_SEQUENCES: int(has_target.sum()),
        }
        batch.update(_as_batch(columns))
        if self.return_varlen_kwargs:
            batch.update(
                cu_seq_lens_q=cu_seqlens,
                cu_seq_lens_k=cu_seqlens,
                max_length_q=max_seqlen,
                max_length_k=max_seqlen,
            )
        return batch


class PaddedCollator(_Collator):
    """Pad conversations to a ``(B, T)`` batch: the unpacked baseline, same boundary metadata.

    Returns:
        - ``input_ids`` ``(B, T)`` int64, right-padded with ``pad_token_id``;
        - ``attention_mask`` ``(B, T)`` int64, 1 on real tokens;
        - ``labels`` ``(B, T)`` int64, ``ignore_index`` on padding and each first token (the targets
          of ``PackedCollator``);
        - ``cu_seqlens`` ``(B + 1,)`` int32, ``arange(B + 1) * T``: one sequence per row, padding
          included;
        - ``num_sequences``, ``seq_targets`` ``(B,)``, ``seq_weights``, ``seq_sources``: as in
          ``PackedCollator``.

    Args:
        pad_token_id: padding token.
        pad_to_multiple_of: round ``T`` up to a multiple of this.
        ignore_index: label of untrained tokens (default: -100).

    Example:
        >>> from collators import PaddedCollator
        >>> examples = [
        ...     {"input_ids": [5, 6, 7], "labels": [-100, 6, 7]},
        ...     {"input_ids": [8, 9], "labels": [8, 9]},
        ... ]
        >>> batch = PaddedCollator(pad_token_id=0)(examples)
        >>> batch["input_ids"], batch["attention_mask"], batch["labels"]
        (tensor([[5, 6, 7],
                [8, 9, 0]]), tensor([[1, 1, 1],
                [1, 1, 0]]), tensor([[-100,    6,    7],
                [-100,    9, -100]]))
        >>> batch["cu_seqlens"], batch["num_sequences"], batch["seq_targets"]
        (tensor([0, 3, 6], dtype=torch.int32), 2, tensor([2, 1], dtype=torch.int32))
    """

    _FIELDS = ("pad_token_id", "pad_to_multiple_of", "ignore_index")

    def __init__(
        self,
        pad_token_id: int = 0,
        *,
        pad_to_multiple_of: int | None = None,
        ignore_index: int = IGNORE_INDEX,
    ):
        _Collator.__init__(self, pad_to_multiple_of, pad_token_id, ignore_index)

    def __call__(self, examples: Sequence[Mapping]) -> dict:
        """Collate ``examples``, one conversation each: dicts with ``input_ids`` and optionally
        ``labels``, ``seq_targets`` / ``seq_weights`` (one entry, as in a row of ``pack_dataset``)
        or ``weight``.
        """
        parts = [
            _example(example, index, self.ignore_index) for index, example in enumerate(examples)
        ]
        if not parts:
            raise ValueError("`examples` is empty.")
        for row, part in enumerate(parts):
            if len(part.lengths) > 1:
                raise ValueError(
                    f"`examples[{row}]` is a packed row; PaddedCollator takes one conversation per "
                    "example."
                )
        width = max(len(part.input_ids) for part in parts)
        if self.pad_to_multiple_of:
            width += -width % self.pad_to_multiple_of
        input_ids = np.full((len(parts), width), self.pad_token_id, dtype=np.int64)
        labels = np.full((len(parts), width), self.ignore_index, dtype=np.int64)
        attention_mask = np.zeros((len(parts), width), dtype=np.int64)
        for row, part in enumerate(parts):
            length = len(part.input_ids)
            input_ids[row, :length] = part.input_ids
            labels[row, 1:length] = part.labels[1:]
            attention_mask[row, :length] = 1
        own = targets_per_sequence(
            labels.reshape(-1), np.full(len(parts), width), self.ignore_index
        )
        batch = {
            INPUT_IDS: torch.from_numpy(input_ids),
            ATTENTION_MASK: torch.from_numpy(attention_mask),
            LABELS: torch.from_numpy(labels),
            CU_SEQLENS: torch.arange(len(parts) + 1, dtype=torch.int32) * width,
            NUM_SEQUENCES: int((labels != self.ignore_index).any(axis=1).sum()),
        }
        batch.update(
            _as_batch(sequence_columns([part.values for part in parts], [1] * len(parts), own))
        )
        return batch


def _as_batch(columns: dict) -> dict:
    """``sequence_columns``' values as a batch holds them: ``dtype`` tensors, or lists."""
    return {
        key: torch.from_numpy(values) if isinstance(values, np.ndarray) else values
        for key, values in columns.items()
    }
