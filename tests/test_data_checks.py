"""The trainers' data checks (packed_ce/integrations/trainers/data_checks.py): every weight 0, empty data
sets, conversations without a target (named by row, or skipped with ``skip_no_assistant=True``
and the rest trained exactly), rows whose labels do not match their tokens.

A step that trains after skipping is compared with one SGD step of each kept conversation alone
(:func:`integration_utils.per_conversation_sgd_step`).
"""

from __future__ import annotations

import copy
import logging

import pytest

pytest.importorskip("trl")
Dataset = pytest.importorskip("datasets").Dataset

import collators  # noqa: E402
from packed_ce.integrations import PackedSFTTrainer, PackedTrainer, apply_packed_loss, tiny_causal_lm  # noqa: E402

from integration_utils import (  # noqa: E402
    IGNORE,
    SFT_LENGTHS,
    flat_relative_error,
    parameter_updates,
    per_conversation_sgd_step,
    sft_args,
    sft_tokenizer,
    sgd,
    snapshot,
    synthetic_conversations,
    without_generation_markers,
)

VOCAB = 3072  # the default tokenizer's size
UPDATE_RTOL = 1e-5


def sft_trainer(model, dataset, tmp_path, **fields):
    skip = fields.pop("skip_no_assistant", False)
    fields = {"padding_free": True, "max_length": None, "per_device_train_batch_size": 16} | fields
    return PackedSFTTrainer(model=model, args=sft_args(tmp_path, **fields), train_dataset=dataset,
                            processing_class=sft_tokenizer(), optimizers=sgd(model),
                            skip_no_assistant=skip)


def packed_trainer(model, dataset, tmp_path, **fields):
    skip = fields.pop("skip_no_assistant", False)
    collator = collators.PackedCollator()
    return PackedTrainer(model=apply_packed_loss(model), args=sft_args(tmp_path, per_device_train_batch_size=16,
                                                                        **fields),
                         train_dataset=dataset, data_collator=collator, optimizers=sgd(model),
                         skip_no_assistant=skip)


TRAINERS = {"sft": sft_trainer, "packed": packed_trainer}


def assert_step_of(model, reference, initial, conversations):
    """``model`` took the step of ``conversations`` alone, one at a time (``reference`` takes it)."""
    per_conversation_sgd_step(reference, conversations)
    expected = {n: p - initial[n] for n, p in snapshot(reference).items()}
    assert any(e.abs().max() > 0 for e in expected.values())
    error = flat_relative_error(parameter_updates(model, initial), expected)
    assert error <= UPDATE_RTOL, f"parameter update off by {error:.2e}"


# --- weights and empty data sets ----------------------------------------------------------------


@pytest.mark.parametrize("kind", TRAINERS)
def test_every_weight_zero_is_refused_naming_the_data_set(kind, tmp_path):
    rows = [{**c, "weight": 0.0} for c in synthetic_conversations(SFT_LENGTHS, VOCAB, seed=3)]
    with pytest.raises(ValueError, match=r"every weight of `train_dataset` is 0"):
        TRAINERS[kind](tiny_causal_lm(VOCAB), Dataset.from_list(rows), tmp_path)


@pytest.mark.parametrize(
    "column, values, error, match",
    [
        ("weight", [1.0, 2.0, -1.0], ValueError, r"`train_dataset\[2\]\['weight'\]` must be finite and >= 0"),
        ("weight", [True, False, True], TypeError, r"`train_dataset\[0\]\['weight'\]` must be a real number"),
        ("source", [3, 5, 7], TypeError, r"`train_dataset\[0\]\['source'\]` must be None or a string"),
        ("seq_weights", [[1.0], [1.0, float("nan")], [2.0]], ValueError,
         r"`train_dataset\[1\]\['seq_weights'\]` must be finite and >= 0, got nan at index 1"),
    ],
    ids=["negative weight", "bool weight", "number source", "packed NaN weight"],
)
def test_each_per_conversation_column_is_checked_naming_its_row(column, values, error, match, tmp_path):
    """The columns of the table (``packed_ce.columns.SEQUENCE_COLUMNS``), each checked as the
    collators check it, before the trainer is built."""
    rows = synthetic_conversations([12, 9, 14], VOCAB, seed=3)
    if column == "seq_weights":  # packed rows of one, two and one conversations
        rows = [rows[0], {"input_ids": rows[1]["input_ids"] + rows[2]["input_ids"],
                          "labels": rows[1]["labels"] + rows[2]["labels"], "seq_lengths": [9, 14]},
                {**rows[2], "seq_lengths": [14]}]
        rows[0]["seq_lengths"] = [12]
    rows = [{**row, column: value} for row, value in zip(rows, values)]
    with pytest.raises(error, match=match):
        packed_trainer(tiny_causal_lm(VOCAB), Dataset.from_list(rows), tmp_path)


