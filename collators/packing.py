"""``pack_dataset``: tokenized conversations into rows of at most ``max_length`` tokens.

A ``datasets.Dataset`` is packed whole with best-fit-decreasing (``planning``; rows written to an
Arrow cache, ``arrow_rows``), a ``datasets.IterableDataset`` window by window as it is read
(``streaming``). Each cache is reused only for the inputs it was written for (``cache``).
"""

from __future__ import annotations

import os

import numpy as np

from packed_ce.columns import IGNORE_INDEX, IMAGES, INPUT_IDS, LABELS, SEQUENCE_COLUMNS

from . import cache
from .arrow_rows import PIECE_COLUMNS, TokenColumn, list_array, scan_tokens, write_rows
from .checks import positive_int
from .planning import (
    ROW_LAYOUT_VERSION,
    Overflow,
    PackingStats,
    carried_columns,
    check_packing_options,
    cut_to_capacity,
    plan_rows,
    row_metadata,
)
from .streaming import STREAM_WINDOW, write_stream


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
    buffer_size: int | None = None,
):
    """Pack tokenized conversations into rows of at most ``max_length`` tokens, best-fit-decreasing.

    A ``datasets.Dataset`` is packed whole, so long conversations of one part find short ones of
    another; deterministic. Its memory does not grow with the token count: the plan needs only
    lengths and target counts, and rows are written with ``datasets.Dataset.map`` to an Arrow cache
    beside the data set's (in memory for an in-memory data set unless ``cache_file_name`` is set). A
    cache is reused only if it was written for exactly these inputs (the data's fingerprint, its
    columns and their types, ``max_length``, ``overflow``, ``ignore_index``, the row layout); any
    other file at ``cache_file_name`` is written anew. A ``datasets.IterableDataset`` is packed as
    it is read, ``buffer_size`` conversations at a time (memory bounded by the window), into an
    Arrow file, always written anew. An over-long conversation is truncated (default), dropped,
    split (``collators.planning``) or raises; each case is counted in ``PackingStats`` and logged.

    Args:
        dataset: a ``datasets.Dataset`` or ``datasets.IterableDataset`` of ``input_ids`` and
            ``labels`` (equal-length lists of ints, as ``tokenize_dataset`` makes). Every other
            column goes to each piece (``packed_ce.columns.SEQUENCE_COLUMNS``): ``weight``
            (real >= 0) as ``seq_weights``, ``source`` (strings) as ``seq_sources``, any other
            ``name`` as ``seq_<name>``; a column of lists or structs raises. An ``images``
            column (``tokenize_dataset`` with a processor: each conversation's images) gives
            each row an ``images`` list, its conversations' images in the row's order (a
            ``datasets.Dataset`` only; an over-long conversation with images is dropped or
            refused, never cut).
        max_length: row capacity in tokens (at least 2 with ``overflow="split"``).
        overflow: what to do with a conversation longer than ``max_length``: ``"truncate"``,
            ``"drop"``, ``"split"`` or ``"error"`` (raise ``ValueError``).
        ignore_index: the label of untrained tokens (default: -100).
        return_stats: also return the ``PackingStats``.
        cache_file_name: where to write the rows (``datasets.Dataset.map``'s argument); for an
            ``IterableDataset``, by default a temporary file removed at exit.
        num_proc: processes writing the rows of a ``Dataset`` (``datasets.Dataset.map``'s argument).
        load_from_cache_file: reuse the rows of a ``Dataset`` written for the same inputs (default:
            unless caching is disabled in ``datasets``).
        buffer_size: for an ``IterableDataset``, the conversations packed together (default 16384:
            about 16M tokens held at a mean of 500 tokens; a larger window packs tighter).

    Returns:
        ``datasets.Dataset`` of ``input_ids``, ``labels`` (at most ``max_length``), ``seq_lengths``
        (summing to the row's length), ``seq_targets`` when splitting, then the carried columns, one
        value per sequence (``seq_weights`` float64); ``(dataset, PackingStats)`` with
        ``return_stats``. Longest rows first: shuffle in the DataLoader.

    Raises:
        TypeError: ``dataset`` is not a data set, ``max_length`` not an int, tokens or weights of
            the wrong type.
        ValueError naming the row or column: ``max_length`` too small, unknown ``overflow``, missing
            columns, negative ids or labels, unequal lengths, weights not finite and >= 0, a
            non-string ``source``, an option the kind of data set does not take (``buffer_size`` for
            a ``Dataset``; ``num_proc`` or ``load_from_cache_file=True`` for an
            ``IterableDataset``).

    Example:
        >>> from datasets import Dataset
        >>> from collators import pack_dataset
        >>> input_ids = [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]]
        >>> labels = [[-100, 2, 3], [-100, -100, 6, 7, 8, 9], [-100, 11], [-100, 13, 14, 15, 16]]
        >>> dataset = Dataset.from_dict({"input_ids": input_ids, "labels": labels})
        >>> packed, stats = pack_dataset(dataset, max_length=8, return_stats=True)
        >>> packed.column_names
        ['input_ids', 'labels', 'seq_lengths']
        >>> packed["input_ids"][:]
        [[4, 5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 1, 2, 3]]
        >>> packed["labels"][:]
        [[-100, -100, 6, 7, 8, 9, -100, 11], [-100, 13, 14, 15, 16, -100, 2, 3]]
        >>> packed["seq_lengths"][:]
        [[6, 2], [5, 3]]
        >>> stats.num_rows, stats.efficiency, stats.num_truncated
        (2, 1.0, 0)

        Split into rows of 4: the repeated 7 (label -100) predicts 8, the target at the cut; both
        pieces carry the conversation's 4 targets:

        >>> split = pack_dataset(dataset.select([1, 2]), max_length=4, overflow="split")
        >>> split["input_ids"][:], split["labels"][:]
        ([[4, 5, 6, 7], [7, 8, 9], [10, 11]], [[-100, -100, 6, 7], [-100, 8, 9], [-100, 11]])
        >>> split["seq_lengths"][:], split["seq_targets"][:]
        ([[4], [3], [2]], [[4], [4], [1]])
    """
    import datasets
    import pyarrow as pa
    from datasets.fingerprint import Hasher

    max_length = check_packing_options(max_length, overflow)
    stats = PackingStats(max_length=max_length)
    if isinstance(dataset, datasets.IterableDataset):
        rows = _pack_iterable(
            dataset,
            max_length,
            overflow,
            ignore_index,
            stats,
            cache_file_name=cache_file_name,
            num_proc=num_proc,
            load_from_cache_file=load_from_cache_file,
            buffer_size=buffer_size,
        )
        return (rows, stats) if return_stats else rows
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            "`dataset` must be a datasets.Dataset or datasets.IterableDataset, got "
            f"{type(dataset).__name__}; pack other iterables of examples with pack_stream or "
            "PackedIterableDataset."
        )
    if buffer_size is not None:
        raise ValueError(
            "`buffer_size` is the window of an IterableDataset; a Dataset is packed whole: leave "
            "it out."
        )
    schema = dataset.data.table.schema
    images = IMAGES in schema.names  # carried by write_rows: each row's images in its order
    carried = carried_columns([name for name in schema.names if name != IMAGES])
    # What the rows depend on: the cache's key (and the name of its default file).
    fingerprint = Hasher.hash(
        (
            dataset._fingerprint,
            [(f.name, str(f.type)) for f in schema],
            max_length,
            overflow,
            ignore_index,
            ROW_LAYOUT_VERSION,
        )
    )
    if dataset._indices is not None:
        # rows in order on disk, so that they can be read in place
        dataset = dataset.flatten_indices()
    table = dataset.data.table
    input_ids, labels = TokenColumn(table, INPUT_IDS), TokenColumn(table, LABELS)
    lengths = input_ids.lengths
    if not np.array_equal(lengths, labels.lengths):
        row = int(np.flatnonzero(lengths != labels.lengths)[0])
        raise ValueError(
            f"`dataset` row {row} has {lengths[row]} input_ids but {labels.lengths[row]} labels: "
            "they must agree."
        )
    for name, column in carried.items():
        _check_column(table, name, column)

    if images:
        _check_image_overflow(table, lengths, max_length, overflow)
    kept = cut_to_capacity(lengths, max_length, overflow, stats)
    targets = scan_tokens(input_ids, labels, kept, ignore_index)
    stats.num_without_targets += int(((kept > 0) & (targets == 0)).sum())
    plan = plan_rows(kept, max_length, overflow == "split", stats)

    # The plan as a table, one row per packed row: where each piece comes from, then the rows' own
    # columns.
    piece_bounds = np.concatenate(([0], np.cumsum(plan.per_row)))
    columns = dict(zip(PIECE_COLUMNS, (plan.source, plan.offset)))
    columns.update(row_metadata(plan, targets, overflow == "split"))
    columns = {name: list_array(piece_bounds, pa.array(values)) for name, values in columns.items()}
    source = pa.array(plan.source)
    for name, column in carried.items():
        values = table.column(name).combine_chunks()
        if column.dtype is not None:
            values = pa.array(values.to_numpy(zero_copy_only=False).astype(column.dtype))
        columns[column.key] = list_array(piece_bounds, values.take(source))
    rows = write_rows(
        dataset,
        (input_ids, labels),
        pa.table(columns),
        fingerprint=fingerprint,
        max_length=max_length,
        ignore_index=ignore_index,
        cache_file_name=cache_file_name,
        num_proc=num_proc,
        load_from_cache_file=load_from_cache_file,
        images=dataset.features[IMAGES] if images else None,
    )
    stats.log()
    return (rows, stats) if return_stats else rows


