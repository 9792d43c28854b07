"""Tool-calling and reasoning conversations through every producer and both trainers.

The data (:data:`integration_utils.TOOL_CONVERSATIONS`) hold tool definitions (a ``tools`` column,
JSON text or a list), assistant tool calls (one, two in parallel), tool results and thinking
content (``reasoning_content``). The default tokenizer's template renders them all. The tokens of
each conversation are ``tokenize_conversation`` of its messages with its row's template inputs
(``collators.chat.template_inputs``), and must be exactly what trl's ``SFTTrainer`` tokenises for
the row (``assistant_only_loss=True``), what ``PackedSFTTrainer`` trains on (its own labels under a
template without generation markers too), and what every packer writes: ``tokenize_dataset`` +
``pack_dataset``, a stream through ``tokenize_dataset`` + ``PackedIterableDataset`` /
``pack_dataset``, and ``packed-ce pack``. Both trainers then take one SGD step equal to every
conversation alone (loss and every parameter update).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import collators  # noqa: E402
from collators.chat import template_inputs  # noqa: E402
from packed_ce.integrations import PackedSFTTrainer, PackedTrainer, apply_packed_loss, tiny_causal_lm  # noqa: E402
from packed_ce_demo import split_rows  # noqa: E402
from packed_ce_demo.cli import main  # noqa: E402

from integration_utils import (  # noqa: E402
    flat_relative_error,
    parameter_updates,
    per_conversation_sgd_step,
    relative_error,
    sft_args,
    sft_tokenizer,
    sgd,
    snapshot,
    tool_dataset,
    without_generation_markers,
)

VOCAB = 3072  # the default tokenizer's size
UPDATE_RTOL = 1e-5
ROW = 512  # every tool conversation fits a row


def expected_conversations(dataset, tokenizer=None) -> list[dict]:
    """Each row's ``tokenize_conversation`` with its template inputs, computed row by row."""
    tokenizer = tokenizer or sft_tokenizer()
    return [
        collators.tokenize_conversation(tokenizer, row["messages"], **template_inputs(row))
        for row in dataset
    ]


def tokens(conversations) -> list[tuple]:
    return sorted((tuple(c["input_ids"]), tuple(c["labels"])) for c in conversations)


def test_the_tools_are_rendered_as_the_template_renders_them():
    """Each row's tool definitions are in its tokens (they were left out: 147 tokens for the first
    conversation instead of 251), its thinking and tool calls are trained, its tool results not."""
    tokenizer = sft_tokenizer()
    dataset = tool_dataset()
    tokenized = collators.tokenize_dataset(dataset, tokenizer)
    assert tokenized.column_names == ["input_ids", "labels"]  # tools consumed, not carried
    first = tokenized[0]
    without = collators.tokenize_conversation(tokenizer, dataset[0]["messages"])
    assert (len(first["input_ids"]), len(without["input_ids"])) == (251, 147)
    text = tokenizer.decode(first["input_ids"])
    trained = tokenizer.decode([t for t in first["labels"] if t != -100])
    assert '"name": "get_weather", "description": "The weather in a city now."' in text
    assert "<think>\nThe user wants the weather: call the tool.\n</think>" in trained
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in trained and "sunny, 21C" not in trained
    assert tokens(tokenized) == tokens(expected_conversations(dataset))


@pytest.mark.parametrize("tools_as_json", [True, False], ids=["json-tools", "list-tools"])
@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "unmarked"])
def test_trl_and_packed_sft_trainer_tokenise_as_tokenize_dataset(markers, tools_as_json, tmp_path):
    """trl passes a row's ``tools`` (decoded from JSON text) to the chat template: tokenize_dataset
    gives its tokens and labels, row for row (Arrow fills a list's missing keys with None, for trl
    and here alike); PackedSFTTrainer too, under a template without markers as well."""
    from trl import SFTTrainer

    tokenizer = sft_tokenizer() if markers else without_generation_markers(sft_tokenizer())
    dataset = tool_dataset(tools_as_json)
    expected = collators.tokenize_dataset(dataset, tokenizer)
    args = dict(assistant_only_loss=True, padding_free=True, max_length=None)
    trainers = [PackedSFTTrainer] + ([SFTTrainer] if markers else [])
    for trainer_class in trainers:
        trainer = trainer_class(model=tiny_causal_lm(VOCAB), args=sft_args(tmp_path, **args),
                                train_dataset=dataset, processing_class=tokenizer)
        prepared = trainer.train_dataset
        assert prepared["input_ids"] == expected["input_ids"], trainer_class.__name__
        assert prepared["labels"] == expected["labels"], trainer_class.__name__


