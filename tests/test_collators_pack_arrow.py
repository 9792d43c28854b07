"""`pack_dataset` on a `datasets.Dataset` read in place: the rows, order and statistics of the in-memory plan
(`collator_reference.reference_pack`) on random data, every column carried, the cache reused, bad columns
refused by name."""

import tempfile
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")  # not on every GPU image
import pyarrow as pa
from collator_reference import IGNORE, reference_pack
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from collators import arrow_rows, pack_dataset


def write_arrow(path: Path, conversations: list[dict], rows_per_batch: int = 1000) -> Dataset:
    """`conversations` as an Arrow file of record batches of `rows_per_batch` rows, memory-mapped (the format
    of `datasets`' cache files): several chunks, as a large data set has."""
    table = pa.Table.from_pylist(conversations) if conversations else pa.table(
        {"input_ids": pa.array([], pa.list_(pa.int64())), "labels": pa.array([], pa.list_(pa.int64()))})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=rows_per_batch):
            writer.write_batch(batch)
    return Dataset.from_file(str(path))


@st.composite
def packing_cases(draw):
    """Conversations of 0-20 tokens (empty, over-long, without targets included), optional `weight`,
    `source` and `id` columns, a row length, an overflow rule, a batching of the file, a shuffle or not."""
    max_length = draw(st.integers(2, 12))
    columns = draw(st.sets(st.sampled_from(["weight", "source", "id"])))
    conversations = []
    for index in range(draw(st.integers(0, 25))):
        ids = draw(st.lists(st.integers(0, 50), max_size=20))
        trained = draw(st.lists(st.booleans(), min_size=len(ids), max_size=len(ids)))
        conversation = {"input_ids": ids, "labels": [t if keep else IGNORE for t, keep in zip(ids, trained)]}
        if "weight" in columns:
            conversation["weight"] = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 1e-30]))
        if "source" in columns:
            conversation["source"] = draw(st.sampled_from(["chat", "code", "math"]))
        if "id" in columns:
            conversation["id"] = index
        conversations.append(conversation)
    overflow = draw(st.sampled_from(["truncate", "drop", "split", "error"]))
    return conversations, max_length, overflow, draw(st.integers(1, 7)), draw(st.booleans())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(packing_cases())
def test_rows_order_and_stats_equal_the_in_memory_plan(case):
    conversations, max_length, overflow, rows_per_batch, shuffle = case
    with tempfile.TemporaryDirectory() as folder:
        dataset = write_arrow(Path(folder) / "data.arrow", conversations, rows_per_batch)
        if shuffle:  # an indices mapping: the rows are packed in the selected order
            order = np.random.default_rng(0).permutation(len(conversations)).tolist()
            dataset, conversations = dataset.select(order), [conversations[i] for i in order]
        if overflow == "error" and any(len(c["input_ids"]) > max_length for c in conversations):
            with pytest.raises(ValueError, match="longer than `max_length`"):
                pack_dataset(dataset, max_length, overflow=overflow)
            return
        expected_rows, expected_stats = reference_pack(conversations, max_length, overflow)
        packed, stats = pack_dataset(dataset, max_length, overflow=overflow, return_stats=True)
        assert packed.to_dict() == expected_rows
        assert stats == expected_stats
        if conversations:  # read back from the cache file, beside the data set
            assert Path(packed.cache_files[0]["filename"]).parent == Path(folder)


def test_split_with_targets_weights_and_sources_across_batches(monkeypatch):
    """Rows written over many `map` batches (a batch of one row here) with split conversations, weights and
    sources: the same rows as the in-memory plan."""
    monkeypatch.setattr(arrow_rows, "BATCH_TOKENS", 1)
    monkeypatch.setattr(arrow_rows, "BLOCK_TOKENS", 7)  # and the scan in many blocks
    rng = np.random.default_rng(0)
    conversations = []
    for index in range(60):
        ids = rng.integers(0, 100, int(rng.integers(1, 40))).tolist()
        labels = [t if rng.random() < 0.6 else IGNORE for t in ids]
        conversations.append({"input_ids": ids, "labels": labels, "weight": float(rng.choice([0.5, 1.0, 3.0])),
                              "source": str(rng.choice(["chat", "code"])), "id": index})
    with tempfile.TemporaryDirectory() as folder:
        dataset = write_arrow(Path(folder) / "data.arrow", conversations, rows_per_batch=9)
        packed, stats = pack_dataset(dataset, 16, overflow="split", return_stats=True)
        expected_rows, expected_stats = reference_pack(conversations, 16, "split")
        assert stats.num_split > 0 and stats == expected_stats
        assert packed.column_names == ["input_ids", "labels", "seq_lengths", "seq_targets", "seq_weights",
                                       "seq_sources", "seq_id"]
        assert packed.to_dict() == expected_rows
        # A contiguous selection is a slice of the file's chunks, starting inside one.
        part = pack_dataset(dataset.select(range(13, 50)), 16, overflow="split")
        assert part.to_dict() == reference_pack(conversations[13:50], 16, "split")[0]


