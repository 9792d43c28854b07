"""Packing a stream: `pack_dataset` on a `datasets.IterableDataset` writes exactly `pack_stream`'s rows for the
same window, in `pack_dataset`'s layout (every column carried, the same refusals), in memory that does not grow
with the data."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")
from collator_reference import IGNORE, reference_pack
from datasets import Dataset, IterableDataset

from collators import pack_dataset, pack_stream


def conversations(count: int, seed: int = 0, columns=("weight", "source", "id")) -> list[dict]:
    rng = np.random.default_rng(seed)
    found = []
    for index in range(count):
        ids = rng.integers(0, 100, int(rng.integers(0, 30))).tolist()
        found.append({"input_ids": ids, "labels": [t if rng.random() < 0.6 else IGNORE for t in ids],
                      "weight": float(rng.choice([0.0, 0.5, 2.0])), "source": str(rng.choice(["chat", "code"])),
                      "id": index})
    return [{key: c[key] for key in ("input_ids", "labels", *columns)} for c in found]


def stream(records) -> IterableDataset:
    return IterableDataset.from_generator(lambda: iter(records))


@pytest.mark.parametrize("overflow", ["truncate", "drop", "split"])
@pytest.mark.parametrize("window", [1, 7, 1000])
def test_streamed_rows_are_pack_streams_rows(overflow, window, tmp_path):
    records = conversations(60)
    rows, stats = pack_dataset(stream(records), 16, overflow=overflow, buffer_size=window, return_stats=True,
                               cache_file_name=str(tmp_path / "rows.arrow"))
    expected_stats = type(stats)(max_length=16)
    expected = list(pack_stream(iter(records), 16, overflow=overflow, buffer_size=window, stats=expected_stats))
    assert rows.to_list() == expected and stats == expected_stats
    assert rows.column_names == ["input_ids", "labels", "seq_lengths", *["seq_targets"] * (overflow == "split"),
                                 "seq_weights", "seq_sources", "seq_id"]
    if window >= len(records):  # one window: the whole data set's rows
        assert rows.to_dict() == reference_pack(records, 16, overflow)[0]


def test_streamed_rows_have_the_layout_of_a_dataset():
    """A stream that declares its features gives the column types of `pack_dataset` on the data set itself (token
    lists keep their integer type); an empty one its columns."""
    data = Dataset.from_list(conversations(40))
    packed = pack_dataset(data, 16, overflow="split")
    streamed = pack_dataset(data.to_iterable_dataset(), 16, overflow="split")
    assert streamed.features == packed.features and streamed.to_dict() == packed.to_dict()
    empty = pack_dataset(IterableDataset.from_generator(lambda: iter([]), features=data.features), 16,
                         overflow="split")
    assert empty.num_rows == 0 and empty.features == packed.features


@pytest.mark.parametrize(
    ("change", "error", "message", "table_message"),
    [
        ({"mask": [1, 1]}, ValueError, r"\['mask'\]` holds a list, not one value per conversation",
         "column 'mask' holds list"),
        ({"meta": {"a": 1}}, ValueError, r"\['meta'\]` holds a dict, not one value per conversation",
         "column 'meta' holds struct"),
        ({"lengths": 3}, ValueError, "column 'lengths' would be carried to the rows as 'seq_lengths'", None),
        ({"source": 3}, TypeError, r"\['source'\]` must be None or a string", None),
        ({"weight": float("nan")}, ValueError, r"\['weight'\]` must be finite and >= 0", None),
    ],
)
def test_a_stream_refuses_what_a_dataset_refuses(change, error, message, table_message):
    record = {"input_ids": [1, 2, 3], "labels": [IGNORE, 2, 3], "weight": 1.0, "source": "a", **change}
    with pytest.raises(error, match=message):
        list(pack_stream([record], 8))
    with pytest.raises(error, match=message):
        pack_dataset(stream([record]), 8)
    with pytest.raises(error, match=table_message or message):
        pack_dataset(Dataset.from_list([record]), 8)


def test_memory_does_not_grow_with_the_stream(tmp_path):
    """Four times the conversations, the same peak of Python allocations: one window is held at a time (reading the
    stream whole, as `pack_dataset` did, held all of it)."""

    def peak(count: int) -> int:
        source = stream(conversations(count, seed=count, columns=("weight",)))
        tracemalloc.start()
        pack_dataset(source, 64, buffer_size=200, cache_file_name=str(tmp_path / f"{count}.arrow"))
        _, found = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return found

    small, large = peak(1000), peak(4000)
    assert large < 1.25 * small, (small, large)


def test_values_beyond_int32_are_kept():
    """The window holds tokens as int32 while they fit: a token id or an `ignore_index` beyond (written at each
    cut) widens it, mid-window too."""
    records = [{"input_ids": ids, "labels": ids} for ids in ([1, 2, 3], [4, 5, 6, 7, 8, 9], [2**40, 11], [12] * 5)]
    wide = -(2**40)
    for ignore_index in (IGNORE, wide):
        expected = reference_pack(records, 4, "split", ignore_index=ignore_index)[0]
        rows = list(pack_stream(records, 4, overflow="split", buffer_size=10, ignore_index=ignore_index))
        assert {key: [row[key] for row in rows] for key in expected} == expected
    assert any(wide in row["labels"] for row in rows)


def test_a_stream_is_tokenized_as_it_is_read(caplog):
    """``tokenize_dataset`` on a ``datasets.IterableDataset``: the rows ``tokenize_dataset`` gives the
    same conversations in memory, other columns kept, a conversation without an assistant turn
    skipped with a warning; the options of a cache refused by name."""
    from collators import load_default_tokenizer, tokenize_dataset

    tokenizer = load_default_tokenizer()
    turns = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]
             for i in range(5)]
    turns[3] = [{"role": "user", "content": "no answer"}]
    data = Dataset.from_dict({"messages": turns, "weight": [1.0, 2.0, 0.5, 3.0, 1.5]})
    expected = list(tokenize_dataset(data, tokenizer))
    with caplog.at_level("WARNING", logger="collators.tokenize_data"):
        streamed = tokenize_dataset(data.to_iterable_dataset(), tokenizer)
        assert isinstance(streamed, IterableDataset)
        rows = list(streamed)
    assert [{key: row[key] for key in expected[0]} for row in rows] == expected
    assert [row["weight"] for row in rows] == [1.0, 2.0, 0.5, 1.5]
    assert "Skipped 1 of 5 streamed conversations that have no assistant turn" in caplog.text
    packed = pack_dataset(tokenize_dataset(data.to_iterable_dataset(), tokenizer), 512)
    assert sum(len(lengths) for lengths in packed["seq_lengths"]) == 4
    for option in ("num_proc", "cache_file_name"):
        with pytest.raises(ValueError, match=f"`{option}` is for a datasets.Dataset"):
            tokenize_dataset(data.to_iterable_dataset(), tokenizer, **{option: 2 if option == "num_proc" else "x"})