@pytest.mark.parametrize("kind", TRAINERS)
def test_an_empty_data_set_is_refused_by_name(kind, tmp_path):
    empty = Dataset.from_dict({"input_ids": [], "labels": []})
    with pytest.raises(ValueError, match=r"`train_dataset` is empty"):
        TRAINERS[kind](tiny_causal_lm(VOCAB), empty, tmp_path)


# --- conversations without a target ------------------------------------------------------------


def without_a_target(row: int = 3) -> list[dict]:
    """Tokenised conversations; ``row``'s labels are all ignored."""
    conversations = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=4)  # all with a target
    conversations[row]["labels"] = [IGNORE] * len(conversations[row]["labels"])
    return conversations


@pytest.mark.parametrize("kind", TRAINERS)
def test_a_conversation_without_a_target_is_named_or_skipped(kind, tmp_path, caplog):
    conversations = without_a_target()
    dataset = Dataset.from_list(conversations)
    with pytest.raises(ValueError, match=r"`train_dataset\[3\]` has no target .*skip_no_assistant=True"):
        TRAINERS[kind](tiny_causal_lm(VOCAB), dataset, tmp_path)
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    reference, initial = copy.deepcopy(model), snapshot(model)
    with caplog.at_level(logging.WARNING):
        trainer = TRAINERS[kind](model, dataset, tmp_path, skip_no_assistant=True)
    assert "skipped 1 of 8 conversations without a target" in caplog.text
    assert trainer.train_dataset.num_rows == 7
    trainer.train()
    assert_step_of(model, reference, initial, conversations[:3] + conversations[4:])


def test_a_packed_conversation_without_a_target_is_named_or_counted(tmp_path, caplog):
    conversations = without_a_target()
    rows = collators.pack_dataset(Dataset.from_list(conversations), max_length=32)
    with pytest.raises(ValueError, match=r"`train_dataset\[\d\]`, sequence \d of its seq_lengths, has no target"):
        packed_trainer(tiny_causal_lm(VOCAB), rows, tmp_path)
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    reference, initial = copy.deepcopy(model), snapshot(model)
    with caplog.at_level(logging.WARNING):
        trainer = packed_trainer(model, rows, tmp_path, skip_no_assistant=True)
    assert "1 of 8 conversations have no target" in caplog.text
    trainer.train()
    assert_step_of(model, reference, initial, conversations)  # it weighs nothing either way


def with_a_user_only_conversation(row: int = 3):
    data = collators.load_default_dataset().select(range(6))
    messages = list(data["messages"])
    messages[row] = [m for m in messages[row] if m["role"] != "assistant"]
    return data.remove_columns("messages").add_column("messages", messages)


@pytest.mark.parametrize("markers", [True, False], ids=["generation-markers", "unmarked"])
def test_no_assistant_turn_is_named_before_tokenising_or_skipped(markers, tmp_path, monkeypatch, caplog):
    """trl's own error blames the `{% generation %}` markers, and the unmarked path's suggests an
    option the trainer lacked; neither named the row."""
    tokenizer = sft_tokenizer() if markers else without_generation_markers(sft_tokenizer())
    data = with_a_user_only_conversation()
    args = dict(assistant_only_loss=True, padding_free=True, max_length=None, per_device_train_batch_size=6)
    prepared = []
    with monkeypatch.context() as patch:
        patch.setattr(PackedSFTTrainer, "_prepare_dataset", lambda self, *a: prepared.append(a))
        with pytest.raises(ValueError, match=r"`train_dataset\[3\]\['messages'\]` has no assistant turn"):
            PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=sft_args(tmp_path, **args),
                             train_dataset=data, processing_class=tokenizer)
    assert not prepared
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    reference, initial = copy.deepcopy(model), snapshot(model)
    with caplog.at_level(logging.WARNING):
        trainer = PackedSFTTrainer(model=model, args=sft_args(tmp_path, **args), train_dataset=data,
                                   processing_class=tokenizer, optimizers=sgd(model), skip_no_assistant=True)
    assert "skipped 1 of 6 conversations without a target" in caplog.text
    trainer.train()
    kept = [collators.tokenize_conversation(tokenizer, m) for i, m in enumerate(data["messages"]) if i != 3]
    assert_step_of(model, reference, initial, kept)


