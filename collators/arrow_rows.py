"""``pack_dataset`` on a ``datasets.Dataset``: tokens read in place, rows written in batches.

``TokenColumn`` views the memory-mapped Arrow chunks in place (file-backed pages, not the process's
memory), ``scan_tokens`` checks tokens and counts targets a block at a time, ``write_rows`` fills
the packed rows with ``datasets.Dataset.map`` over the plan into a cache keyed by every input
(``cache``). Memory grows with the number of conversations, never with the number of tokens.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from packed_ce.columns import IMAGES, INPUT_IDS, LABELS, SEQ_LENGTHS

from . import cache
from .checks import check_tokens, targets_per_sequence

# Tokens checked at once: the scan's temporaries (a few bytes per token) stay in the tens of MB.
BLOCK_TOKENS = 1 << 21
# Tokens of the packed rows gathered and written at once (~16 MB of int32 input_ids and labels).
BATCH_TOKENS = 1 << 21
# The plan's columns that locate each piece (its conversation, its first token there), not written
# to the rows.
PIECE_COLUMNS = ("_conversation", "_offset")
_NO_TOKENS = np.zeros(0, dtype=np.int64)


class TokenColumn:
    """A list-of-ints Arrow column, read in place: per chunk, views of its offsets and values.

    Args:
        table: a ``pyarrow.Table`` of the rows, in the data set's order (no indices mapping).
        name: the column, lists of ints (any integer width; tokens keep it).

    Attributes:
        lengths: ``(C,)`` int64, the length of each row's list.
    """

    def __init__(self, table, name: str):
        import pyarrow as pa

        column = table.column(name)
        value_type = getattr(column.type, "value_type", None)
        if value_type is None or not (
            pa.types.is_integer(value_type) or pa.types.is_null(value_type)
        ):
            raise TypeError(
                f"`dataset` column {name!r} must hold lists of ints, got {column.type}."
            )
        if column.null_count:
            raise ValueError(f"`dataset` column {name!r} has {column.null_count} missing rows.")
        self.offsets: list[np.ndarray] = []  # per chunk: (rows + 1,) int32/int64 view
        self.values: list[np.ndarray] = []  # per chunk: the values its offsets index, a view
        for chunk in column.chunks:
            # ``offsets`` accounts for a sliced chunk and indexes ``values``, the whole array behind
            # it.
            values = chunk.values
            if values.null_count:
                raise ValueError(
                    f"`dataset` column {name!r} has {values.null_count} missing tokens."
                )
            self.offsets.append(chunk.offsets.to_numpy())
            self.values.append(_NO_TOKENS if pa.types.is_null(values.type) else values.to_numpy())
        counts = [len(offsets) - 1 for offsets in self.offsets]
        self.lengths = np.concatenate([np.diff(o) for o in self.offsets] or [_NO_TOKENS]).astype(
            np.int64
        )
        # Where each row's tokens start: its chunk and its first value there. (C,) each.
        self.row_chunk = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
        self.row_start = np.concatenate([o[:-1] for o in self.offsets] or [_NO_TOKENS]).astype(
            np.int64
        )

    def blocks(self):
        """``(first_row, tokens, lengths)`` for consecutive rows of about ``BLOCK_TOKENS`` tokens (a
        longer row is a block of its own): ``tokens`` a view of their values back to back,
        ``lengths`` ``(rows,)`` int64.
        """
        first_row = 0
        for offsets, values in zip(self.offsets, self.values):
            num_rows = len(offsets) - 1
            marks = np.arange(offsets[0], offsets[-1], BLOCK_TOKENS)
            cuts = np.unique(np.concatenate((np.searchsorted(offsets[:-1], marks), [0, num_rows])))
            for a, b in zip(cuts[:-1].tolist(), cuts[1:].tolist()):
                yield (
                    first_row + a,
                    values[offsets[a] : offsets[b]],
                    np.diff(offsets[a : b + 1]).astype(np.int64),
                )
            first_row += num_rows

    def gather(self, rows: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Tokens ``[offsets[i], offsets[i] + lengths[i])`` of row ``rows[i]``, for every ``i``,
        back to back (a copy, in the column's integer type).
        """
        chunks = self.row_chunk[rows].tolist()
        starts = self.row_start[rows] + offsets
        ends = (starts + lengths).tolist()
        values = self.values
        # numpy slices: faster than Arrow's ``take`` on lists, and no more than the pieces' tokens
        # in memory
        parts = [values[k][a:b] for k, a, b in zip(chunks, starts.tolist(), ends)]
        return np.concatenate(parts) if parts else _NO_TOKENS


