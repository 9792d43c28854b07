"""PackedSFTTrainer in the set-ups SFT runs in: LoRA, MoE, split packing, weights, sources, any
chat template; every refusal before the data is prepared.

Each training test takes one SGD step (no clipping) over the whole data set and compares the
parameters with a reference that never looks at packing: every conversation alone through
transformers' own loss, averaged over conversations (weighted by the ``weight`` column). A model
without layers is context-free (the logits of a token depend on that token only), which makes
the reference exact for conversations split across rows too.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("trl")
Dataset = pytest.importorskip("datasets").Dataset

import collators  # noqa: E402
from packed_ce.integrations import (  # noqa: E402
    PackedSFTTrainer,
    apply_packed_loss,
    packed_loss_of,
    tiny_causal_lm,
)

from integration_utils import (  # noqa: E402
    IGNORE,
    flat_relative_error,
    SFT_LENGTHS,
    one_at_a_time,
    parameter_updates,
    per_conversation_sgd_step,
    relative_error,
    sft_args,
    sft_tokenizer,
    sgd,
    snapshot,
    synthetic_conversations,
    without_generation_markers,
)

VOCAB = 3072  # the default tokenizer's size
UPDATE_RTOL = 1e-5


def assert_same_step(trained, reference_params, initial):
    trainable = [n for n, p in trained.named_parameters() if p.requires_grad]
    updates = {n: u for n, u in parameter_updates(trained, initial).items() if n in trainable}
    expected = {n: reference_params[n] - initial[n] for n in trainable}
    error = flat_relative_error(updates, expected)
    assert any(e.abs().max() > 0 for e in expected.values())
    assert error <= UPDATE_RTOL, f"parameter update off by {error:.2e}"
    return error


def make_trainer(model, dataset, tmp_path, **fields):
    return PackedSFTTrainer(
        model=model,
        args=sft_args(tmp_path, **fields),
        train_dataset=dataset,
        processing_class=sft_tokenizer(),
        optimizers=sgd(model),
    )


# --- LoRA / PEFT -------------------------------------------------------------------------------


def lora_config(head: bool = False):
    from peft import LoraConfig

    # init_lora_weights=False: B random too, so that A and B both get a gradient in one step
    targets = ["q_proj", "v_proj"] + (["lm_head"] if head else [])
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets,
                      init_lora_weights=False)


# (trl itself refuses a LoRA adapter on lm_head; apply_packed_loss keeps such a head's loss on the
# logits: test_apply_packed_loss_on_a_peft_model_is_not_stock)
@pytest.mark.parametrize("how", ["peft_config", "PeftModel"])
def test_lora_trains_the_adapter_on_the_per_conversation_mean(how, tmp_path):
    peft = pytest.importorskip("peft")
    conversations = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=7)
    config = lora_config()
    model, kwargs = tiny_causal_lm(VOCAB), {}
    if how == "peft_config":
        kwargs["peft_config"] = config
    else:
        model = peft.get_peft_model(model, config)
    trainer = PackedSFTTrainer(
        model=model, args=sft_args(tmp_path, padding_free=True, max_length=None,
                                   per_device_train_batch_size=4, gradient_accumulation_steps=2),
        train_dataset=Dataset.from_list(conversations), processing_class=sft_tokenizer(), **kwargs,
    )
    trained = trainer.model
    assert isinstance(trained, peft.PeftModel)
    installation = trained.get_base_model()._packed_ce
    assert installation.fused_options is not None  # a plain head: the fused loss
    # the reference: the same adapter and weights, without trl or the packed loss
    reference = peft.get_peft_model(tiny_causal_lm(VOCAB), lora_config())
    reference.load_state_dict(trained.state_dict())
    initial = snapshot(trained)
    trainer.optimizer, trainer.lr_scheduler = sgd(trained)
    trainer.train()
    per_conversation_sgd_step(reference, conversations)
    params = snapshot(reference)
    assert_same_step(trained, params, initial)


@pytest.mark.parametrize("head", [False, True], ids=["plain-head", "lora-head"])
def test_apply_packed_loss_on_a_peft_model_is_not_stock(head):
    peft = pytest.importorskip("peft")
    conversations = synthetic_conversations([9, 14, 5], VOCAB, seed=2)
    model = peft.get_peft_model(tiny_causal_lm(VOCAB), lora_config(head=head))
    if head:  # an adapted head is no plain nn.Linear: its loss stays on the logits
        with pytest.raises(ValueError, match="nn.Linear"):
            apply_packed_loss(model, fused_linear=True)
    assert apply_packed_loss(model) is model
    assert packed_loss_of(model) is not None
    batch = collators.PackedCollator()([{**c, "seq_lengths": [len(c["input_ids"])]} for c in conversations])
    loss = model(**batch).loss
    assert "Nll" not in type(loss.grad_fn).__name__
    expected = one_at_a_time(model, conversations)
    assert relative_error(loss, expected) <= 1e-5


def test_stock_sft_trainer_on_a_peft_model_with_the_packed_loss_is_refused(tmp_path):
    peft = pytest.importorskip("peft")
    from trl import SFTTrainer

    model = peft.get_peft_model(apply_packed_loss(tiny_causal_lm(VOCAB)), lora_config())
    trainer = SFTTrainer(
        model=model, args=sft_args(tmp_path, padding_free=True, max_length=None, per_device_train_batch_size=2),
        train_dataset=Dataset.from_list(synthetic_conversations([9, 14], VOCAB, seed=2)),
        processing_class=sft_tokenizer(),
    )
    with pytest.raises(ValueError, match="PackedSFTTrainer instead of trl.SFTTrainer"):
        trainer.train()


# --- MoE ---------------------------------------------------------------------------------------

MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32, decoder_sparse_step=1,
                      router_aux_loss_coef=0.1),
}


@pytest.mark.parametrize("arch", list(MOE))
def test_moe_router_loss_is_added_as_trl_adds_it(arch, tmp_path):
    conversations = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=8)
    model = tiny_causal_lm(VOCAB, model_type=arch, **MOE[arch])
    trainer = make_trainer(model, Dataset.from_list(conversations), tmp_path, padding_free=True,
                           max_length=None, per_device_train_batch_size=len(SFT_LENGTHS))
    assert trainer.aux_loss_enabled
    assert model._packed_ce.fused_options is None  # the router loss needs the model's forward
    reference = tiny_causal_lm(VOCAB, model_type=arch, **MOE[arch])  # the same weights
    batch = trainer.data_collator([dict(trainer.train_dataset[i]) for i in range(len(SFT_LENGTHS))])

    def aux(m):  # the router loss of the one micro-batch; position_ids keep conversations apart
        out = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                output_router_logits=True, use_cache=False)
        return 0.1 * out.aux_loss

    initial = snapshot(model)
    trainer.train()
    per_conversation_sgd_step(reference, conversations, extra=aux)
    params = snapshot(reference)
    assert_same_step(model, params, initial)
    assert "aux_loss" in trainer.state.log_history[0]


# --- split packing, weights and sources ---------------------------------------------------------

# long conversations (40, 33) are split into rows of 24 tokens
SPLIT_LENGTHS = [40, 12, 18, 33, 7, 16, 5, 22]


def weighted_data(seed=9, scale=None):
    """Conversations, their weights, sources and the data set, whose `weight` column holds each
    weight times ``scale[source]`` (a source's scale; default 1)."""
    conversations = synthetic_conversations(SPLIT_LENGTHS, VOCAB, seed=seed)
    weights = [1.0, 2.0, 0.5, 3.0, 0.0, 1.0, 1.5, 2.5]
    sources = ["chat", "code", "chat", "math", "code", "chat", "math", "code"]
    scale = scale or {}
    rows = [{**c, "weight": w * scale.get(s, 1.0), "source": s}
            for c, w, s in zip(conversations, weights, sources)]
    return conversations, weights, sources, Dataset.from_list(rows)


def check_weighted_step(trainer, model, reference, scale=None):
    """One step of ``trainer`` on :func:`weighted_data` (with ``scale``): the parameters, the
    logged ``loss`` and every ``loss/<source>`` against each conversation alone (weighted)."""
    conversations, weights, sources, _ = weighted_data()
    # the weights relative to the heaviest source's scale: the mean does not depend on their
    # scale, and the float32 reference could not hold 1e-46 or 1e39
    relative = {s: (scale or {}).get(s, 1.0) for s in sources}
    relative = {s: r / max(relative.values()) for s, r in relative.items()}
    weights = [w * relative[s] for w, s in zip(weights, sources)]
    initial = snapshot(model)
    trainer.train()
    loss = per_conversation_sgd_step(reference, conversations, weights=weights)
    params = snapshot(reference)
    assert_same_step(model, params, initial)
    logs = trainer.state.log_history[0]
    assert relative_error(torch.tensor(logs["loss"]), loss) <= 1e-5
    with torch.no_grad():
        for source in sorted(set(sources)):
            picked = [i for i, s in enumerate(sources) if s == source]
            expected = one_at_a_time(tiny_causal_lm(VOCAB, num_hidden_layers=0),
                                     [conversations[i] for i in picked], [weights[i] for i in picked])
            assert relative_error(torch.tensor(logs[f"loss/{source}"]), expected) <= 1e-5, source


@pytest.mark.parametrize(
    "layout",
    [
        dict(packing=True, packing_strategy="bfd_split", max_length=24, per_device_train_batch_size=64),
        dict(packing=True, packing_strategy="bfd", max_length=48, per_device_train_batch_size=64),
        dict(padding_free=True, max_length=None, per_device_train_batch_size=4,
             gradient_accumulation_steps=2),
    ],
    ids=["bfd_split", "bfd", "padding_free-accumulation"],
)
def test_weights_sources_and_split_packing(layout, tmp_path):
    conversations, weights, sources, dataset = weighted_data()
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)  # context-free: split pieces are exact
    reference = copy.deepcopy(model)
    trainer = make_trainer(model, dataset, tmp_path, **layout)
    if layout.get("packing_strategy") == "bfd_split":
        pieces = [n for row in trainer.train_dataset["seq_lengths"] for n in row]
        assert len(pieces) > len(conversations) and max(pieces) <= 24  # conversations were split
    check_weighted_step(trainer, model, reference)