@pytest.mark.parametrize(
    "layout", [dict(padding_free=True, max_length=None), dict(packing=True, max_length=32)],
    ids=["padding_free", "packing"],
)
@pytest.mark.parametrize(
    "bad, match",
    [({"input_ids": [], "labels": []}, r"`train_dataset\[2\]` is empty"),
     ({"input_ids": [5, 6, 7, 8, 9], "labels": [-100, 6, 7]}, r"`train_dataset\[2\]` has 3 labels for 5 input_ids")],
    ids=["empty", "short-labels"],
)
def test_bad_rows_are_named_on_every_layout(layout, bad, match, tmp_path):
    """trl's padding-free collator gave `TypeError: labels must be an integer tensor` and a bare
    IndexError for these rows."""
    rows = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=7)
    rows[2] = bad
    with pytest.raises(ValueError, match=match):
        sft_trainer(tiny_causal_lm(VOCAB), Dataset.from_list(rows), tmp_path, **layout)


def test_skip_no_assistant_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="skip_no_assistant must be a bool"):
        sft_trainer(tiny_causal_lm(VOCAB), Dataset.from_list(synthetic_conversations(SFT_LENGTHS, VOCAB)),
                    tmp_path, skip_no_assistant="yes")


def test_no_target_left_after_trls_truncation_is_named_or_skipped(tmp_path, caplog):
    """Without packing trl truncates each conversation to max_length and drops, without a word,
    one whose answer lay past the cut: named by row (the messages did not tell), or skipped."""
    data = collators.load_default_dataset().select(range(4))
    messages = list(data["messages"])
    messages[1] = [{"role": "user", "content": "tell me " * 40}, {"role": "assistant", "content": "No."}]
    data = data.remove_columns("messages").add_column("messages", messages)
    args = sft_args(tmp_path, assistant_only_loss=True, max_length=48)  # padded batches
    with pytest.raises(ValueError, match=r"`train_dataset\[1\]` has no target left after truncation to max_length=48"):
        PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=data,
                         processing_class=sft_tokenizer())
    with caplog.at_level(logging.WARNING):
        trainer = PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=data,
                                   processing_class=sft_tokenizer(), skip_no_assistant=True)
    assert "skipped 1 of 4 conversations without a target after truncation" in caplog.text
    assert trainer.train_dataset.num_rows == 3 and "packed_ce_row" not in trainer.train_dataset.column_names


@pytest.mark.parametrize("skip", [False, True], ids=["refused", "skip_no_assistant"])
@pytest.mark.parametrize(
    "layout, match",
    [(dict(packing=True, max_length=8), r"no conversation of `train_dataset` has a target left after truncation "
                                         r"to max_length=8 \(4 of 4 truncated, 4 left without a target\)"),
     (dict(max_length=8), r"no conversation of `train_dataset` has a target left after truncation to "
                          r"max_length=8 \(4 of 4 without one\)")],
    ids=["packing", "padded"],
)
def test_nothing_left_to_train_after_truncation_is_refused(layout, match, skip, tmp_path):
    """A max_length shorter than every prompt: with packing the rows held no target and the trainer
    trained to the end with loss 0 and unchanged parameters (only a statistics line said so);
    padded, trl dropped every row and torch failed on an empty sampler. Refused, naming max_length
    and the count, as `packed-ce pack` refuses the same data, with or without skipping."""
    data = collators.load_default_dataset().select(range(4))
    args = sft_args(tmp_path, assistant_only_loss=True, **layout)
    with pytest.raises(ValueError, match=match):
        PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=data,
                         processing_class=sft_tokenizer(), skip_no_assistant=skip)


