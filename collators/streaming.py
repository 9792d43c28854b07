"""Packing a stream window by window: memory bounded by the window, whatever the stream's length.

``pack_windows`` reads and checks the conversations, packs each window of ``buffer_size`` with
best-fit-decreasing (``planning``) and yields its rows as arrays; ``pack_stream`` /
``PackedIterableDataset`` turn them into rows one by one, ``write_stream`` (``pack_dataset`` on a
``datasets.IterableDataset``) into an Arrow file a window at a time. All three give the rows of
``pack_dataset``: the same columns, carried the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from packed_ce.columns import (
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    SEQ_LENGTHS,
    SEQ_TARGETS,
    SequenceColumn,
)

from .arrow_rows import list_array
from .checks import check_tokens, positive_int, targets_per_sequence, token_array
from .planning import (
    Overflow,
    PackingStats,
    carried_columns,
    check_packing_options,
    cut_to_capacity,
    plan_rows,
    row_metadata,
)


def renamed_max_length(max_length, max_tokens, where: str):
    """``max_length``, or ``max_tokens`` (its former name in ``pack_stream`` and
    ``PackedIterableDataset``) with a ``FutureWarning``; a TypeError for both or neither.
    """
    if max_tokens is None:
        if max_length is None:
            raise TypeError(f"{where} needs `max_length`, the row capacity in tokens.")
        return max_length
    if max_length is not None:
        raise TypeError(f"{where}: pass `max_length` only (`max_tokens` is its former name).")
    warnings.warn(
        f"{where}(max_tokens=...) is renamed max_length (the name pack_dataset uses); "
        "max_tokens will be removed",
        FutureWarning,
        stacklevel=3,
    )
    return max_tokens


# ``pack_dataset``'s window on a ``datasets.IterableDataset``, in conversations: at a mean of 500
# tokens about 8M tokens, +0.15 GiB held, 0.07% more rows than packing the whole data set
# (benchmarks/README.md, per window).
STREAM_WINDOW = 16384
_INT32 = np.iinfo(np.int32)


@dataclasses.dataclass
class Window:
    """The rows packed from one window, as arrays.

    Attributes:
        input_ids, labels: ``(N,)`` int32 (int64 where a value needs it), the rows' tokens back to
            back.
        token_bounds: ``(R + 1,)`` int64, row ``r`` holds tokens
            ``[token_bounds[r], token_bounds[r + 1])``.
        piece_bounds: ``(R + 1,)`` int64, row ``r`` holds pieces
            ``[piece_bounds[r], piece_bounds[r + 1])``.
        columns: per row column after the tokens (``seq_lengths``, ``seq_targets``, the carried
            ones), one value per piece: an array, or a list for a column without a ``dtype``.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    token_bounds: np.ndarray
    piece_bounds: np.ndarray
    columns: dict


def pack_windows(
    examples: Iterable[Mapping],
    max_length: int,
    overflow: Overflow,
    buffer_size: int,
    ignore_index: int,
    stats: PackingStats,
    where: str = "examples",
) -> Iterator[Window]:
    """Check each conversation of ``examples`` and pack each ``buffer_size`` of them, updating
    ``stats`` (logged at the end). Every example has the first one's columns; errors name
    ``{where}[index]``.
    """
    buffer, carried, names = _Buffer(ignore_index), {}, None
    for index, example in enumerate(examples):
        name = f"{where}[{index}]"
        if names is None:
            names = set(example)
            carried = carried_columns(list(example), where)
        elif set(example) != names:
            missing, extra = sorted(names - set(example)), sorted(set(example) - names)
            differences = [f"lacks {missing}"] * bool(missing) + [f"has {extra}"] * bool(extra)
            raise ValueError(
                f"`{name}` {' and '.join(differences)}, unlike the first example: give every "
                "conversation the same columns."
            )
        input_ids = token_array(example[INPUT_IDS], f"{name}['input_ids']")
        labels = token_array(example[LABELS], f"{name}['labels']")
        if len(input_ids) != len(labels):
            raise ValueError(
                f"`{name}` has {len(input_ids)} input_ids but {len(labels)} labels: they must "
                "agree."
            )
        check_tokens(input_ids, labels, ignore_index, name)
        values = [column.check(example[key], f"{name}[{key!r}]") for key, column in carried.items()]
        buffer.add(input_ids, labels, values)
        if len(buffer.ends) == buffer_size:
            yield _pack_window(
                buffer, list(carried.values()), max_length, overflow, ignore_index, stats
            )
    if buffer.ends:
        yield _pack_window(
            buffer, list(carried.values()), max_length, overflow, ignore_index, stats
        )
    stats.log()