def test_second_call_reuses_the_cache(tmp_path, monkeypatch):
    rng = np.random.default_rng(1)
    conversations = [{"input_ids": (ids := rng.integers(0, 100, int(n)).tolist()), "labels": ids}
                     for n in rng.integers(1, 30, 200)]
    path = tmp_path / "data.arrow"
    first, first_stats = pack_dataset(write_arrow(path, conversations, 50), 32, return_stats=True)
    [cache] = first.cache_files
    assert Path(cache["filename"]).parent == tmp_path and Path(cache["filename"]).name.startswith("cache-")
    written = Path(cache["filename"]).stat().st_mtime_ns

    def no_writing(self, batch):
        raise AssertionError("rows written again")

    # The same file and options, in a new data set object: the rows come from the cache.
    monkeypatch.setattr(arrow_rows._FillRows, "__call__", no_writing)
    second, second_stats = pack_dataset(Dataset.from_file(str(path)), 32, return_stats=True)
    assert second.cache_files == [cache] and Path(cache["filename"]).stat().st_mtime_ns == written
    assert second.to_dict() == first.to_dict() and second_stats == first_stats
    # Other options are another fingerprint: the rows are written anew.
    for options in ({"max_length": 33}, {"max_length": 32, "overflow": "split"},
                    {"max_length": 32, "ignore_index": -1}):
        with pytest.raises(AssertionError, match="rows written again"):
            pack_dataset(Dataset.from_file(str(path)), **options)
    with pytest.raises(AssertionError, match="rows written again"):
        pack_dataset(Dataset.from_file(str(path)), 32, load_from_cache_file=False)
    monkeypatch.undo()

    # Written by two processes to a file of the caller's choosing: the same rows.
    shards = pack_dataset(Dataset.from_file(str(path)), 32, cache_file_name=str(tmp_path / "rows.arrow"), num_proc=2)
    assert [Path(f["filename"]).name for f in shards.cache_files] == [
        "rows_00000_of_00002.arrow", "rows_00001_of_00002.arrow"]
    assert shards.to_dict() == first.to_dict()
    # A data set in memory gives rows in memory.
    in_memory = pack_dataset(Dataset.from_list(conversations), 32)
    assert in_memory.cache_files == [] and in_memory.to_dict() == first.to_dict()


def test_an_iterable_dataset_gives_the_same_rows():
    conversations = [{"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3], "source": "a"},
                     {"input_ids": [4, 5, 6, 7, 8, 9], "labels": [IGNORE, 5, 6, 7, 8, 9], "source": "b"},
                     {"input_ids": [10, 11], "labels": [IGNORE, 11], "source": "a"}]
    rows = pack_dataset(Dataset.from_list(conversations).to_iterable_dataset(), 8, overflow="split")
    assert rows.to_dict() == reference_pack(conversations, 8, "split")[0]
    mixed = [*conversations, {"input_ids": [1], "labels": [1]}]
    with pytest.raises(ValueError, match=r"dataset\[3\]` lacks \['source'\], unlike the first example"):
        pack_dataset(datasets.IterableDataset.from_generator(lambda: iter(mixed)), 8)


@pytest.mark.parametrize(
    ("extra", "error", "message"),
    [
        ({"attention_mask": [[1, 1, 1]]}, ValueError,
         r"column 'attention_mask' holds list<item: int\d+>.*remove_columns\('attention_mask'\)"),
        ({"meta": [{"a": 1}]}, ValueError, r"column 'meta' holds struct"),
        ({"lengths": [3]}, ValueError, r"column 'lengths' would be carried to the rows as 'seq_lengths'"),
        ({"source": [3]}, TypeError, r"`dataset\['source'\]` must be None or a string"),
    ],
)
def test_a_column_that_cannot_be_carried_is_named(extra, error, message):
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[IGNORE, 2, 3]], **extra})
    with pytest.raises(error, match=message):
        pack_dataset(dataset, 8)
