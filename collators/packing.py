"""Packing tokenized conversations into rows of at most ``max_length`` tokens, boundaries kept.

``pack_dataset`` packs a whole data set at once with best-fit-decreasing (rows written to an Arrow cache,
``arrow_rows``); ``pack_stream`` and ``PackedIterableDataset`` pack a stream window by window. Rows:
``{"input_ids", "labels", "seq_lengths"}``, plus ``seq_targets`` when splitting and ``seq_weights`` with a ``weight``.

Splitting (``overflow="split"``): a conversation of ``L > M = max_length`` tokens becomes pieces starting every
``M - 1`` tokens, piece ``k`` = tokens ``[k (M - 1), k (M - 1) + M)``. Each piece after the first repeats the last
token of the piece before, with label ``ignore_index``; under the causal shift it predicts the label at the cut, so
every label after the first is trained exactly once. Each piece's ``seq_targets`` is the target count of the whole
conversation: weighing each target ``1 / seq_targets`` gives the conversation a total weight of 1 however it was cut.
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

from .arrow_rows import PIECE_COLUMNS, TokenColumn, list_array, scan_tokens, write_rows
from .checks import check_tokens, conversation_weight, positive_int, targets_per_sequence, token_array, weight_array
from .columns import (
    IGNORE_INDEX, INPUT_IDS, LABELS, PACKED_ROW_COLUMNS, SEQ_LENGTHS, SEQ_SOURCES, SEQ_TARGETS, SEQ_WEIGHTS,
    SOURCE_COLUMN, WEIGHT_COLUMN,
)

logger = logging.getLogger(__name__)

Overflow = Literal["truncate", "drop", "error", "split"]
OVERFLOWS = ("truncate", "drop", "error", "split")


@dataclasses.dataclass
class PackingStats:
    """What packing did: nothing is dropped, shortened or cut without being counted here.

    Attributes:
        max_length (``int``): the row capacity in tokens.
        num_conversations (``int``): conversations read.
        num_packed (``int``): conversations placed in rows (truncated and split ones included, each once).
        num_truncated, num_truncated_tokens (``int``): over-long conversations truncated, and the tokens cut.
        num_dropped, num_split (``int``): over-long conversations dropped, split. num_split_pieces: their pieces.
        num_empty (``int``): conversations with no token, left out.
        num_without_targets (``int``): packed conversations with no target under the causal shift (e.g.
            truncation cut every assistant token): they take room and train nothing.
        num_rows (``int``): rows produced.
        num_tokens (``int``): tokens in the rows (a token repeated at a cut counts once per piece).
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
        """Real tokens over row capacity: ``num_tokens / (num_rows * max_length)`` (1.0 when there is no row)."""
        return self.num_tokens / (self.num_rows * self.max_length) if self.num_rows else 1.0

    def __str__(self) -> str:
        return (
            f"packed {self.num_packed} of {self.num_conversations} conversations into {self.num_rows} rows of "
            f"{self.max_length} tokens (efficiency {self.efficiency:.2%}); truncated {self.num_truncated} "
            f"({self.num_truncated_tokens} tokens cut), dropped {self.num_dropped}, split {self.num_split} "
            f"(into {self.num_split_pieces} pieces), empty {self.num_empty}, without targets "
            f"{self.num_without_targets}"
        )

    def log(self) -> None:
        """Log the summary: a warning when conversations were truncated, dropped, empty or untrained, else info."""
        lossy = self.num_truncated or self.num_dropped or self.num_empty or self.num_without_targets
        logger.log(logging.WARNING if lossy else logging.INFO, "%s", self)