def _check_image_overflow(table, lengths: np.ndarray, max_length: int, overflow: str) -> None:
    """Over-long conversations with images: dropped or an error only (a cut in their tokens does
    not know where their images are).

    Raises:
        ValueError naming the first such conversation, for ``overflow`` "truncate" or "split".
    """
    import pyarrow.compute as pc

    if overflow not in ("truncate", "split"):
        return
    counts = pc.list_value_length(table.column(IMAGES)).to_numpy(zero_copy_only=False)
    cut = np.flatnonzero((lengths > max_length) & (np.nan_to_num(counts) > 0))
    if cut.size:
        first = int(cut[0])
        raise ValueError(
            f"{cut.size} conversations with images are longer than `max_length`={max_length} "
            f"(the first, at index {first}, has {int(lengths[first])} tokens), and "
            f"overflow={overflow!r} would cut them where an image may lie: tokenize them with "
            "max_length "
            "(collators.tokenize_dataset cuts before the first image that does not fit whole), "
            "or pack with overflow='drop' or 'error'."
        )


def _check_column(table, name: str, column) -> None:
    """Data set column ``name``, carried as ``column``, checked: one value per conversation (not a
    list or struct), none missing where the column has a ``dtype``, and for a column of
    ``SEQUENCE_COLUMNS`` each passing its checks (another column of a type that is not nested holds
    scalars).
    """
    import pyarrow as pa

    value_type = table.schema.field(name).type
    if pa.types.is_nested(value_type):
        raise ValueError(
            f"`dataset` column {name!r} holds {value_type}, not one value per conversation, so "
            "packed rows cannot carry it (they hold one value per sequence): remove it with "
            f"dataset.remove_columns({name!r}) or reduce it to one value per conversation."
        )
    values = table.column(name)
    if column.dtype is not None and values.null_count:
        raise ValueError(f"`dataset` column {name!r} has {values.null_count} missing values.")
    if column in SEQUENCE_COLUMNS:
        column.values(values.to_numpy(zero_copy_only=False), f"dataset[{name!r}]")


