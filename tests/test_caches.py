"""A pack or tokenize cache file is reused only for exactly the inputs it was written for: with an explicit
`cache_file_name`, every change of the data, options or columns gives the rows of a fresh run (and statistics
that describe them), and an unchanged call reuses the file without writing it."""

from __future__ import annotations

import pytest

pytest.importorskip("datasets")
from collator_reference import IGNORE
from datasets import Dataset, Value

import collators
from collators import arrow_rows, pack_dataset, tokenize_data, tokenize_dataset

CONVERSATIONS = {
    "input_ids": [[1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15, 16]],
    "labels": [[IGNORE, 2, 3], [IGNORE, IGNORE, 6, 7, 8, 9], [IGNORE, 11], [IGNORE, 13, 14, 15, 16]],
    "weight": [1.0, 2.0, 0.5, 1.0],
}


def fresh(dataset, max_length, **options):
    """The rows and statistics of a run without any cache file (in memory)."""
    rows, stats = pack_dataset(dataset, max_length, return_stats=True, **options)
    assert rows.cache_files == []
    return rows.to_dict(), stats


@pytest.fixture
def no_writing(monkeypatch):
    """Writing rows fails the test (for the calls that must reuse the file)."""

    def refuse(self, batch):
        raise AssertionError("rows written again")

    return lambda: monkeypatch.setattr(arrow_rows._FillRows, "__call__", refuse)


def test_pack_cache_is_rewritten_for_other_inputs_and_reused_for_the_same(tmp_path, monkeypatch, no_writing):
    path = str(tmp_path / "rows.arrow")
    data = Dataset.from_dict(CONVERSATIONS)
    other_data = Dataset.from_dict({**CONVERSATIONS, "input_ids": [[t + 1 for t in ids] for ids in
                                                                   CONVERSATIONS["input_ids"]]})
    all_trained = Dataset.from_dict({**CONVERSATIONS, "labels": CONVERSATIONS["input_ids"]})
    changes = [
        (data, 8, {}),
        (other_data, 8, {}),  # the data
        (data, 5, {}),  # max_length: rows longer than 5 would come back
        (data, 5, {"overflow": "split"}),  # overflow
        (data.remove_columns("weight"), 5, {"overflow": "split"}),  # the columns: seq_weights must go
        (data.cast_column("weight", Value("float32")), 5, {"overflow": "split"}),  # a column's type
        (all_trained, 5, {"overflow": "split"}),
        (all_trained, 5, {"overflow": "split", "ignore_index": -1}),  # ignore_index: the label at each cut
    ]
    for dataset, max_length, options in changes:
        rows, stats = pack_dataset(dataset, max_length, return_stats=True, cache_file_name=path, **options)
        assert rows.cache_files[0]["filename"] == path
        assert (rows.to_dict(), stats) == fresh(dataset, max_length, **options)
    # The last inputs again, in a new data set object: the file is reused as it is.
    written = (tmp_path / "rows.arrow").stat().st_mtime_ns
    no_writing()
    dataset, max_length, options = changes[-1]
    rows, stats = pack_dataset(Dataset.from_dict(dataset.to_dict()), max_length, return_stats=True,
                               cache_file_name=path, **options)
    assert (tmp_path / "rows.arrow").stat().st_mtime_ns == written
    assert rows.cache_files[0]["filename"] == path
    monkeypatch.undo()
    assert (rows.to_dict(), stats) == fresh(dataset, max_length, **options)


def test_pack_cache_written_by_several_processes(tmp_path, no_writing):
    """`num_proc` writes shards (`rows_00000_of_00002.arrow`): other inputs remove and rewrite them all."""
    path = str(tmp_path / "rows.arrow")
    data = Dataset.from_dict(CONVERSATIONS)
    pack_dataset(data, 8, cache_file_name=path, num_proc=2)
    rows = pack_dataset(data, 6, cache_file_name=path, num_proc=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rows.arrow.key", "rows_00000_of_00002.arrow", "rows_00001_of_00002.arrow"]
    assert rows.to_dict() == fresh(data, 6)[0]
    rows = pack_dataset(data, 5, cache_file_name=path)  # one process now: the shards of max_length=6 go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.arrow", "rows.arrow.key"]
    assert rows.to_dict() == fresh(data, 5)[0]
    no_writing()
    assert pack_dataset(data, 5, cache_file_name=path, num_proc=2).to_dict() == rows.to_dict()


def test_rows_of_a_stream_are_never_reused_for_a_dataset(tmp_path):
    path = str(tmp_path / "rows.arrow")
    data = Dataset.from_dict(CONVERSATIONS)
    streamed = pack_dataset(data.select([0, 2]).to_iterable_dataset(), 8, cache_file_name=path)
    assert streamed.num_rows == 1
    assert pack_dataset(data, 8, cache_file_name=path).to_dict() == fresh(data, 8)[0]


def counting_tokenizer_calls(monkeypatch) -> list:
    calls = []
    original = tokenize_data.tokenize_conversation

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(tokenize_data, "tokenize_conversation", counted)
    return calls


MESSAGES = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}],
    [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "Fine, thanks."}],
]


def test_tokenize_cache_is_rewritten_for_other_inputs_and_reused_for_the_same(tmp_path, monkeypatch, tokenizer):
    path = str(tmp_path / "tokens.arrow")
    data = Dataset.from_dict({"messages": MESSAGES})
    other_template = tokenizer.chat_template.replace("<|im_start|>", "<|im_start|> ")
    other_tokenizer = collators.load_default_tokenizer(vocab_size=1024, cache_dir=tmp_path / "small")
    changes = [
        (data, tokenizer, {}),
        (Dataset.from_dict({"messages": MESSAGES[::-1]}), tokenizer, {}),  # the data
        (data, tokenizer, {"max_length": 5}),  # max_length
        (data, other_tokenizer, {"max_length": 5}),  # the tokenizer
        (data, tokenizer, {"max_length": 5, "chat_template": other_template}),  # the template
        (data, tokenizer, {"max_length": 5, "ignore_index": -1}),  # an option of tokenize_conversation
    ]
    for dataset, tok, options in changes:
        tokens = tokenize_dataset(dataset, tok, cache_file_name=path, **options)
        assert tokens.cache_files[0]["filename"] == path
        assert tokens.to_dict() == tokenize_dataset(dataset, tok, **options).to_dict()
    calls = counting_tokenizer_calls(monkeypatch)
    written = (tmp_path / "tokens.arrow").stat().st_mtime_ns
    again = tokenize_dataset(Dataset.from_dict({"messages": MESSAGES}), tokenizer, cache_file_name=path,
                             **changes[-1][2])
    assert calls == [] and (tmp_path / "tokens.arrow").stat().st_mtime_ns == written
    assert again.to_dict() == tokens.to_dict()
    # a changed option after the reuse: tokenized anew
    tokenize_dataset(data, tokenizer, cache_file_name=path, max_length=6)
    assert len(calls) == len(MESSAGES)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return collators.load_default_tokenizer(cache_dir=tmp_path_factory.mktemp("tokenizer"))