def list_array(bounds: np.ndarray, values):
    """Arrow lists ``values[bounds[i]:bounds[i+1]]``; 64-bit offsets if 32 bits are too few."""
    import pyarrow as pa

    if bounds[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(bounds.astype(np.int32)), values)
    return pa.LargeListArray.from_arrays(pa.array(bounds), values)


def scan_tokens(
    input_ids: TokenColumn, labels: TokenColumn, kept: np.ndarray, ignore_index: int
) -> np.ndarray:
    """Checks every token (ids >= 0, labels >= 0 or ``ignore_index``) and counts the targets of each
    row within its first ``kept`` tokens (see ``targets_per_sequence``), one block at a time.

    Returns:
        ``(C,)`` int64 target counts.
    """
    for _, tokens, _ in input_ids.blocks():
        check_tokens(tokens, _NO_TOKENS, ignore_index, "dataset")
    targets = np.zeros(len(kept), dtype=np.int64)
    for first, tokens, lengths in labels.blocks():
        check_tokens(_NO_TOKENS, tokens, ignore_index, "dataset")
        rows = slice(first, first + len(lengths))
        targets[rows] = targets_per_sequence(tokens, lengths, ignore_index, counted=kept[rows])
    return targets


class _FillRows:
    """``write_rows``' ``map`` function: a batch of the plan (Arrow) to the same rows with tokens.

    Pickled for ``num_proc`` workers without its views: each builds its own.
    """

    def __init__(
        self,
        dataset,
        ignore_index: int,
        columns: tuple[TokenColumn, TokenColumn] | None = None,
        images: bool = False,
    ):
        self.dataset = dataset
        self.ignore_index = ignore_index
        self.columns = columns  # (input_ids, labels) of ``dataset``, built when None
        self.images = images

    def __getstate__(self):
        return {**self.__dict__, "columns": None}

    def __call__(self, batch):
        import pyarrow as pa
        import pyarrow.compute as pc

        if self.columns is None:
            table = self.dataset.data.table
            self.columns = TokenColumn(table, INPUT_IDS), TokenColumn(table, LABELS)
        pieces = batch.column(SEQ_LENGTHS).combine_chunks()
        length = pc.list_flatten(pieces).to_numpy().astype(np.int64)
        source, offset = (
            pc.list_flatten(batch.column(n).combine_chunks()).to_numpy() for n in PIECE_COLUMNS
        )
        input_ids, labels = (column.gather(source, offset, length) for column in self.columns)
        # A piece after the first repeats the token before its cut, whose label was trained in the
        # piece before.
        labels[(np.cumsum(length) - length)[offset > 0]] = self.ignore_index
        per_row = pc.list_value_length(pieces).to_numpy().astype(np.int64)
        token_bounds = np.concatenate(([0], np.cumsum(length)))[
            np.concatenate(([0], np.cumsum(per_row)))
        ]
        columns = {
            INPUT_IDS: list_array(token_bounds, pa.array(input_ids)),
            LABELS: list_array(token_bounds, pa.array(labels)),
        }
        if self.images:  # each piece's conversation's images, a row's pieces in order
            taken = self.dataset.data.table.column(IMAGES).take(pa.array(source)).combine_chunks()
            per_piece = pc.list_value_length(taken).to_numpy(zero_copy_only=False).astype(np.int64)
            image_bounds = np.concatenate(([0], np.cumsum(per_piece)))[
                np.concatenate(([0], np.cumsum(per_row)))
            ]
            columns[IMAGES] = list_array(image_bounds, pc.list_flatten(taken))
        columns.update((n, batch.column(n)) for n in batch.column_names if n not in PIECE_COLUMNS)
        return pa.table(columns)