# Weights of one scale below float32's range (1e-46), above it (1e39): carried in float64, the
# step is the unweighted-scale mean; one source 2**-60 times lighter than the others: it trains
# (a little) and keeps its loss/<source>.
SCALES = {"1e-46": {s: 1e-46 for s in ("chat", "code", "math")},
          "1e39": {s: 1e39 for s in ("chat", "code", "math")},
          "chat 2**-60": {"chat": 2.0**-60}}


@pytest.mark.parametrize("scale", SCALES.values(), ids=SCALES.keys())
@pytest.mark.parametrize("trainer_kind", ["sft", "packed"])
def test_weights_beyond_float32_are_exact(scale, trainer_kind, tmp_path):
    *_, dataset = weighted_data(scale=scale)
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    reference = copy.deepcopy(model)
    if trainer_kind == "sft":
        trainer = make_trainer(model, dataset, tmp_path, padding_free=True, max_length=None,
                               per_device_train_batch_size=4, gradient_accumulation_steps=2)
    else:
        rows = collators.pack_dataset(dataset, max_length=24, overflow="split")
        trainer = packed_trainer(apply_packed_loss(model), rows, tmp_path, per_device_train_batch_size=4,
                                 gradient_accumulation_steps=-(-rows.num_rows // 4))
    check_weighted_step(trainer, model, reference, scale)


@pytest.mark.parametrize("trainer_kind", ["sft", "packed"])
def test_weights_too_far_apart_are_refused_by_row(trainer_kind, tmp_path):
    """A source of 1e-30 beside 1e30 would train nothing and lose its `loss/<source>` (its share
    of a step underflows float32): refused at the column check, naming the row."""
    *_, dataset = weighted_data(scale={"chat": 1e-30, "code": 1e30, "math": 1e30})
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    if trainer_kind == "sft":
        with pytest.raises(ValueError, match=r"`train_dataset\[\d\]\['weight'\]` is 5e-31, more than 2\*\*64"):
            make_trainer(model, dataset, tmp_path, padding_free=True, max_length=None)
    else:
        rows = collators.pack_dataset(dataset, max_length=24, overflow="split")
        with pytest.raises(ValueError, match=r"`train_dataset\[\d+\]\['seq_weights'\]\[\d\]` is 5e-31, more than 2\*\*64"):
            packed_trainer(apply_packed_loss(model), rows, tmp_path)


def test_stock_trl_differs_on_weighted_data(tmp_path):
    """Stock trl drops the weight column: its step is the token mean, measurably elsewhere."""
    from trl import SFTTrainer

    conversations, weights, _, dataset = weighted_data()
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    reference = copy.deepcopy(model)
    trainer = SFTTrainer(model=model, args=sft_args(tmp_path, padding_free=True, max_length=None,
                                                    per_device_train_batch_size=8),
                         train_dataset=dataset, processing_class=sft_tokenizer(), optimizers=sgd(model))
    initial = snapshot(model)
    trainer.train()
    per_conversation_sgd_step(reference, conversations, weights=weights)
    params = snapshot(reference)
    updates = parameter_updates(model, initial)
    error = flat_relative_error(updates, {n: params[n] - initial[n] for n in params})
    assert error > 0.01


@pytest.mark.parametrize(
    "column, value, error, match",
    [
        ("weight", -1.0, ValueError, r"train_dataset\[3\]\['weight'\].*>= 0"),
        ("weight", float("nan"), ValueError, r"train_dataset\[3\]\['weight'\]"),
        ("weight", "heavy", TypeError, r"train_dataset\[0\]\['weight'\].*real number"),
        ("source", 7, TypeError, r"train_dataset\[0\]\['source'\].*string"),
    ],
)
def test_bad_weight_or_source_is_refused_before_preparation(column, value, error, match, tmp_path,
                                                            monkeypatch):
    conversations = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=3)
    good = 1.0 if column == "weight" else "chat"
    # a column of one type (Arrow's): a wrong type is wrong in every row, a wrong value in row 3
    wrong_type = isinstance(value, (str, int)) and not isinstance(value, float)
    rows = [{**c, column: value if i == 3 or wrong_type else good} for i, c in enumerate(conversations)]
    prepared = []
    monkeypatch.setattr(PackedSFTTrainer, "_prepare_dataset", lambda self, *a: prepared.append(a))
    with pytest.raises(error, match=match):
        make_trainer(tiny_causal_lm(VOCAB), Dataset.from_list(rows), tmp_path, padding_free=True,
                     max_length=None)
    assert not prepared


@pytest.mark.parametrize(
    "fields", [dict(loss_type="dft"), dict(packing=True, packing_strategy="wrapped", max_length=32)],
    ids=["dft", "wrapped"],
)
def test_refusals_come_before_the_data_is_prepared(fields, tmp_path, monkeypatch):
    prepared = []
    monkeypatch.setattr(PackedSFTTrainer, "_prepare_dataset", lambda self, *a: prepared.append(a))
    with pytest.raises(ValueError, match="loss_type|packing_strategy"):
        make_trainer(tiny_causal_lm(VOCAB), Dataset.from_list(synthetic_conversations(SFT_LENGTHS, VOCAB)),
                     tmp_path, **({"padding_free": True, "max_length": None} | fields))
    assert not prepared


# --- assistant-only loss under any chat template -------------------------------------------------

# A Zephyr-like template with no generation markers, and the default ChatML one with its markers
# taken out: trl refuses both with assistant_only_loss=True.
ZEPHYR = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)




