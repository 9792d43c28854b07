"""The offline defaults (chatterbot-corpus dialogues, a BPE tokenizer trained on them) and the docstring examples."""

import doctest
import importlib
import json
import sys

import pytest

import collators
from collators import (
    PackedCollator,
    load_default_dataset,
    load_default_tokenizer,
    load_messages_dataset,
    pack_dataset,
    tokenize_dataset,
)

IGNORE = -100


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tokenizer")


@pytest.fixture(scope="module")
def tokenizer(cache_dir):
    return load_default_tokenizer(cache_dir=cache_dir)


def test_default_dataset():
    dataset = load_default_dataset()
    assert dataset.column_names == ["messages", "category"]
    assert dataset.num_rows == 2026
    for messages in dataset["messages"][:300]:
        roles = [m["role"] for m in messages]
        assert roles[0] == "system" and roles[-1] == "assistant"
        assert roles[1:] == ["user", "assistant"] * (len(roles) // 2)
    plain = load_default_dataset(system_prompt=False)
    assert plain[0]["messages"] == dataset[0]["messages"][1:]


def test_default_tokenizer_is_deterministic_and_cached(tokenizer, tmp_path):
    again = load_default_tokenizer(cache_dir=tmp_path)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    cached = list(tmp_path.glob("chatterbot-bpe-*.json"))
    assert len(cached) == 1
    # The second load reads the file: corrupting it shows.
    cached[0].write_text("{}")
    with pytest.raises(Exception, match="missing"):  # tokenizers raises a bare Exception
        load_default_tokenizer(cache_dir=tmp_path)
    assert len(tokenizer) == 3072
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")


def test_default_pipeline_end_to_end(tokenizer):
    """Corpus -> labels -> packed rows -> batch: each trained span is an assistant answer and its <|im_end|>."""
    dataset = load_default_dataset().select(range(400))
    tokenized = tokenize_dataset(dataset, tokenizer)
    assert tokenized.num_rows == 400
    for messages, labels in zip(dataset["messages"][:50], tokenized["labels"][:50]):
        trained = tokenizer.decode([t for t in labels if t != IGNORE])
        answers = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert trained == "".join(answers)
    packed, stats = pack_dataset(tokenized, 512, return_stats=True)
    assert stats.num_packed == 400 and stats.efficiency > 0.9
    batch = PackedCollator()(packed.select(range(4)))
    assert batch["num_sequences"] == sum(len(row) for row in packed.select(range(4))["seq_lengths"])


def test_load_messages_dataset_from_jsonl(tmp_path):
    path = tmp_path / "chats.jsonl"
    records = [{"conversation": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    dataset = load_messages_dataset(path, messages_column="conversation")
    assert dataset["messages"] == [records[0]["conversation"]]
    with pytest.raises(ValueError, match="has no column 'messages'"):
        load_messages_dataset(path)


@pytest.mark.parametrize(
    "module", ["collators.chat", "collators.collate", "collators.data", "collators.packing", "collators.planning",
               "collators.processors", "collators.sharding", "collators.streaming", "collators.tokenize_data", "collators.vision",
               "collators.vision_collate"]
)
def test_docstring_examples(module, tokenizer, cache_dir, monkeypatch):
    """The `>>>` examples in the docstrings are exact."""
    # The examples call load_default_tokenizer() without cache_dir: point them at the copy trained above.
    monkeypatch.setenv("PACKED_CE_CACHE", str(cache_dir))
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("loader", ["load_default_dataset", "load_default_tokenizer"])
@pytest.mark.parametrize("missing", ["chatterbot_corpus", "yaml"])
def test_a_missing_demo_extra_is_named_with_its_install_command(loader, missing, monkeypatch, tmp_path):
    """Without the `demo` extra the loaders said `PackageNotFoundError: chatterbot-corpus`."""
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    with pytest.raises(ImportError, match=rf'{loader} needs the `demo` extra .*missing: {missing}.*pip install "packed-ce\[demo\]"'):
        getattr(collators, loader)(**({"cache_dir": tmp_path} if loader == "load_default_tokenizer" else {}))