def stream(dataset):
    return dataset.to_iterable_dataset(num_shards=2)


def written(dataset, path) -> str:
    """``dataset`` as JSON lines (tools as JSON text, as a data file holds them)."""
    with open(path, "w", encoding="utf-8") as handle:
        for row in dataset:
            handle.write(json.dumps(row) + "\n")
    return str(path)


PRODUCERS = {
    "tokenize_dataset+pack_dataset": lambda data, tmp: list(
        collators.pack_dataset(collators.tokenize_dataset(data, sft_tokenizer()), ROW)),
    "stream+PackedIterableDataset": lambda data, tmp: list(
        collators.PackedIterableDataset(collators.tokenize_dataset(stream(data), sft_tokenizer()), ROW)),
    "stream+pack_stream": lambda data, tmp: list(
        collators.pack_stream(collators.tokenize_dataset(stream(data), sft_tokenizer()), ROW)),
    "stream+pack_dataset": lambda data, tmp: list(
        collators.pack_dataset(collators.tokenize_dataset(stream(data), sft_tokenizer()), ROW)),
}


@pytest.mark.parametrize("producer", PRODUCERS)
def test_every_producer_writes_the_rendered_tools(producer, tmp_path):
    dataset = tool_dataset()
    rows = PRODUCERS[producer](dataset, tmp_path)
    assert tokens(split_rows(rows)) == tokens(expected_conversations(dataset))


def test_the_pack_command_writes_the_rendered_tools(tmp_path, capsys):
    """``packed-ce pack`` on a JSON-lines file of messages and tools: the tools were refused as a
    column to carry (or, as JSON text, carried to the rows unrendered)."""
    dataset = tool_dataset()
    output = tmp_path / "packed"
    argv = ["pack", "--dataset", written(dataset, tmp_path / "tools.jsonl"), "--max-length", str(ROW)]
    assert main(argv + ["--output", str(output)]) == 0, capsys.readouterr().err
    packed = datasets.load_from_disk(str(output))
    assert packed.column_names == ["input_ids", "labels", "seq_lengths"]
    assert tokens(split_rows(packed)) == tokens(expected_conversations(dataset))


def assert_step_of(model, reference, initial, conversations, logged_loss):
    loss = per_conversation_sgd_step(reference, conversations)
    expected = {n: p - initial[n] for n, p in snapshot(reference).items()}
    error = flat_relative_error(parameter_updates(model, initial), expected)
    assert error <= UPDATE_RTOL, f"parameter update off by {error:.2e}"
    assert relative_error(torch.tensor(logged_loss), loss) <= 1e-5


@pytest.mark.parametrize(
    "layout",
    [dict(packing=True, max_length=ROW), dict(padding_free=True, max_length=None)],
    ids=["packing", "padding_free"],
)
@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "unmarked"])
def test_packed_sft_trainer_trains_tool_data_exactly(markers, layout, tmp_path):
    tokenizer = sft_tokenizer() if markers else without_generation_markers(sft_tokenizer())
    dataset = tool_dataset()
    model = tiny_causal_lm(VOCAB)
    reference, initial = copy.deepcopy(model), snapshot(model)
    args = sft_args(tmp_path, assistant_only_loss=True, per_device_train_batch_size=8, **layout)
    trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                               optimizers=sgd(model))
    trainer.train()
    assert_step_of(model, reference, initial, expected_conversations(dataset, tokenizer),
                   trainer.state.log_history[0]["loss"])


def test_packed_trainer_trains_tool_data_exactly(tmp_path):
    dataset = tool_dataset()
    rows = collators.pack_dataset(collators.tokenize_dataset(dataset, sft_tokenizer()), ROW)
    model = apply_packed_loss(tiny_causal_lm(VOCAB))
    reference, initial = copy.deepcopy(model), snapshot(model)
    trainer = PackedTrainer(model=model, args=sft_args(tmp_path, per_device_train_batch_size=8),
                            train_dataset=rows, data_collator=collators.PackedCollator(),
                            optimizers=sgd(model))
    trainer.train()
    assert_step_of(model, reference, initial, expected_conversations(dataset),
                   trainer.state.log_history[0]["loss"])