@pytest.mark.parametrize("template", ["chatml-unmarked", "zephyr"])
def test_assistant_only_loss_without_generation_markers(template, tmp_path):
    tokenizer = without_generation_markers(sft_tokenizer())
    if template == "zephyr":
        tokenizer.chat_template = ZEPHYR
    dataset = collators.load_default_dataset().select(range(6))
    trainer = PackedSFTTrainer(
        model=tiny_causal_lm(VOCAB), args=sft_args(tmp_path, assistant_only_loss=True, padding_free=True,
                                                   max_length=None, per_device_train_batch_size=6),
        train_dataset=dataset, processing_class=tokenizer,
    )
    assert trainer.args.assistant_only_loss
    for row, messages in zip(trainer.train_dataset, dataset["messages"]):
        expected = collators.tokenize_conversation(tokenizer, messages)
        assert row["input_ids"] == expected["input_ids"]
        assert row["labels"] == expected["labels"]
        assert IGNORE in row["labels"] and any(label != IGNORE for label in row["labels"])
    trainer.train()


def test_assistant_masks_equal_trl_where_the_template_has_markers(tmp_path):
    from trl import SFTTrainer

    dataset = collators.load_default_dataset().select(range(6))
    trainer = SFTTrainer(
        model=tiny_causal_lm(VOCAB), args=sft_args(tmp_path, assistant_only_loss=True, padding_free=True,
                                                   max_length=None),
        train_dataset=dataset, processing_class=sft_tokenizer(),
    )
    for row, messages in zip(trainer.train_dataset, dataset["messages"]):
        expected = collators.tokenize_conversation(sft_tokenizer(), messages)
        assert row["input_ids"] == expected["input_ids"]
        assert row["labels"] == expected["labels"]