def write_rows(
    dataset,
    columns: tuple[TokenColumn, TokenColumn],
    plan,
    *,
    fingerprint: str,
    max_length: int,
    ignore_index: int,
    cache_file_name: str | None,
    num_proc: int | None,
    load_from_cache_file: bool | None,
    images=None,
):
    """The packed rows: ``plan``'s rows (``_conversation``, ``_offset``, ``seq_lengths``, then the
    columns carried to them) with ``input_ids`` and ``labels`` filled in from ``dataset`` (and,
    with ``images``, the feature of ``dataset``'s ``images`` column, the images of each row's
    conversations in the row's order), written with ``datasets.Dataset.map``.

    Args:
        dataset: the ``datasets.Dataset`` of conversations, without an indices mapping; columns:
            its tokens, read.
        plan: a ``pyarrow.Table``, one row per packed row.
        fingerprint: the key of every input the rows depend on: the result's fingerprint, the name
            of the default cache file, and what a ``cache_file_name`` must have been written for to
            be reused.
        cache_file_name, num_proc, load_from_cache_file: as in ``pack_dataset``.
    """
    import datasets
    from datasets.fingerprint import (
        generate_random_fingerprint,
        get_temporary_cache_files_directory,
    )

    if cache_file_name is not None and not cache.reusable(cache_file_name, fingerprint):
        load_from_cache_file = False  # removed: written for other inputs
    elif cache_file_name is None and dataset.cache_files:
        # Beside the data set's own files, named by the key as ``map`` names its cache; a temporary
        # folder when caching is off, as ``datasets`` does.
        enabled = datasets.is_caching_enabled()
        folder = os.path.dirname(dataset.cache_files[0]["filename"]) if enabled else None
        cache_file_name = os.path.join(
            folder or get_temporary_cache_files_directory(), f"cache-{fingerprint}.arrow"
        )
    fill = _FillRows(dataset, ignore_index, columns, images is not None)
    if plan.num_rows == 0:  # ``map`` would call nothing and return no column
        return datasets.Dataset(datasets.table.InMemoryTable(fill(plan)), fingerprint=fingerprint)
    rows = datasets.Dataset(
        datasets.table.InMemoryTable(plan), fingerprint=generate_random_fingerprint()
    )
    batch_size = max(1, BATCH_TOKENS // max_length)
    with progress_unit(" rows"):
        rows = (
            rows.with_format("arrow")
            .map(
                fill,
                batched=True,
                batch_size=batch_size,
                writer_batch_size=batch_size,
                remove_columns=rows.column_names,
                new_fingerprint=fingerprint,
                cache_file_name=cache_file_name,
                num_proc=num_proc,
                load_from_cache_file=load_from_cache_file,
                desc="Packing",
            )
            .with_format(None)
        )
    if images is not None:  # the map wrote their storage: images again, not structs
        rows = rows.cast_column(IMAGES, images)
    if cache_file_name is not None and rows.cache_files:
        cache.record(cache_file_name, fingerprint)
    return rows


@contextlib.contextmanager
def progress_unit(unit: str):
    """``datasets.Dataset.map``'s progress bar counting in ``unit`` (``" rows"``), not its fixed
    ``" examples"``: packing maps over packed rows, tokenizing over conversations. Cosmetic: where
    ``datasets`` names its bar otherwise, nothing changes.
    """
    import datasets.arrow_dataset as arrow_dataset

    original = getattr(arrow_dataset, "hf_tqdm", None)
    if original is None:
        yield
        return

    class Bar(original):
        def __init__(self, *args, **kwargs):
            if kwargs.get("unit") == " examples":
                kwargs["unit"] = unit
            super().__init__(*args, **kwargs)

    arrow_dataset.hf_tqdm = Bar
    try:
        yield
    finally:
        arrow_dataset.hf_tqdm = original