def test_packed_rows_without_any_target_are_refused_with_skip_no_assistant(tmp_path):
    """Packed rows whose every conversation lost its targets to truncation: skip_no_assistant=True
    kept them in their rows, weighing nothing, and the trainers trained on nothing."""
    tokenized = collators.tokenize_dataset(collators.load_default_dataset().select(range(4)), sft_tokenizer())
    rows = collators.pack_dataset(tokenized, max_length=8)
    for make in TRAINERS.values():
        with pytest.raises(ValueError, match=r"no conversation of `train_dataset` has a target \(4 in its packed rows"):
            make(tiny_causal_lm(VOCAB), rows, tmp_path, packing=True, max_length=8, skip_no_assistant=True)


# --- conversations where trl does not read them --------------------------------------------------


def sharegpt(messages):
    return [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]}
            for m in messages]


def to_messages(data):
    """The fix the errors name, as they write it."""
    return data.map(lambda row: {'messages': [{'role': {'human': 'user', 'gpt': 'assistant'}.get(m['from'], m['from']),
                                               'content': m['value']} for m in row['messages']]})


@pytest.mark.parametrize("assistant_only", [True, False], ids=["assistant_only_loss", "all-tokens"])
def test_conversations_where_trl_does_not_read_them_are_named_with_the_fix(assistant_only, tmp_path):
    """A `conversation` column got trl's "the dataset is not conversational" (or KeyError 'text');
    ShareGPT keys inside `messages` got "has no assistant turn ... pass skip_no_assistant=True",
    which would skip everything (or KeyError 'text'). Each is named with its fix, and the fix
    works."""
    data = collators.load_default_dataset().select(range(4)).remove_columns("category")
    args = sft_args(tmp_path, assistant_only_loss=assistant_only, padding_free=True, max_length=None)

    def build(dataset, **kwargs):
        return PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=dataset,
                                processing_class=sft_tokenizer(), **kwargs)

    renamed = data.rename_column("messages", "conversation")
    with pytest.raises(ValueError, match=r"`train_dataset` has no 'messages' column, and its column 'conversation' "
                                         r"holds conversations.*dataset.rename_column\('conversation', 'messages'\)"):
        build(renamed)
    keyed = data.map(lambda row: {"messages": sharegpt(row["messages"])})
    with pytest.raises(ValueError, match=r"`train_dataset\[0\]\['messages'\]\[0\]` has ShareGPT's key\(s\) "
                                         r"\['from', 'value'\], not 'role' and 'content': map them"):
        build(keyed, skip_no_assistant=True)
    expected = build(data).train_dataset
    for fixed in (renamed.rename_column("conversation", "messages"), to_messages(keyed)):
        assert build(fixed).train_dataset["input_ids"] == expected["input_ids"]
    # ShareGPT's own column: trl renames its keys, but not its roles 'human' and 'gpt' (which the
    # template rendered as they are), and not under assistant_only_loss: named, with both fixes
    shared = keyed.rename_column("messages", "conversations")
    with pytest.raises(ValueError, match=r"column 'conversations' holds conversations.*ShareGPT's keys"):
        build(shared)
    fixed = to_messages(shared.rename_column("conversations", "messages"))
    assert build(fixed).train_dataset["input_ids"] == expected["input_ids"]
    if not assistant_only:  # with the roles of the messages format, trl's own conversion is taken
        roles = data.map(lambda row: {"conversations": [{"from": m["role"], "value": m["content"]}
                                                        for m in row["messages"]]}, remove_columns="messages")
        assert build(roles).train_dataset["input_ids"] == expected["input_ids"]


def test_sharegpt_keys_in_a_later_row_are_named_not_skipped(tmp_path):
    data = collators.load_default_dataset().select(range(4)).remove_columns("category")
    messages = list(data["messages"])
    messages[2] = sharegpt(messages[2])
    mixed = Dataset.from_dict({"messages": messages})
    args = sft_args(tmp_path, assistant_only_loss=True, padding_free=True, max_length=None)
    with pytest.raises(ValueError, match=r"`train_dataset\[2\]\['messages'\]\[0\]` has ShareGPT's key\(s\)"):
        PackedSFTTrainer(model=tiny_causal_lm(VOCAB), args=args, train_dataset=mixed,
                         processing_class=sft_tokenizer(), skip_no_assistant=True)