# --- the same set-ups through PackedTrainer (collators' packing and PackedCollator) -------------


def packed_trainer(model, rows, tmp_path, **fields):
    from packed_ce.integrations import PackedTrainer

    return PackedTrainer(model=model, args=sft_args(tmp_path, **fields), train_dataset=rows,
                         data_collator=collators.PackedCollator(), optimizers=sgd(model))


def test_packed_trainer_weights_sources_and_split_rows(tmp_path):
    conversations, weights, sources, dataset = weighted_data()
    rows = collators.pack_dataset(dataset, max_length=24, overflow="split")
    assert {"seq_targets", "seq_weights", "seq_sources"} <= set(rows.column_names)
    model = tiny_causal_lm(VOCAB, num_hidden_layers=0)
    reference = copy.deepcopy(model)
    trainer = packed_trainer(apply_packed_loss(model), rows, tmp_path, per_device_train_batch_size=4,
                             gradient_accumulation_steps=-(-rows.num_rows // 4))
    check_weighted_step(trainer, model, reference)


def test_packed_trainer_lora_and_moe(tmp_path):
    peft = pytest.importorskip("peft")
    conversations = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=11)
    rows = [{**c, "seq_lengths": [len(c["input_ids"])]} for c in conversations]
    # LoRA: the adapter's parameters take the per-conversation step
    model = apply_packed_loss(peft.get_peft_model(tiny_causal_lm(VOCAB), lora_config()))
    reference = peft.get_peft_model(tiny_causal_lm(VOCAB), lora_config())
    reference.load_state_dict(model.state_dict())
    initial = snapshot(model)
    packed_trainer(model, rows, tmp_path / "lora", per_device_train_batch_size=len(rows)).train()
    per_conversation_sgd_step(reference, conversations)
    params = snapshot(reference)
    assert_same_step(model, params, initial)
    # MoE: the model's own router loss, once per micro-batch
    arch = "mixtral"
    model = apply_packed_loss(tiny_causal_lm(VOCAB, model_type=arch, output_router_logits=True, **MOE[arch]))
    reference = tiny_causal_lm(VOCAB, model_type=arch, **MOE[arch])
    batch = collators.PackedCollator()(rows)

    def aux(m):
        out = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                output_router_logits=True, use_cache=False)
        return 0.1 * out.aux_loss

    initial = snapshot(model)
    packed_trainer(model, rows, tmp_path / "moe", per_device_train_batch_size=len(rows)).train()
    per_conversation_sgd_step(reference, conversations, extra=aux)
    params = snapshot(reference)
    assert_same_step(model, params, initial)