def _pack_iterable(
    dataset,
    max_length: int,
    overflow: Overflow,
    ignore_index: int,
    stats: PackingStats,
    *,
    cache_file_name,
    num_proc,
    load_from_cache_file,
    buffer_size,
):
    """``pack_dataset`` of an ``IterableDataset``: by window to an Arrow file (``write_stream``)."""
    from datasets.fingerprint import (
        generate_random_fingerprint,
        get_temporary_cache_files_directory,
    )

    if num_proc is not None:
        raise ValueError(
            "`num_proc` writes the rows of a Dataset; an IterableDataset is packed in one pass as "
            "it is read: leave it out."
        )
    if load_from_cache_file:
        raise ValueError(
            "`load_from_cache_file`: an IterableDataset has no fingerprint, so its rows are "
            "written anew on every call; leave it out."
        )
    buffer_size = positive_int(STREAM_WINDOW if buffer_size is None else buffer_size, "buffer_size")
    if cache_file_name is None:
        name = f"packed-{generate_random_fingerprint()}.arrow"
        cache_file_name = os.path.join(get_temporary_cache_files_directory(), name)
    else:
        # rows of other inputs, which a later call must not take for these
        cache.remove(cache_file_name)
    return write_stream(
        dataset, cache_file_name, max_length, overflow, buffer_size, ignore_index, stats
    )