class _Buffer:
    """A window's conversations: their tokens back to back in two arrays kept from window to window
    (int32 while every value fits), so that packing a long stream does not fragment the heap with
    one array per conversation.

    Attributes:
        input_ids, labels: ``(capacity,)``, the first ``ends[-1]`` filled.
        ends: where each conversation's tokens end. values: each conversation's carried values.
    """

    def __init__(self, ignore_index: int):
        # labels take it at cuts
        dtype = np.int32 if _INT32.min <= ignore_index <= _INT32.max else np.int64
        self.input_ids, self.labels = np.empty(0, dtype), np.empty(0, dtype)
        self.ends, self.values = [], []

    def add(self, input_ids: np.ndarray, labels: np.ndarray, values: list) -> None:
        start = self.ends[-1] if self.ends else 0
        stop = start + len(input_ids)
        wide = any(
            not (_INT32.min <= t.min() and t.max() <= _INT32.max)
            for t in (input_ids, labels)
            if t.size
        )
        if stop > len(self.input_ids) or (wide and self.input_ids.dtype != np.int64):
            # by a quarter: a window a little longer than the ones before grows the arrays a little
            capacity = max(stop, len(self.input_ids) * 5 // 4)
            dtype = np.int64 if wide else self.input_ids.dtype
            self.input_ids, self.labels = (
                np.concatenate((a[:start], np.empty(capacity - start, dtype)))
                for a in (self.input_ids, self.labels)
            )
        self.input_ids[start:stop], self.labels[start:stop] = input_ids, labels
        self.ends.append(stop)
        self.values.append(values)

    def clear(self) -> None:
        self.ends, self.values = [], []


def _pack_window(
    buffer: _Buffer,
    carried: list[SequenceColumn],
    max_length: int,
    overflow: Overflow,
    ignore_index: int,
    stats: PackingStats,
) -> Window:
    """The rows of the conversations in ``buffer``, which it empties."""
    ends = np.array(buffer.ends, dtype=np.int64)
    lengths = np.diff(ends, prepend=0)
    kept = cut_to_capacity(lengths, max_length, overflow, stats)
    targets = targets_per_sequence(buffer.labels[: ends[-1]], lengths, ignore_index, counted=kept)
    stats.num_without_targets += int(((kept > 0) & (targets == 0)).sum())
    plan = plan_rows(kept, max_length, overflow == "split", stats)
    first = (ends - lengths)[plan.source] + plan.offset
    pieces = list(zip(first.tolist(), (first + plan.length).tolist()))
    input_ids, labels = (
        np.concatenate([tokens[a:b] for a, b in pieces] or [tokens[:0]])
        for tokens in (buffer.input_ids, buffer.labels)
    )
    starts = np.cumsum(plan.length) - plan.length
    # A piece after the first repeats the token before its cut, whose label was trained in the piece
    # before.
    labels[starts[plan.offset > 0]] = ignore_index
    piece_bounds = np.concatenate(([0], np.cumsum(plan.per_row)))
    columns = row_metadata(plan, targets, overflow == "split")
    for rank, column in enumerate(carried):
        values = [values[rank] for values in buffer.values]
        if column.dtype is None:
            columns[column.key] = [values[source] for source in plan.source.tolist()]
        else:
            columns[column.key] = np.array(values, dtype=column.dtype)[plan.source]
    buffer.clear()
    token_bounds = np.concatenate(([0], starts + plan.length))[piece_bounds]
    return Window(input_ids, labels, token_bounds, piece_bounds, columns)


def pack_stream(
    examples: Iterable[Mapping],
    max_length: int | None = None,
    *,
    overflow: Overflow = "truncate",
    buffer_size: int = 1024,
    ignore_index: int = IGNORE_INDEX,
    stats: PackingStats | None = None,
    max_tokens: int | None = None,
) -> Iterator[dict[str, list]]:
    """Pack tokenized conversations on the fly into rows of at most ``max_length`` tokens.

    Each ``buffer_size`` conversations are packed with best-fit-decreasing (bounded memory; a larger
    buffer packs tighter); over-long ones as in ``pack_dataset``, counted in ``stats`` and logged at
    the end.

    Args:
        examples: each with ``input_ids`` and ``labels`` (equal-length sequences of ints), e.g. a
            tokenized ``datasets.IterableDataset``; every other key is carried as in
            ``pack_dataset`` (``weight`` as ``seq_weights``, ``source`` as ``seq_sources``, ``name``
            as ``seq_<name>``; one value per conversation), and every example has the first one's
            keys.
        max_length: row capacity in tokens (at least 2 with ``overflow="split"``).
        overflow: ``"truncate"``, ``"drop"``, ``"split"`` or ``"error"``.
        buffer_size: conversations packed together.
        ignore_index: the label of untrained tokens (default: -100).
        stats: updated in place as the stream is read.
        max_tokens: the former name of ``max_length`` (a ``FutureWarning``).

    Yields:
        a row in the layout of ``pack_dataset``, lists of Python values.

    Example:
        >>> from collators import pack_stream
        >>> conversations = ([1, 2, 3], [4, 5, 6, 7, 8], [9, 10])
        >>> stream = ({"input_ids": ids, "labels": ids} for ids in conversations)
        >>> [row["seq_lengths"] for row in pack_stream(stream, max_length=6)]
        [[5], [3, 2]]
        >>> stream = ({"input_ids": ids, "labels": ids} for ids in conversations)
        >>> [row["input_ids"] for row in pack_stream(stream, max_length=3, overflow="split")]
        [[1, 2, 3], [4, 5, 6], [6, 7, 8], [9, 10]]
    """
    # Checked here, at the call, not at the first row a generator would reach.
    max_length = check_packing_options(
        renamed_max_length(max_length, max_tokens, "pack_stream"), overflow, "max_length"
    )
    buffer_size = positive_int(buffer_size, "buffer_size")
    if stats is None:
        stats = PackingStats(max_length=max_length)
    return _rows(pack_windows(examples, max_length, overflow, buffer_size, ignore_index, stats))


def _rows(windows: Iterator[Window]) -> Iterator[dict[str, list]]:
    for window in windows:
        columns = {
            key: values.tolist() if isinstance(values, np.ndarray) else values
            for key, values in window.columns.items()
        }
        tokens, pieces = window.token_bounds.tolist(), window.piece_bounds.tolist()
        for a, b, p, q in zip(tokens[:-1], tokens[1:], pieces[:-1], pieces[1:]):
            row = {INPUT_IDS: window.input_ids[a:b].tolist(), LABELS: window.labels[a:b].tolist()}
            row.update((key, values[p:q]) for key, values in columns.items())
            yield row
        del window, columns  # not held while the next window is packed


def write_stream(
    dataset,
    path: str,
    max_length: int,
    overflow: Overflow,
    buffer_size: int,
    ignore_index: int,
    stats: PackingStats,
):
    """``pack_dataset``'s rows of a ``datasets.IterableDataset``, written to the Arrow file ``path``
    a window at a time and returned memory-mapped (a ``datasets.Dataset``).

    The columns' Arrow types are the data set's ``features`` where it declares them (token lists
    keep their integer type), else int64 tokens and the types of the first window's values.
    """
    import datasets
    import pyarrow as pa
    from datasets.utils import tqdm

    known = dataset.features.arrow_schema if dataset.features is not None else None
    types = {INPUT_IDS: pa.int64(), LABELS: pa.int64()}
    carried = {}
    if known is not None:
        types.update(
            (name, known.field(name).type.value_type)
            for name in (INPUT_IDS, LABELS)
            if name in known.names and hasattr(known.field(name).type, "value_type")
        )
        carried = carried_columns(known.names)
        types.update(
            (column.key, known.field(name).type)
            for name, column in carried.items()
            if not column.dtype
        )
    writer, schema = None, None
    tmp = f"{path}.tmp"
    try:
        with pa.OSFile(tmp, "wb") as sink, tqdm(unit=" rows", desc="Packing") as bar:
            for window in pack_windows(
                dataset, max_length, overflow, buffer_size, ignore_index, stats, "dataset"
            ):
                if len(window.token_bounds) == 1:
                    # no row (every conversation dropped or empty), no value to take a type from
                    continue
                table = _window_table(window, types)
                if writer is None:
                    schema = table.schema
                    writer = pa.ipc.new_stream(sink, schema)
                elif table.schema != schema:
                    table = _cast(table, schema)
                writer.write_table(table)
                bar.update(table.num_rows)
                del window, table  # not held while the next window is packed
            if writer is None:  # no conversation: the columns the data set declares, no row
                types.update((name, pa.int64()) for name in (SEQ_LENGTHS, SEQ_TARGETS))
                types.update(
                    (c.key, pa.from_numpy_dtype(np.dtype(c.dtype)))
                    for c in carried.values()
                    if c.dtype
                )
                names = [INPUT_IDS, LABELS, SEQ_LENGTHS] + [SEQ_TARGETS] * (overflow == "split")
                names += [column.key for column in carried.values()]
                schema = pa.schema([(name, pa.list_(types.get(name, pa.null()))) for name in names])
                writer = pa.ipc.new_stream(sink, schema)
            writer.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return datasets.Dataset.from_file(path)


def _window_table(window: Window, types: dict):
    """A window's rows as an Arrow table: lists per row, of ``types[name]`` where given."""
    import pyarrow as pa

    columns = {
        name: list_array(window.token_bounds, pa.array(values, type=types[name]))
        for name, values in ((INPUT_IDS, window.input_ids), (LABELS, window.labels))
    }
    for name, values in window.columns.items():
        columns[name] = list_array(window.piece_bounds, pa.array(values, type=types.get(name)))
    return pa.table(columns)


def _cast(table, schema):
    """``table`` in the first window's ``schema``; ValueError naming a column whose type changed."""
    import pyarrow as pa

    for field in schema:
        if table.schema.field(field.name).type != field.type:
            try:
                column = table.column(field.name).cast(field.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise ValueError(
                    f"`dataset` column {field.name!r} holds "
                    f"{table.schema.field(field.name).type.value_type} values after "
                    f"{field.type.value_type} ones: give it one type (dataset.cast_column)."
                ) from None
            table = table.set_column(table.schema.get_field_index(field.name), field.name, column)
    return table


class PackedIterableDataset(torch.utils.data.IterableDataset):
    """A ``torch.utils.data.IterableDataset`` of packed rows over tokenized conversations.

    ``pack_stream`` for a ``DataLoader``. With ``num_workers > 0`` a
    ``torch.utils.data.IterableDataset`` source splits its own examples between workers; any other
    iterable is split here (worker ``w`` takes every ``num_workers``-th from ``w``). ``stats``: the
    last iteration's counts in this process.

    Args:
        source: conversations with ``input_ids`` and ``labels``.
        max_length: row capacity in tokens.
        overflow: as in ``pack_stream`` (``"split"`` included).
        buffer_size: as in ``pack_stream``.
        max_tokens: the former name of ``max_length`` (a ``FutureWarning``).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> from collators import PackedCollator, PackedIterableDataset
        >>> source = [{"input_ids": ids, "labels": ids} for ids in ([1, 2, 3], [4, 5])]
        >>> dataset = PackedIterableDataset(source, max_length=8)
        >>> loader = DataLoader(dataset, batch_size=1, collate_fn=PackedCollator())
        >>> batch = next(iter(loader))
        >>> batch["input_ids"], batch["cu_seqlens"]
        (tensor([[1, 2, 3, 4, 5]]), tensor([0, 3, 5], dtype=torch.int32))
    """

    def __init__(
        self,
        source: Iterable[Mapping],
        max_length: int | None = None,
        *,
        overflow: Overflow = "truncate",
        buffer_size: int = 1024,
        max_tokens: int | None = None,
    ):
        self.source = source
        max_length = renamed_max_length(max_length, max_tokens, "PackedIterableDataset")
        self.max_length = check_packing_options(max_length, overflow, "max_length")
        positive_int(buffer_size, "buffer_size")
        self.overflow = overflow
        self.buffer_size = buffer_size
        self.stats = PackingStats(max_length=max_length)

    def __iter__(self) -> Iterator[dict[str, list[int]]]:
        self.stats = PackingStats(max_length=self.max_length)
        source = self.source
        worker = torch.utils.data.get_worker_info()
        if worker is not None and not isinstance(source, torch.utils.data.IterableDataset):
            # every num_workers-th conversation, so none is packed twice
            source = itertools.islice(source, worker.id, None, worker.num_workers)
        return pack_stream(
            source,
            self.max_length,
            overflow=self.overflow,
            buffer_size=self.buffer_size,
            stats=self.stats,
        )