def test_sequence_columns_check_each_example_as_the_collators_do():
    """PackedSFTTrainer's collator reads weights and sources with the collators' own checks: a
    packed row's one `weight` or `source` is refused (which sequence would it belong to?), per
    sequence values pass through, and target counts on only some rows are refused."""
    from packed_ce.integrations.trainers.trl_data import SequenceColumns

    def trl_collator(examples):  # one padding-free row: the examples' sequences back to back
        lengths = [n for example in examples for n in example["seq_lengths"]]
        bounds = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return {"cu_seq_lens_q": bounds}

    columns = SequenceColumns(trl_collator, padding_free=True)
    row = {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [2, 3]}
    for extra in ({"weight": 2.0}, {"source": "a"}):
        with pytest.raises(ValueError, match=r"examples\[0\]` is a packed row"):
            columns([row | extra])
    batch = columns([row | {"seq_weights": [2.0, 0.5], "seq_sources": ["a", "b"]}])
    assert batch["seq_weights"].tolist() == [2.0, 0.5] and batch["seq_sources"] == ["a", "b"]
    assert batch["cu_seqlens"].tolist() == [0, 2, 5] and "seq_targets" not in batch
    with pytest.raises(ValueError, match=r"examples\[0\]\['seq_weights'\]` must be finite"):
        columns([row | {"seq_weights": [2.0, -1.0]}])
    with pytest.raises(ValueError, match=r"`examples\[1\]` lacks target counts, unlike `examples\[0\]`"):
        columns([row | {"seq_targets": [1, 2]}, {"input_ids": [6], "seq_lengths": [1], "weight": 1.0}])
