"""Planning packed rows: which piece of which conversation goes where, and what packing counted.

Rows: ``{"input_ids", "labels", "seq_lengths"}``, plus ``seq_targets`` when splitting and one column
per carried data set column (``carried_columns``). Both packers (``pack_dataset``, the windows of
``streaming``) plan with ``cut_to_capacity`` and ``plan_rows``, best-fit-decreasing.

Splitting (``overflow="split"``): a conversation of ``L > M = max_length`` tokens becomes pieces
starting every ``M - 1`` tokens, piece ``k`` = tokens ``[k (M - 1), k (M - 1) + M)``. Each piece
after the first repeats the last token of the piece before, with label ``ignore_index``; under the
causal shift it predicts the label at the cut, so every label after the first is trained exactly
once. Each piece's ``seq_targets`` is the target count of the whole conversation: weighing each
target ``1 / seq_targets`` gives the conversation a total weight of 1 however it was cut.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from typing import Literal

import numpy as np

from packed_ce.columns import (
    IMAGES,
    INPUT_IDS,
    LABELS,
    PACKED_ROW_COLUMNS,
    SEQ_LENGTHS,
    SEQ_TARGETS,
    SEQUENCE_COLUMNS,
    SequenceColumn,
    carried_column,
)

from .checks import positive_int

logger = logging.getLogger(__name__)

Overflow = Literal["truncate", "drop", "error", "split"]
OVERFLOWS = ("truncate", "drop", "error", "split")
# The layout of packed rows, part of every packing cache's key: bump it when the rows change for the
# same inputs.
ROW_LAYOUT_VERSION = 2


@dataclasses.dataclass
class PackingStats:
    """What packing did: nothing is dropped, shortened or cut without being counted here.

    Attributes:
        max_length: the row capacity in tokens.
        num_conversations: conversations read.
        num_packed: conversations placed in rows (truncated and split ones included, each once).
        num_truncated, num_truncated_tokens: over-long conversations truncated, and the tokens cut.
        num_dropped, num_split: over-long conversations dropped, split. num_split_pieces: their
            pieces.
        num_empty: conversations with no token, left out.
        num_without_targets: packed conversations with no target under the causal shift (e.g.
            truncation cut every assistant token): they take room and train nothing.
        num_rows: rows produced.
        num_tokens: tokens in the rows (a token repeated at a cut counts once per piece).
    """

    max_length: int
    num_conversations: int = 0
    num_packed: int = 0
    num_truncated: int = 0
    num_truncated_tokens: int = 0
    num_dropped: int = 0
    num_split: int = 0
    num_split_pieces: int = 0
    num_empty: int = 0
    num_without_targets: int = 0
    num_rows: int = 0
    num_tokens: int = 0

    @property
    def efficiency(self) -> float:
        """Real tokens over capacity: ``num_tokens / (num_rows * max_length)``, 1.0 without rows."""
        return self.num_tokens / (self.num_rows * self.max_length) if self.num_rows else 1.0

    def __str__(self) -> str:
        return (
            f"packed {self.num_packed} of {self.num_conversations} conversations into "
            f"{self.num_rows} rows of {self.max_length} tokens (efficiency {self.efficiency:.2%}); "
            f"truncated {self.num_truncated} ({self.num_truncated_tokens} tokens cut), dropped "
            f"{self.num_dropped}, split {self.num_split} (into {self.num_split_pieces} pieces), "
            f"empty {self.num_empty}, without targets {self.num_without_targets}"
        )

    def log(self) -> None:
        """Log the summary: a warning when conversations were truncated, dropped, empty or
        untrained, else info.
        """
        lossy = self.num_truncated or self.num_dropped or self.num_empty or self.num_without_targets
        logger.log(logging.WARNING if lossy else logging.INFO, "%s", self)


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Assign items to bins of ``capacity`` with best-fit-decreasing.

    Longest first (ties in input order), each into the open bin with the least room that holds it.
    O(n log n).

    Args:
        lengths: sequence of int, item sizes, each in ``[1, capacity]``.
        capacity: bin size.

    Returns:
        for each bin, in the order the bins were opened, the indices of its items in the order they
        were placed.

    Example:
        >>> from collators.planning import best_fit_decreasing
        >>> best_fit_decreasing([3, 6, 2, 5, 4], capacity=8)
        [[1, 2], [3, 0], [4]]
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(
            f"`lengths` must lie in [1, capacity={capacity}], got {lengths.min()}..{lengths.max()}."
        )
    items, per_row = _best_fit_decreasing(lengths, capacity)
    bounds = np.concatenate(([0], np.cumsum(per_row))).tolist()
    items = items.tolist()
    return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Core of ``best_fit_decreasing``: (item indices in row order, number of items per row)."""
    order = np.argsort(-lengths, kind="stable")
    # Open bins grouped by free space: ``free_levels`` sorted, ``bins_at[f]`` the bins with ``f``
    # free. The best fit for length L is a bin at the first level >= L (bisection); both are at most
    # ``capacity`` long.
    free_levels: list[int] = []
    bins_at: list[list[int]] = [[] for _ in range(capacity + 1)]
    bin_of = [0] * len(order)
    num_bins = 0
    for rank, length in enumerate(lengths[order].tolist()):
        level = bisect.bisect_left(free_levels, length)
        if level == len(free_levels):
            target, free = num_bins, capacity - length
            num_bins += 1
        else:
            free = free_levels[level]
            candidates = bins_at[free]
            target = candidates.pop()
            if not candidates:
                del free_levels[level]
            free -= length
        bin_of[rank] = target
        if free:
            candidates = bins_at[free]
            if not candidates:
                bisect.insort(free_levels, free)
            candidates.append(target)
    # A stable sort by bin keeps each bin's items in placement order.
    bin_of = np.array(bin_of, dtype=np.int64)
    by_bin = np.argsort(bin_of, kind="stable")
    return order[by_bin], np.bincount(bin_of, minlength=num_bins)


