"""Packing tokenized conversations into rows of at most `max_length` tokens, boundaries kept.

`pack_dataset` packs a whole `datasets.Dataset` at once with best-fit-decreasing; `pack_stream` and
`PackedIterableDataset` pack a stream window by window. Both emit rows of the same layout,
`{"input_ids", "labels", "seq_lengths"}`, which `PackedCollator` turns into a batch.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Literal

import numpy as np
import torch

logger = logging.getLogger(__name__)

Overflow = Literal["truncate", "drop", "error"]


@dataclasses.dataclass
class PackingStats:
    """What packing did to the conversations: nothing is dropped or shortened without being counted here.

    Attributes:
        max_length (`int`): the row capacity in tokens.
        num_conversations (`int`): conversations read.
        num_packed (`int`): conversations placed in a row (truncated ones included).
        num_truncated (`int`): conversations longer than `max_length`, cut to their first `max_length` tokens.
        num_truncated_tokens (`int`): tokens removed by that truncation.
        num_dropped (`int`): conversations longer than `max_length` left out (`overflow="drop"`).
        num_empty (`int`): conversations with no token, left out.
        num_rows (`int`): rows produced.
        num_tokens (`int`): tokens in the rows.
    """

    max_length: int
    num_conversations: int = 0
    num_packed: int = 0
    num_truncated: int = 0
    num_truncated_tokens: int = 0
    num_dropped: int = 0
    num_empty: int = 0
    num_rows: int = 0
    num_tokens: int = 0

    @property
    def efficiency(self) -> float:
        """Real tokens over row capacity: `num_tokens / (num_rows * max_length)` (1.0 when there is no row)."""
        return self.num_tokens / (self.num_rows * self.max_length) if self.num_rows else 1.0

    def __str__(self) -> str:
        return (
            f"packed {self.num_packed} of {self.num_conversations} conversations into {self.num_rows} rows of "
            f"{self.max_length} tokens (efficiency {self.efficiency:.2%}); truncated {self.num_truncated} "
            f"({self.num_truncated_tokens} tokens cut), dropped {self.num_dropped}, empty {self.num_empty}"
        )

    def log(self) -> None:
        """Log the summary: a warning when conversations were truncated, dropped or empty, else info."""
        level = logging.WARNING if self.num_truncated or self.num_dropped or self.num_empty else logging.INFO
        logger.log(level, "%s", self)


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Assign items to bins of `capacity` with best-fit-decreasing.

    Items are taken longest first (ties in input order); each goes into the open bin with the least free
    space that still holds it, or opens a new bin. Deterministic, O(n log n).

    Args:
        lengths (sequence of int): item sizes, each in `[1, capacity]`.
        capacity (`int`): bin size.

    Returns:
        `list[list[int]]`: for each bin, in the order the bins were opened, the indices of its items in the
        order they were placed.

    Example:

    >>> from collators.packing import best_fit_decreasing
    >>> best_fit_decreasing([3, 6, 2, 5, 4], capacity=8)
    [[1, 2], [3, 0], [4]]
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"`lengths` must lie in [1, capacity={capacity}], got {lengths.min()}..{lengths.max()}.")
    items, per_row = _best_fit_decreasing(lengths, capacity)
    bounds = np.concatenate(([0], np.cumsum(per_row))).tolist()
    items = items.tolist()
    return [items[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray]:
    """Core of `best_fit_decreasing`: (item indices in row order, number of items per row)."""
    order = np.argsort(-lengths, kind="stable")
    # Open bins are grouped by their free space: `free_levels` is the sorted list of free-space values held by
    # at least one bin and `bins_at[f]` the bins with exactly `f` tokens free. The best fit for an item of
    # length L is then any bin at the first level >= L, found by bisection; both structures are at most
    # `capacity` long, so the list insertions are short memmoves, cheaper than a tree walk in Python.
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


def _cut_to_capacity(lengths: np.ndarray, max_length: int, overflow: Overflow, stats: PackingStats) -> np.ndarray:
    """Lengths after overflow handling: 0 marks an item left out. Updates `stats`."""
    if overflow not in ("truncate", "drop", "error"):
        raise ValueError(f"`overflow` must be 'truncate', 'drop' or 'error', got {overflow!r}.")
    too_long = lengths > max_length
    stats.num_conversations += len(lengths)
    stats.num_empty += int((lengths == 0).sum())
    if too_long.any():
        if overflow == "error":
            first = int(np.flatnonzero(too_long)[0])
            raise ValueError(
                f"{int(too_long.sum())} conversations are longer than `max_length`={max_length} (the first, at "
                f"index {first}, has {int(lengths[first])} tokens); use overflow='truncate' or 'drop'."
            )
        if overflow == "truncate":
            stats.num_truncated += int(too_long.sum())
            stats.num_truncated_tokens += int((lengths[too_long] - max_length).sum())
            lengths = np.minimum(lengths, max_length)
        else:
            stats.num_dropped += int(too_long.sum())
            lengths = np.where(too_long, 0, lengths)
    return lengths


def pack_dataset(dataset, max_length: int, *, overflow: Overflow = "truncate", return_stats: bool = False):
    """Pack tokenized conversations into rows of at most `max_length` tokens with best-fit-decreasing.

    The whole data set is packed at once (not batch by batch), so the long conversations of one part
    find the short ones of another. A conversation is never split between rows: one longer than
    `max_length` is truncated to its first `max_length` tokens (default), dropped, or raises. Every such
    case is counted in the returned `PackingStats` and logged as a warning, with the packing efficiency
    (real tokens / (rows * max_length)). Deterministic: the same input gives the same rows.

    Args:
        dataset (`datasets.Dataset`): columns `input_ids` and `labels`, lists of ints of equal length per row
            (as made by `tokenize_dataset`). Other columns are not carried over.
        max_length (`int`): row capacity in tokens.
        overflow (`str`, *optional*, defaults to `"truncate"`): what to do with a conversation longer than
            `max_length`: `"truncate"`, `"drop"` or `"error"` (raise `ValueError`).
        return_stats (`bool`, *optional*, defaults to `False`): also return the `PackingStats`.

    Returns:
        `datasets.Dataset` with the columns `input_ids`, `labels` (lists of ints, at most `max_length` long) and
        `seq_lengths` (the length of each conversation in the row, in row order; they sum to the row's length),
        or `(dataset, PackingStats)` with `return_stats=True`. Rows come in the order they were opened
        (longest conversations first); shuffle them in the DataLoader.

    Example:

    >>> from datasets import Dataset
    >>> from collators import pack_dataset
    >>> dataset = Dataset.from_dict({
    ...     "input_ids": [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]],
    ...     "labels": [[-100, 2, 3], [-100, -100, 6, 7, 8, 9], [-100, 11], [-100, 13, 14, 15, 16]],
    ... })
    >>> packed, stats = pack_dataset(dataset, max_length=8, return_stats=True)
    >>> packed[0]
    {'input_ids': [4, 5, 6, 7, 8, 9, 10, 11], 'labels': [-100, -100, 6, 7, 8, 9, -100, 11], 'seq_lengths': [6, 2]}
    >>> packed[1]
    {'input_ids': [12, 13, 14, 15, 16, 1, 2, 3], 'labels': [-100, 13, 14, 15, 16, -100, 2, 3], 'seq_lengths': [5, 3]}
    >>> stats.num_rows, stats.efficiency, stats.num_truncated
    (2, 1.0, 0)
    """
    import datasets
    import pyarrow as pa
    import pyarrow.compute as pc
    from datasets.fingerprint import Hasher

    if max_length < 1:
        raise ValueError(f"`max_length` must be positive, got {max_length}.")
    missing = {"input_ids", "labels"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"`dataset` lacks the column(s) {sorted(missing)}; its columns are {dataset.column_names}.")

    # The Arrow view honours any selection or shuffle applied to the data set.
    table = dataset.select_columns(["input_ids", "labels"]).with_format("arrow")[:]
    input_ids = table["input_ids"].combine_chunks()
    labels = table["labels"].combine_chunks()
    lengths = pc.list_value_length(input_ids).to_numpy(zero_copy_only=False).astype(np.int64)
    if not np.array_equal(lengths, pc.list_value_length(labels).to_numpy(zero_copy_only=False)):
        raise ValueError("`dataset` has rows whose `input_ids` and `labels` differ in length.")

    stats = PackingStats(max_length=max_length)
    kept_lengths = _cut_to_capacity(lengths, max_length, overflow, stats)
    kept = np.flatnonzero(kept_lengths > 0)
    items, per_row = _best_fit_decreasing(kept_lengths[kept], max_length)
    items = kept[items]

    # Copy each item's kept tokens, in row order, out of the flattened token columns: one slice per item
    # joined by numpy is faster than Arrow's `take` on list arrays.
    seq_lengths = kept_lengths[items]
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))[items]
    spans = list(zip(starts.tolist(), (starts + seq_lengths).tolist()))
    item_bounds = np.concatenate(([0], np.cumsum(per_row)))
    token_bounds = np.concatenate(([0], np.cumsum(seq_lengths)))[item_bounds]

    def gather(column):
        values = column.flatten().to_numpy(zero_copy_only=False)
        return pa.array(np.concatenate([values[a:b] for a, b in spans]) if spans else values[:0])

    packed = pa.table(
        {
            "input_ids": _list_array(token_bounds, gather(input_ids)),
            "labels": _list_array(token_bounds, gather(labels)),
            "seq_lengths": _list_array(item_bounds, pa.array(seq_lengths)),
        }
    )
    stats.num_packed = len(items)
    stats.num_rows = len(per_row)
    stats.num_tokens = int(seq_lengths.sum())
    stats.log()
    # An explicit fingerprint spares `datasets` hashing every token of the result.
    fingerprint = Hasher.hash((dataset._fingerprint, max_length, overflow, "best-fit-decreasing"))
    result = datasets.Dataset(datasets.table.InMemoryTable(packed), fingerprint=fingerprint)
    return (result, stats) if return_stats else result


def _list_array(bounds: np.ndarray, values):
    """Arrow lists `values[bounds[i]:bounds[i+1]]`; 64-bit offsets only when 32 bits cannot hold them."""
    import pyarrow as pa

    if bounds[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(bounds.astype(np.int32)), values)
    return pa.LargeListArray.from_arrays(pa.array(bounds), values)


def pack_stream(
    examples: Iterable[Mapping],
    max_tokens: int,
    *,
    overflow: Overflow = "truncate",
    buffer_size: int = 1024,
    stats: PackingStats | None = None,
) -> Iterator[dict[str, list[int]]]:
    """Pack a stream of tokenized conversations into rows of at most `max_tokens` tokens, on the fly.

    Conversations are read `buffer_size` at a time and each buffer is packed with best-fit-decreasing, so
    memory stays bounded on streaming data sets; a larger buffer packs tighter. Over-long conversations are
    handled as in `pack_dataset` and counted in `stats`; a summary is logged when the stream ends.

    Args:
        examples (iterable of dict): each with `input_ids` and `labels` (equal-length sequences of ints),
            e.g. a tokenized `datasets.IterableDataset`.
        max_tokens (`int`): row capacity in tokens.
        overflow (`str`, *optional*, defaults to `"truncate"`): `"truncate"`, `"drop"` or `"error"`.
        buffer_size (`int`, *optional*, defaults to 1024): conversations packed together.
        stats (`PackingStats`, *optional*): updated in place as the stream is read.

    Yields:
        `dict` with `input_ids`, `labels` and `seq_lengths` (lists of ints), the row layout of `pack_dataset`.

    Example:

    >>> from collators import pack_stream
    >>> stream = ({"input_ids": ids, "labels": ids} for ids in ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10]))
    >>> [row["seq_lengths"] for row in pack_stream(stream, max_tokens=6)]
    [[5], [3, 2]]
    """
    if stats is None:
        stats = PackingStats(max_length=max_tokens)
    buffer: list[tuple[list[int], list[int]]] = []
    for example in examples:
        input_ids, labels = list(example["input_ids"]), list(example["labels"])
        if len(input_ids) != len(labels):
            raise ValueError("`examples` has an example whose `input_ids` and `labels` differ in length.")
        buffer.append((input_ids, labels))
        if len(buffer) == buffer_size:
            yield from _pack_buffer(buffer, max_tokens, overflow, stats)
            buffer = []
    yield from _pack_buffer(buffer, max_tokens, overflow, stats)
    stats.log()


def _pack_buffer(buffer, max_tokens, overflow, stats) -> Iterator[dict[str, list[int]]]:
    lengths = _cut_to_capacity(np.array([len(ids) for ids, _ in buffer], dtype=np.int64), max_tokens, overflow, stats)
    kept = np.flatnonzero(lengths > 0)
    items, per_row = _best_fit_decreasing(lengths[kept], max_tokens)
    items = kept[items].tolist()
    start = 0
    for count in per_row.tolist():
        row = {"input_ids": [], "labels": [], "seq_lengths": []}
        for item in items[start : start + count]:
            length = int(lengths[item])
            row["input_ids"] += buffer[item][0][:length]
            row["labels"] += buffer[item][1][:length]
            row["seq_lengths"].append(length)
        start += count
        stats.num_packed += count
        stats.num_rows += 1
        stats.num_tokens += len(row["input_ids"])
        yield row


class PackedIterableDataset(torch.utils.data.IterableDataset):
    """A `torch.utils.data.IterableDataset` of packed rows over a stream of tokenized conversations.

    Wraps `pack_stream` so a streaming data set can feed a `DataLoader`. With `num_workers > 0`, a source
    that is itself a `torch.utils.data.IterableDataset` (as `datasets.IterableDataset` is) is trusted to split
    its examples between the workers; any other iterable is split here, worker `w` taking examples
    `w, w + num_workers, ...`. `stats` holds the counts of the last iteration in this process.

    Args:
        source (iterable of dict): conversations with `input_ids` and `labels`.
        max_tokens (`int`): row capacity in tokens.
        overflow (`str`, *optional*, defaults to `"truncate"`): as in `pack_stream`.
        buffer_size (`int`, *optional*, defaults to 1024): as in `pack_stream`.

    Example:

    >>> from torch.utils.data import DataLoader
    >>> from collators import PackedCollator, PackedIterableDataset
    >>> source = [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [4, 5]}]
    >>> loader = DataLoader(PackedIterableDataset(source, max_tokens=8), batch_size=1, collate_fn=PackedCollator())
    >>> batch = next(iter(loader))
    >>> batch["input_ids"], batch["cu_seqlens"]
    (tensor([[1, 2, 3, 4, 5]]), tensor([0, 3, 5], dtype=torch.int32))
    """

    def __init__(
        self, source: Iterable[Mapping], max_tokens: int, *, overflow: Overflow = "truncate", buffer_size: int = 1024
    ):
        self.source = source
        self.max_tokens = max_tokens
        self.overflow = overflow
        self.buffer_size = buffer_size
        self.stats = PackingStats(max_length=max_tokens)

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        self.stats = PackingStats(max_length=self.max_tokens)
        source = self.source
        worker = torch.utils.data.get_worker_info()
        if worker is not None and not isinstance(source, torch.utils.data.IterableDataset):
            # A plain iterable does not know about workers: each takes every num_workers-th conversation, so
            # none is packed twice.
            source = itertools.islice(source, worker.id, None, worker.num_workers)
        return pack_stream(
            source, self.max_tokens, overflow=self.overflow, buffer_size=self.buffer_size, stats=self.stats
        )