# --- the other columns a template reads: documents, template variables ----------------------------

# The default template, with a per-row system prompt read from a template variable.
SYSTEM_PROMPT_TEMPLATE = (
    "{%- if system_prompt %}{{- '<|im_start|>system\\n' + system_prompt + '<|im_end|>\\n' }}"
    "{%- endif %}" + collators.templates.CHATML_TEMPLATE
)


def with_documents_and_prompts():
    """Conversations with a ``documents`` column, ``chat_template_kwargs`` giving each row a
    template variable (a system prompt the template reads) and a ``system`` column (a system
    prompt no template reads), and a tokenizer whose template reads the first two."""
    tokenizer = copy.deepcopy(sft_tokenizer())
    tokenizer.chat_template = SYSTEM_PROMPT_TEMPLATE
    data = collators.load_default_dataset(system_prompt=False).select(range(3)).remove_columns("category")
    data = data.add_column("documents", [[{"title": f"Note {i}", "text": f"Fact number {i}."}] for i in range(3)])
    data = data.add_column("system", ["Be brief.", None, ""])  # None and "": no system turn
    prompts = [{"system_prompt": f"Answer as guide {i}."} for i in range(3)]
    return tokenizer, data.add_column("chat_template_kwargs", prompts)


def test_documents_and_template_variables_are_rendered_as_trl_passes_them(tmp_path):
    """A row's ``chat_template_kwargs`` are its template variables (trl spreads them into
    apply_chat_template); its ``documents`` go to the template too, and its ``system`` column opens
    its messages (trl 1.16 leaves both columns out: PackedSFTTrainer passes them on, so its tokens
    are tokenize_dataset's)."""
    from trl import SFTTrainer

    tokenizer, data = with_documents_and_prompts()
    tokenized = collators.tokenize_dataset(data, tokenizer)
    assert tokenized.column_names == ["input_ids", "labels"]
    for i, (row, messages) in enumerate(zip(tokenized, data["messages"])):
        system = [{"role": "system", "content": data[i]["system"]}] if data[i]["system"] else []
        expected = collators.tokenize_conversation(
            tokenizer, system + messages, documents=data[i]["documents"], system_prompt=f"Answer as guide {i}.")
        assert row == expected
        text = tokenizer.decode(row["input_ids"])
        assert f"Answer as guide {i}." in text and f'"text": "Fact number {i}."' in text
        assert ("<|im_start|>system\nBe brief" in text) == (i == 0)
    args = sft_args(tmp_path, assistant_only_loss=True, padding_free=True, max_length=None)
    trainer = PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=data,
                               processing_class=tokenizer)
    assert trainer.train_dataset["input_ids"] == tokenized["input_ids"]
    assert trainer.train_dataset["labels"] == tokenized["labels"]
    without = data.remove_columns(["documents", "system"])
    trl = SFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=without, processing_class=tokenizer)
    ours = collators.tokenize_dataset(without, tokenizer)
    assert trl.train_dataset["input_ids"] == ours["input_ids"] and trl.train_dataset["labels"] == ours["labels"]


def test_a_template_input_given_twice_is_refused(tmp_path):
    tokenizer, data = with_documents_and_prompts()
    opened = data.map(lambda row: {"messages": [{"role": "system", "content": "Hi."}, *row["messages"]]})
    with pytest.raises(ValueError, match="`dataset` row 0 has a system prompt in its column and a system turn"):
        collators.tokenize_dataset(opened, tokenizer)
    with pytest.raises(ValueError, match="`train_dataset` row 0 has a system prompt in its column and a system turn"):
        PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=sft_args(tmp_path, padding_free=True, max_length=None),
                         train_dataset=opened, processing_class=tokenizer)
    with pytest.raises(ValueError, match=r"system prompt columns \['system', 'system_prompt'\]: keep one"):
        collators.tokenize_dataset(data.add_column("system_prompt", ["x"] * 3), tokenizer)
    with pytest.raises(ValueError, match="`documents` is given to tokenize_dataset and `dataset` has a 'documents' column"):
        collators.tokenize_dataset(data, tokenizer, documents=[])
    with pytest.raises(ValueError, match=r"`dataset`'s chat_template_kwargs give \['system_prompt'\], which are also given"):
        collators.tokenize_dataset(data, tokenizer, system_prompt="Be brief.")