def check_packing_options(max_length, overflow, name: str = "max_length") -> int:
    """``max_length`` checked for ``overflow`` (itself checked)."""
    if overflow not in OVERFLOWS:
        raise ValueError(
            f"`overflow` must be one of {', '.join(map(repr, OVERFLOWS))}, got {overflow!r}."
        )
    # A piece of one token has no target and would not advance: splitting needs two tokens per row.
    return positive_int(max_length, name, minimum=2 if overflow == "split" else 1)


def cut_to_capacity(
    lengths: np.ndarray, max_length: int, overflow: Overflow, stats: PackingStats
) -> np.ndarray:
    """Lengths after overflow handling (split conversations keep theirs): 0 for an item left out."""
    too_long = lengths > max_length
    stats.num_conversations += len(lengths)
    stats.num_empty += int((lengths == 0).sum())
    if too_long.any():
        if overflow == "error":
            first = int(np.flatnonzero(too_long)[0])
            raise ValueError(
                f"{int(too_long.sum())} conversations are longer than `max_length`={max_length} "
                f"(the first, at index {first}, has {int(lengths[first])} tokens); use "
                "overflow='truncate', 'drop' or 'split'."
            )
        if overflow == "truncate":
            stats.num_truncated += int(too_long.sum())
            stats.num_truncated_tokens += int((lengths[too_long] - max_length).sum())
            lengths = np.minimum(lengths, max_length)
        elif overflow == "drop":
            stats.num_dropped += int(too_long.sum())
            lengths = np.where(too_long, 0, lengths)
        else:
            stats.num_split += int(too_long.sum())
    return lengths


@dataclasses.dataclass(frozen=True)
class Plan:
    """Which piece of which conversation goes where: pieces in row order, rows in opening order."""

    source: np.ndarray  # (P,) int64: index of the piece's conversation in the input
    offset: np.ndarray  # (P,) int64: the piece's first token in its conversation (0 unless split)
    length: np.ndarray  # (P,) int64: tokens of the piece
    per_row: np.ndarray  # (R,) int64: pieces in each row


def plan_rows(kept: np.ndarray, max_length: int, split: bool, stats: PackingStats) -> Plan:
    """Pieces of conversations of ``kept`` tokens (0: left out), packed best-fit-decreasing."""
    source = np.flatnonzero(kept > 0)
    length = kept[source]
    offset = np.zeros_like(length)
    if split:
        # Pieces start every M - 1 tokens (see the module docstring): ceil((L - 1) / (M - 1)) of
        # them.
        stride = max_length - 1
        num_pieces = np.maximum(1, -(-(length - 1) // stride))
        first_piece = np.cumsum(num_pieces) - num_pieces
        piece = np.arange(int(num_pieces.sum())) - np.repeat(first_piece, num_pieces)
        source, offset = np.repeat(source, num_pieces), piece * stride
        length = np.minimum(max_length, np.repeat(length, num_pieces) - offset)
        stats.num_split_pieces += int(num_pieces[num_pieces > 1].sum())
    order, per_row = _best_fit_decreasing(length, max_length)
    stats.num_packed += int((kept > 0).sum())
    stats.num_rows += len(per_row)
    stats.num_tokens += int(length.sum())
    return Plan(source[order], offset[order], length[order], per_row)


def row_metadata(plan: Plan, targets: np.ndarray, split: bool) -> dict[str, np.ndarray]:
    """The rows' own per-piece columns: ``seq_lengths`` and, when splitting, ``seq_targets``: the
    target count of the piece's whole conversation, 1 for one without targets (a finite divisor; it
    has nothing to weigh).
    """
    columns = {SEQ_LENGTHS: plan.length}
    if split:
        columns[SEQ_TARGETS] = np.maximum(targets[plan.source], 1)
    return columns


def carried_columns(names, where: str = "dataset") -> dict[str, SequenceColumn]:
    """The data set columns packing carries to the pieces, by name, in the order rows hold them:
    those of ``SEQUENCE_COLUMNS`` in its order, then the others in ``names``' order
    (``carried_column``).

    Raises:
        ValueError naming ``where``: ``input_ids`` or ``labels`` missing, a column whose row name
            packing writes itself, an ``images`` column (``pack_dataset`` carries it itself; a
            stream is refused).
    """
    missing = [name for name in (INPUT_IDS, LABELS) if name not in names]
    if missing:
        raise ValueError(f"`{where}` lacks the column(s) {missing}; its columns are {list(names)}.")
    if IMAGES in names:
        raise ValueError(
            f"`{where}` holds conversations with images, which a stream is not packed with: pack "
            "a datasets.Dataset (pack_dataset gives each row its conversations' images), or "
            "collate the conversations as they come with collators.VisionCollator"
        )
    others = [carried_column(name) for name in names if name not in (INPUT_IDS, LABELS)]
    order = {column.key: rank for rank, column in enumerate(SEQUENCE_COLUMNS)}
    # stable: the others keep their order
    others.sort(key=lambda column: order.get(column.key, len(order)))
    for column in others:
        if column.key in PACKED_ROW_COLUMNS and column not in SEQUENCE_COLUMNS:
            raise ValueError(
                f"`{where}` column {column.column!r} would be carried to the rows as "
                f"{column.key!r}, a column packing writes itself: rename it."
            )
    return {column.column: column for column in others}
