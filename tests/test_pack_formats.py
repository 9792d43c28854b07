"""``packed-ce pack --dataset`` on the data users have: conversations in the messages format or already tokenized
(``input_ids`` + ``labels``), as JSON/JSONL, Parquet, Arrow (stream and file format), a ``save_to_disk`` folder (a
data set or a dict of splits) or a folder of files; every one gives the rows of the library called directly."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")
import pyarrow as pa
from datasets import Dataset, DatasetDict

import collators
from packed_ce_demo.cli import main

CHATS = [("Hi", "Hello", 2.0, "greetings"), ("How are you?", "Fine, thanks.", 0.5, "smalltalk"),
         ("Bye", "Goodbye", 1.0, "greetings"), ("What is 2 + 2?", "4", 1.5, "math")]
RECORDS = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}], "weight": w,
            "source": s} for q, a, w, s in CHATS]


@pytest.fixture(scope="module")
def tokenized():
    return collators.tokenize_dataset(Dataset.from_list(RECORDS), collators.load_default_tokenizer())


def write_arrow(path, dataset, file_format=False):
    table = dataset.data.table
    with pa.OSFile(str(path), "wb") as sink:
        with (pa.ipc.new_file if file_format else pa.ipc.new_stream)(sink, table.schema) as writer:
            writer.write_table(table)


def write_jsonl(path, dataset):
    path.write_text("".join(json.dumps(row) + "\n" for row in dataset.to_list()), encoding="utf-8")


# name -> writes the data set under the folder given, returns the path to pass
FORMATS = {
    "jsonl": lambda d, data: write_jsonl(d / "chats.jsonl", data) or d / "chats.jsonl",
    "json": lambda d, data: (d / "chats.json").write_text(json.dumps(data.to_list())) and d / "chats.json",
    "parquet": lambda d, data: data.to_parquet(str(d / "chats.parquet")) and d / "chats.parquet",
    "arrow stream": lambda d, data: write_arrow(d / "chats.arrow", data) or d / "chats.arrow",
    "arrow file": lambda d, data: write_arrow(d / "chats.arrow", data, file_format=True) or d / "chats.arrow",
    "save_to_disk": lambda d, data: data.save_to_disk(str(d / "saved")) or d / "saved",
    "save_to_disk splits": lambda d, data: DatasetDict(
        {"train": data, "test": data.select([0])}).save_to_disk(str(d / "saved")) or d / "saved",
    "folder of parquet": lambda d, data: [data.select(range(i, i + 2)).to_parquet(str(d / f"part-{i}.parquet"))
                                          for i in (0, 2)] and d,
    "folder of jsonl": lambda d, data: [write_jsonl(d / f"part-{i}.jsonl", data.select(range(i, i + 2)))
                                        for i in (0, 2)] and d,
}


def pack_command(path, tmp_path, *options) -> Dataset:
    output = tmp_path / "packed"
    assert main(["pack", "--dataset", str(path), "--max-length", "64", "--output", str(output), *options]) == 0
    return datasets.load_from_disk(str(output))


CASES = [(name, "messages") for name in FORMATS] + [
    (name, "tokenized") for name in ("jsonl", "parquet", "arrow stream", "save_to_disk", "folder of parquet")]


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[" ".join(case) for case in CASES])
def test_each_format_gives_the_librarys_rows(name, kind, tokenized, tmp_path):
    data = Dataset.from_list(RECORDS) if kind == "messages" else tokenized
    folder = tmp_path / "data"
    folder.mkdir()
    path = FORMATS[name](folder, data)
    expected = collators.pack_dataset(tokenized, 64)
    packed = pack_command(path, tmp_path)
    assert packed.to_dict() == expected.to_dict()
    assert packed.column_names == ["input_ids", "labels", "seq_lengths", "seq_weights", "seq_sources"]


def test_several_processes_give_the_same_rows(tokenized, tmp_path):
    path = FORMATS["jsonl"](tmp_path, Dataset.from_list(RECORDS))
    packed = pack_command(path, tmp_path, "--num-proc", "2")
    assert packed.to_dict() == collators.pack_dataset(tokenized, 64).to_dict()


def test_progress_bars_count_conversations_and_rows(tmp_path, capsys):
    """`datasets`' bars say `examples` whatever they count: tokenizing counts conversations, packing rows."""
    path = FORMATS["jsonl"](tmp_path, Dataset.from_list(RECORDS))
    datasets.enable_progress_bars()
    pack_command(path, tmp_path)
    err = capsys.readouterr().err
    assert "Tokenizing: 100%" in err and "4/4" in err and " conversations/s]" in err
    assert "Packing: 100%" in err and " rows/s]" in err


def test_statistics_count_the_conversations_skipped_without_an_assistant_turn(tmp_path, capsys):
    """A conversation without an assistant turn is skipped when tokenizing: counted in the JSON
    statistics and the text, so the printed counts add up to the data set's."""
    untrained = {"messages": [{"role": "user", "content": "Anyone?"}], "weight": 1.0, "source": "x"}
    path = FORMATS["jsonl"](tmp_path, Dataset.from_list(RECORDS + [untrained]))
    assert main(["pack", "--dataset", str(path), "--output", str(tmp_path / "rows"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert (stats["num_skipped_no_assistant"], stats["num_conversations"], stats["num_packed"]) == (1, 4, 4)
    assert main(["pack", "--dataset", str(path), "--output", str(tmp_path / "again")]) == 0
    assert "skipped     1 (no assistant turn)" in capsys.readouterr().out