def best_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Assign items to bins of ``capacity`` with best-fit-decreasing.

    Longest first (ties in input order), each into the open bin with the least room that holds it. O(n log n).

    Args:
        lengths (sequence of int): item sizes, each in ``[1, capacity]``.
        capacity (``int``): bin size.

    Returns:
        ``list[list[int]]``: for each bin, in the order the bins were opened, the indices of its items in the
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
    """Core of ``best_fit_decreasing``: (item indices in row order, number of items per row)."""
    order = np.argsort(-lengths, kind="stable")
    # Open bins grouped by free space: ``free_levels`` sorted, ``bins_at[f]`` the bins with ``f`` free. The best
    # fit for length L is a bin at the first level >= L (bisection); both are at most ``capacity`` long.
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


def _check_packing_options(max_length, overflow, name: str = "max_length") -> int:
    if overflow not in OVERFLOWS:
        raise ValueError(f"`overflow` must be one of {', '.join(map(repr, OVERFLOWS))}, got {overflow!r}.")
    # A piece of one token has no target and would not advance: splitting needs two tokens per row.
    return positive_int(max_length, name, minimum=2 if overflow == "split" else 1)


def _cut_to_capacity(lengths: np.ndarray, max_length: int, overflow: Overflow, stats: PackingStats) -> np.ndarray:
    """Lengths after overflow handling (split conversations keep theirs): 0 marks an item left out."""
    too_long = lengths > max_length
    stats.num_conversations += len(lengths)
    stats.num_empty += int((lengths == 0).sum())
    if too_long.any():
        if overflow == "error":
            first = int(np.flatnonzero(too_long)[0])
            raise ValueError(
                f"{int(too_long.sum())} conversations are longer than `max_length`={max_length} (the first, at "
                f"index {first}, has {int(lengths[first])} tokens); use overflow='truncate', 'drop' or 'split'."
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
class _Plan:
    """Which piece of which conversation goes where: pieces in row order, rows in the order they were opened."""

    source: np.ndarray  # (P,) int64: index of the piece's conversation in the input
    offset: np.ndarray  # (P,) int64: first token of the piece within its conversation (0 unless split)
    length: np.ndarray  # (P,) int64: tokens of the piece
    per_row: np.ndarray  # (R,) int64: pieces in each row


def _plan_rows(kept: np.ndarray, max_length: int, split: bool, stats: PackingStats) -> _Plan:
    """Cut conversations of ``kept`` tokens (0: left out) into pieces and pack them with best-fit-decreasing."""
    source = np.flatnonzero(kept > 0)
    length = kept[source]
    offset = np.zeros_like(length)
    if split:
        # Pieces start every M - 1 tokens (see the module docstring): ceil((L - 1) / (M - 1)) of them.
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
    return _Plan(source[order], offset[order], length[order], per_row)


def _row_metadata(plan: _Plan, targets: np.ndarray, weights: np.ndarray | None, split: bool) -> dict[str, np.ndarray]:
    """Per-piece columns next to ``seq_lengths``: ``seq_targets`` (when splitting) and ``seq_weights`` (with weights).

    ``seq_targets``: the target count of the piece's whole conversation, 1 for one without targets (a finite
    divisor; it has nothing to weigh).
    """
    columns = {SEQ_LENGTHS: plan.length}
    if split:
        columns[SEQ_TARGETS] = np.maximum(targets[plan.source], 1)
    if weights is not None:
        columns[SEQ_WEIGHTS] = weights[plan.source]
    return columns


def pack_dataset(
    dataset,
    max_length: int,
    *,
    overflow: Overflow = "truncate",
    ignore_index: int = IGNORE_INDEX,
    return_stats: bool = False,
    cache_file_name: str | None = None,
    num_proc: int | None = None,
    load_from_cache_file: bool | None = None,
):
    """Pack tokenized conversations into rows of at most ``max_length`` tokens with best-fit-decreasing.

    The whole data set at once, so long conversations of one part find short ones of another; deterministic.
    An over-long conversation is truncated (default), dropped, split (module docstring) or raises; each case is
    counted in ``PackingStats`` and logged. Memory does not grow with the token count: the plan needs only
    lengths and target counts, and rows are written with ``datasets.Dataset.map`` to an Arrow cache beside the
    data set's (reused by a second identical call; in memory for an in-memory data set unless
    ``cache_file_name`` is set).

    Args:
        dataset (``datasets.Dataset`` or ``datasets.IterableDataset``): ``input_ids`` and ``labels`` (equal-length
            lists of ints, as ``tokenize_dataset`` makes), optionally ``weight`` (real >= 0 per conversation). Every
            other column goes to each piece: ``weight`` as ``seq_weights``, ``source`` (strings) as ``seq_sources``,
            ``name`` as ``seq_<name>``; a column of lists or structs raises. An ``IterableDataset`` is read into
            memory (use ``pack_stream`` for a stream).
        max_length (``int``): row capacity in tokens (at least 2 with ``overflow="split"``).
        overflow (``str``, *optional*, defaults to ``"truncate"``): what to do with a conversation longer than
            ``max_length``: ``"truncate"``, ``"drop"``, ``"split"`` or ``"error"`` (raise ``ValueError``).
        ignore_index (``int``, *optional*, defaults to -100): the label of untrained tokens.
        return_stats (``bool``, *optional*, defaults to ``False``): also return the ``PackingStats``.
        cache_file_name (``str``, *optional*): where to write the rows (``datasets.Dataset.map``'s argument).
        num_proc (``int``, *optional*): processes writing the rows (``datasets.Dataset.map``'s argument).
        load_from_cache_file (``bool``, *optional*): reuse rows already written (default: unless caching is
            disabled in ``datasets``).

    Returns:
        ``datasets.Dataset`` of ``input_ids``, ``labels`` (at most ``max_length``), ``seq_lengths`` (summing to the row's
        length), ``seq_targets`` when splitting, then the carried columns, one value per sequence (``seq_weights``
        float64); ``(dataset, PackingStats)`` with ``return_stats``. Longest rows first: shuffle in the DataLoader.

    Raises:
        ``TypeError``: ``dataset`` is not a data set, ``max_length`` not an int, tokens or weights of the wrong type.
        ``ValueError`` naming the row or column: ``max_length`` too small, unknown ``overflow``, missing columns,
            negative ids or labels, unequal lengths, weights not finite and >= 0, a non-string ``source``.

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

    Split into rows of 4: the repeated 7 (label -100) predicts 8, the target at the cut; both pieces carry the
    conversation's 4 targets:

    >>> split = pack_dataset(dataset.select([1, 2]), max_length=4, overflow="split")
    >>> split["input_ids"][:], split["labels"][:]
    ([[4, 5, 6, 7], [7, 8, 9], [10, 11]], [[-100, -100, 6, 7], [-100, 8, 9], [-100, 11]])
    >>> split["seq_lengths"][:], split["seq_targets"][:]
    ([[4], [3], [2]], [[4], [4], [1]])
    """
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import Hasher

    max_length = _check_packing_options(max_length, overflow)
    if isinstance(dataset, datasets.IterableDataset):
        dataset, fingerprint = _read_iterable(dataset), None
    elif isinstance(dataset, datasets.Dataset):
        fingerprint = Hasher.hash((dataset._fingerprint, max_length, overflow, ignore_index, "best-fit-decreasing"))
    else:
        raise TypeError(
            f"`dataset` must be a datasets.Dataset or datasets.IterableDataset, got {type(dataset).__name__}; "
            "pack other iterables of examples with pack_stream or PackedIterableDataset."
        )
    carried = _carried_columns(dataset.data.table.schema)
    if dataset._indices is not None:
        dataset = dataset.flatten_indices()  # rows in order on disk, so that they can be read in place
    table = dataset.data.table
    input_ids, labels = TokenColumn(table, INPUT_IDS), TokenColumn(table, LABELS)
    lengths = input_ids.lengths
    if not np.array_equal(lengths, labels.lengths):
        row = int(np.flatnonzero(lengths != labels.lengths)[0])
        raise ValueError(
            f"`dataset` row {row} has {lengths[row]} input_ids but {labels.lengths[row]} labels: they must agree."
        )
    weights = _read_weights(table)

    stats = PackingStats(max_length=max_length)
    kept = _cut_to_capacity(lengths, max_length, overflow, stats)
    targets = scan_tokens(input_ids, labels, kept, ignore_index)
    stats.num_without_targets += int(((kept > 0) & (targets == 0)).sum())
    plan = _plan_rows(kept, max_length, overflow == "split", stats)

    # The plan as a table, one row per packed row: where each piece comes from, then the rows' own columns.
    piece_bounds = np.concatenate(([0], np.cumsum(plan.per_row)))
    columns = dict(zip(PIECE_COLUMNS, (plan.source, plan.offset)))
    columns.update(_row_metadata(plan, targets, weights, overflow == "split"))
    columns = {name: list_array(piece_bounds, pa.array(values)) for name, values in columns.items()}
    source = pa.array(plan.source)
    for name, row_name in carried.items():
        columns[row_name] = list_array(piece_bounds, table.column(name).combine_chunks().take(source))
    rows = write_rows(
        dataset, (input_ids, labels), pa.table(columns), fingerprint=fingerprint, max_length=max_length,
        ignore_index=ignore_index, cache_file_name=cache_file_name, num_proc=num_proc,
        load_from_cache_file=load_from_cache_file,
    )
    stats.log()
    return (rows, stats) if return_stats else rows


def _carried_columns(schema) -> dict[str, str]:
    """The columns carried to the pieces, by row column name (``source`` -> ``seq_sources``, ``name`` ->
    ``seq_<name>``); ValueError naming a missing token column, a list or struct column, a name taken, a non-string
    ``source``."""
    import pyarrow as pa

    missing = {INPUT_IDS, LABELS} - set(schema.names)
    if missing:
        raise ValueError(f"`dataset` lacks the column(s) {sorted(missing)}; its columns are {schema.names}.")
    carried = {}
    for name in schema.names:
        if name in (INPUT_IDS, LABELS, WEIGHT_COLUMN):
            continue
        row_name = SEQ_SOURCES if name == SOURCE_COLUMN else f"seq_{name}"
        value_type = schema.field(name).type
        if name == SOURCE_COLUMN and not (pa.types.is_string(value_type) or pa.types.is_large_string(value_type)):
            raise ValueError(f"`dataset` column {SOURCE_COLUMN!r} must hold a string for every row, got {value_type}.")
        if pa.types.is_nested(value_type):
            raise ValueError(
                f"`dataset` column {name!r} holds {value_type}, not one value per conversation, so packed rows "
                f"cannot carry it (they hold one value per sequence): remove it with "
                f"dataset.remove_columns({name!r}) or reduce it to one value per conversation."
            )
        if row_name in PACKED_ROW_COLUMNS and name != SOURCE_COLUMN:
            raise ValueError(
                f"`dataset` column {name!r} would be carried to the rows as {row_name!r}, a column packing "
                "writes itself: rename it."
            )
        carried[name] = row_name
    return carried


def _read_weights(table) -> np.ndarray | None:
    """The ``weight`` column as ``(C,)`` float64, checked; None without one."""
    if WEIGHT_COLUMN not in table.column_names:
        return None
    column = table.column(WEIGHT_COLUMN)
    if column.null_count:
        raise ValueError(f"`dataset` column {WEIGHT_COLUMN!r} has {column.null_count} missing values.")
    return weight_array(column.to_numpy(), f"dataset[{WEIGHT_COLUMN!r}]")


def _read_iterable(dataset):
    """A ``datasets.IterableDataset`` read to the end into an in-memory ``datasets.Dataset``, each row checked."""
    import datasets

    rows = []
    for index, row in enumerate(dataset):
        if index == 0:
            names = set(row)
            missing = {INPUT_IDS, LABELS} - names
            if missing:
                raise ValueError(f"`dataset` lacks the column(s) {sorted(missing)}; its columns are {sorted(names)}.")
        elif set(row) != names:
            raise ValueError(
                f"`dataset[{index}]` has the columns {sorted(row)}, unlike the first row's {sorted(names)}."
            )
        row = dict(row)
        for name in (INPUT_IDS, LABELS):
            row[name] = token_array(row[name], f"dataset[{index}][{name!r}]")
        if WEIGHT_COLUMN in row:
            row[WEIGHT_COLUMN] = conversation_weight(row[WEIGHT_COLUMN], f"dataset[{index}][{WEIGHT_COLUMN!r}]")
        if SOURCE_COLUMN in row and not isinstance(row[SOURCE_COLUMN], str):
            raise ValueError(f"`dataset[{index}][{SOURCE_COLUMN!r}]` must be a string, got {row[SOURCE_COLUMN]!r}.")
        rows.append(row)
    if not rows:
        features = datasets.Features({name: [datasets.Value("int64")] for name in (INPUT_IDS, LABELS)})
        return datasets.Dataset.from_dict({INPUT_IDS: [], LABELS: []}, features=features)
    return datasets.Dataset.from_list(rows)


def pack_stream(
    examples: Iterable[Mapping],
    max_tokens: int,
    *,
    overflow: Overflow = "truncate",
    buffer_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    stats: PackingStats | None = None,
) -> Iterator[dict[str, list]]:
    """Pack a stream of tokenized conversations into rows of at most ``max_tokens`` tokens, on the fly.

    Each ``buffer_size`` conversations are packed with best-fit-decreasing (bounded memory; a larger buffer packs
    tighter); over-long ones as in ``pack_dataset``, counted in ``stats`` and logged at the end.

    Args:
        examples (iterable of dict): each with ``input_ids`` and ``labels`` (equal-length sequences of ints) and
            optionally ``weight`` (in every example or in none), e.g. a tokenized ``datasets.IterableDataset``.
        max_tokens (``int``): row capacity in tokens (at least 2 with ``overflow="split"``).
        overflow (``str``, *optional*, defaults to ``"truncate"``): ``"truncate"``, ``"drop"``, ``"split"`` or
            ``"error"``.
        buffer_size (``int``, *optional*, defaults to 1024): conversations packed together.
        ignore_index (``int``, *optional*, defaults to -100): the label of untrained tokens.
        stats (``PackingStats``, *optional*): updated in place as the stream is read.

    Yields:
        ``dict``: the row layout of ``pack_dataset``.

    Example:

    >>> from collators import pack_stream
    >>> stream = ({"input_ids": ids, "labels": ids} for ids in ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10]))
    >>> [row["seq_lengths"] for row in pack_stream(stream, max_tokens=6)]
    [[5], [3, 2]]
    >>> stream = ({"input_ids": ids, "labels": ids} for ids in ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10]))
    >>> [row["input_ids"] for row in pack_stream(stream, max_tokens=3, overflow="split")]
    [[1, 2, 3], [4, 5, 6], [6, 7, 8], [9, 10]]
    """
    # Checked here, at the call, not at the first row a generator would reach.
    max_tokens = _check_packing_options(max_tokens, overflow, "max_tokens")
    buffer_size = positive_int(buffer_size, "buffer_size")
    if stats is None:
        stats = PackingStats(max_length=max_tokens)
    return _pack_stream(examples, max_tokens, overflow, buffer_size, ignore_index, stats)


def _pack_stream(examples, max_tokens: int, overflow: Overflow, buffer_size: int, ignore_index: int, stats):
    buffer: list[tuple[np.ndarray, np.ndarray, float | None]] = []
    has_weight = None
    for index, example in enumerate(examples):
        name = f"examples[{index}]"
        input_ids = token_array(example[INPUT_IDS], f"{name}['input_ids']")
        labels = token_array(example[LABELS], f"{name}['labels']")
        if len(input_ids) != len(labels):
            raise ValueError(f"`{name}` has {len(input_ids)} input_ids but {len(labels)} labels: they must agree.")
        check_tokens(input_ids, labels, ignore_index, name)
        if has_weight is None:
            has_weight = WEIGHT_COLUMN in example
        if (WEIGHT_COLUMN in example) != has_weight:
            state = "lacks" if has_weight else "has"
            raise ValueError(f"`{name}` {state} a {WEIGHT_COLUMN!r}, unlike the first example.")
        weight = conversation_weight(example[WEIGHT_COLUMN], f"{name}[{WEIGHT_COLUMN!r}]") if has_weight else None
        buffer.append((input_ids, labels, weight))
        if len(buffer) == buffer_size:
            yield from _pack_buffer(buffer, max_tokens, overflow, ignore_index, stats)
            buffer = []
    if buffer:
        yield from _pack_buffer(buffer, max_tokens, overflow, ignore_index, stats)
    stats.log()


def _pack_buffer(buffer, max_tokens: int, overflow: Overflow, ignore_index: int, stats: PackingStats):
    lengths = np.array([len(input_ids) for input_ids, _, _ in buffer], dtype=np.int64)
    labels = np.concatenate([labels for _, labels, _ in buffer])
    kept = _cut_to_capacity(lengths, max_tokens, overflow, stats)
    targets = targets_per_sequence(labels, lengths, ignore_index, counted=kept)
    stats.num_without_targets += int(((kept > 0) & (targets == 0)).sum())
    weights = None if buffer[0][2] is None else np.array([weight for _, _, weight in buffer])
    plan = _plan_rows(kept, max_tokens, overflow == "split", stats)
    metadata = _row_metadata(plan, targets, weights, overflow == "split")
    metadata = {name: values.tolist() for name, values in metadata.items()}
    start = 0
    for count in plan.per_row.tolist():
        row = {INPUT_IDS: [], LABELS: []}
        for piece in range(start, start + count):
            input_ids, labels, _ = buffer[plan.source[piece]]
            a = int(plan.offset[piece])
            b = a + int(plan.length[piece])
            row[INPUT_IDS] += input_ids[a:b].tolist()
            # A piece after the first repeats the token before its cut (trained in the piece before).
            row[LABELS] += ([ignore_index] if a else []) + labels[a + bool(a) : b].tolist()
        row.update({name: values[start : start + count] for name, values in metadata.items()})
        start += count
        yield row


class PackedIterableDataset(torch.utils.data.IterableDataset):
    """A ``torch.utils.data.IterableDataset`` of packed rows over a stream of tokenized conversations.

    ``pack_stream`` for a ``DataLoader``. With ``num_workers > 0`` a ``torch.utils.data.IterableDataset`` source splits
    its own examples between workers; any other iterable is split here (worker ``w`` takes every
    ``num_workers``-th from ``w``). ``stats``: the last iteration's counts in this process.

    Args:
        source (iterable of dict): conversations with ``input_ids`` and ``labels``.
        max_tokens (``int``): row capacity in tokens.
        overflow (``str``, *optional*, defaults to ``"truncate"``): as in ``pack_stream`` (``"split"`` included).
        buffer_size (``int``, *optional*, defaults to 1024): as in ``pack_stream``.

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
        self.max_tokens = _check_packing_options(max_tokens, overflow, "max_tokens")
        positive_int(buffer_size, "buffer_size")
        self.overflow = overflow
        self.buffer_size = buffer_size
        self.stats = PackingStats(max_length=max_tokens)

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        self.stats = PackingStats(max_length=self.max_tokens)
        source = self.source
        worker = torch.utils.data.get_worker_info()
        if worker is not None and not isinstance(source, torch.utils.data.IterableDataset):
            # every num_workers-th conversation, so none is packed twice
            source = itertools.islice(source, worker.id, None, worker.num_workers)
        return pack_stream(
            source, self.max_tokens, overflow=self.overflow, buffer_size=self.buffer_size, stats=self.stats
        )
