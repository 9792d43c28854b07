"""PackedSFTTrainer: trl's SFTTrainer whose step is the mean over conversations, exactly.

One optimiser step over the whole data set, through trl's own data preparation and collator
(``padding_free=True``; ``packing=True`` with best-fit-decreasing rows), with gradient
accumulation 1 and 2, with the fused linear cross entropy and with logits. The ground truth
never looks at trl: every conversation of the prepared data set alone through transformers' own
loss, averaged over conversations, one SGD step. Stock trl (a token mean) must land elsewhere,
and every option that cannot give the per-conversation mean must be refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("trl")
Dataset = pytest.importorskip("datasets").Dataset

from packed_ce.integrations import PackedSFTTrainer, apply_packed_loss, tiny_causal_lm  # noqa: E402

from integration_utils import (  # noqa: E402
    IGNORE,
    SFT_LENGTHS,
    SFT_ROW_LENGTH,
    assert_loss_close,
    flat_relative_error,
    parameter_updates,
    per_conversation_sgd_step,
    prepared_conversations,
    relative_error,
    sft_args,
    sft_tokenizer,
    sgd,
    snapshot,
    synthetic_conversations,
)

# Parameters after the step within 1e-5 (the contract), and the update of all parameters
# together within 1e-5: float32 sums over the same tokens in another order. Single small tensors
# (the norm weights, whose gradients cancel over tokens) reach ~1e-4 and are printed, not held
# to 1e-5.
PARAM_RTOL = 1e-5
UPDATE_RTOL = 1e-5

# trl batch layouts, each with the rows of the whole data set: 8 conversations unpacked, or the
# 4 full rows best-fit-decreasing packs them into.
LAYOUTS = {
    "padding_free": (dict(padding_free=True, max_length=None), len(SFT_LENGTHS)),
    "packing": (dict(packing=True, max_length=SFT_ROW_LENGTH), 4),
}


def synthetic_dataset(vocab_size: int) -> Dataset:
    """Pre-tokenized conversations (``input_ids``, ``labels``): trl uses them as they are."""
    return Dataset.from_list(synthetic_conversations(SFT_LENGTHS, vocab_size, seed=3))


def truth(conversations: list[dict], vocab_size: int):
    """Parameters, loss and trl's token metrics of unpacked per-conversation training.

    The metrics are computed independently of the code under test: the entropy of
    ``torch.distributions.Categorical`` and ``argmax`` of each conversation's own logits.
    """
    model = tiny_causal_lm(vocab_size)
    entropy, correct, targets = 0.0, 0, 0
    with torch.no_grad():
        for conversation in conversations:
            logits = model(input_ids=torch.tensor([conversation["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(conversation["labels"][1:])
            mask = labels != IGNORE
            entropy += float(torch.distributions.Categorical(logits=logits[mask]).entropy().sum())
            correct += int((logits[mask].argmax(-1) == labels[mask]).sum())
            targets += int(mask.sum())
    loss = per_conversation_sgd_step(model, conversations)
    params = snapshot(model)
    return params, loss, entropy / targets, correct / targets


def train(trainer_class, model, dataset, tmp_path, **fields):
    trainer = trainer_class(
        model=model,
        args=sft_args(tmp_path, **fields),
        train_dataset=dataset,
        processing_class=sft_tokenizer(),
        optimizers=sgd(model),
    )
    initial = snapshot(model)
    trainer.train()
    return trainer, initial


def check_step(trainer, model, initial, vocab_size, *, accumulation):
    """Parameters, logged loss and metrics of the trained step against :func:`truth`."""
    conversations = prepared_conversations(trainer.train_dataset)
    params, loss, entropy, accuracy = truth(conversations, vocab_size)
    expected_updates = {name: params[name] - initial[name] for name in params}
    updates = parameter_updates(model, initial)
    worst_param = max(relative_error(p.detach(), params[n]) for n, p in model.named_parameters())
    assert worst_param <= PARAM_RTOL, f"parameters off by {worst_param:.2e}"
    flat = flat_relative_error(updates, expected_updates)
    assert flat <= UPDATE_RTOL, f"parameter update off by {flat:.2e}"
    worst = max(relative_error(updates[n], expected_updates[n]) for n in expected_updates)
    print(f"parameters {worst_param:.1e}, update {flat:.1e} (worst single tensor {worst:.1e})")

    logs = trainer.state.log_history[0]
    assert_loss_close(torch.tensor(logs["loss"]), loss)
    assert logs["num_tokens"] == sum(len(c["input_ids"]) for c in conversations)
    assert 0.0 < logs["entropy"] <= math.log(vocab_size)
    assert 0.0 <= logs["mean_token_accuracy"] <= 1.0
    if accumulation == 1:
        # one micro-batch: trl's metric (a mean of micro-batch token means) is the token mean
        assert logs["entropy"] == pytest.approx(entropy, rel=1e-5)
        assert logs["mean_token_accuracy"] == pytest.approx(accuracy, abs=1e-9)
    return flat


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_sft_trainer_matches_per_conversation_training(
    layout, accumulation, fused, tmp_path
):
    tokenizer = sft_tokenizer()
    vocab_size = len(tokenizer)
    fields, rows = LAYOUTS[layout]
    model = tiny_causal_lm(vocab_size)
    if not fused:
        apply_packed_loss(model, fused_linear=False)  # the user's choice is kept
    trainer, initial = train(
        PackedSFTTrainer,
        model,
        synthetic_dataset(vocab_size),
        tmp_path,
        per_device_train_batch_size=rows // accumulation,
        gradient_accumulation_steps=accumulation,
        **fields,
    )
    assert trainer.train_dataset.num_rows == rows
    # by default the trainer installs the fused loss: no (N, V) logits in training
    assert (model._packed_ce.fused_options is not None) == fused
    check_step(trainer, model, initial, vocab_size, accumulation=accumulation)


@pytest.mark.parametrize(
    "kind",
    [
        # messages through trl's chat template, loss on the assistant turns only
        "conversational-assistant_only_loss",
        # pre-tokenized prompt + completion, loss on the completion only
        "prompt_completion-completion_only_loss",
    ],
)
def test_packed_sft_trainer_on_trl_masked_data(kind, tmp_path):
    tokenizer = sft_tokenizer()
    vocab_size = len(tokenizer)
    if kind.startswith("conversational"):
        import collators

        dataset = collators.load_default_dataset().select(range(8))
        fields = dict(assistant_only_loss=True)
    else:
        rows = synthetic_conversations(SFT_LENGTHS, vocab_size, seed=4)
        gen = torch.Generator().manual_seed(4)
        prompts = [int(torch.randint(1, len(r["input_ids"]), (1,), generator=gen)) for r in rows]
        dataset = Dataset.from_list(
            [
                {"input_ids": r["input_ids"], "completion_mask": [0] * p + [1] * (len(r["input_ids"]) - p)}
                for r, p in zip(rows, prompts)
            ]
        )
        fields = dict(completion_only_loss=True)
    model = tiny_causal_lm(vocab_size)
    trainer, initial = train(
        PackedSFTTrainer,
        model,
        dataset,
        tmp_path,
        padding_free=True,
        max_length=None,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        **fields,
    )
    # trl masked the labels: some tokens of every conversation are not trained
    conversations = prepared_conversations(trainer.train_dataset)
    assert all(IGNORE in c["labels"][1:] for c in conversations)
    check_step(trainer, model, initial, vocab_size, accumulation=2)


def test_stock_sft_trainer_trains_another_objective(tmp_path):
    """trl's token mean: the same data, a measurably different step."""
    from trl import SFTTrainer

    tokenizer = sft_tokenizer()
    vocab_size = len(tokenizer)
    model = tiny_causal_lm(vocab_size)
    trainer, initial = train(
        SFTTrainer,
        model,
        synthetic_dataset(vocab_size),
        tmp_path,
        padding_free=True,
        max_length=None,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
    )
    params, *_ = truth(prepared_conversations(trainer.train_dataset), vocab_size)
    error = flat_relative_error(
        parameter_updates(model, initial), {n: params[n] - initial[n] for n in params}
    )
    print(f"stock SFTTrainer: parameter update off by {error:.1%}")
    assert error > 0.01


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(loss_type="dft"), "loss_type"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor"),
        (dict(packing=True, packing_strategy="wrapped"), "packing_strategy"),
    ],
    ids=["dft", "label_smoothing", "wrapped"],
)
def test_packed_sft_trainer_refuses_inexact_options(fields, name, tmp_path):
    vocab_size = len(sft_tokenizer())
    fields = {"max_length": SFT_ROW_LENGTH, **fields}
    if not fields.get("packing"):
        fields["padding_free"] = True
        fields["max_length"] = None
    with pytest.raises(ValueError, match=name):
        train(PackedSFTTrainer, tiny_causal_lm(vocab_size), synthetic_dataset(vocab_size),
              tmp_path, **fields)


def test_packed_sft_trainer_refuses_compute_loss_func(tmp_path):
    vocab_size = len(sft_tokenizer())
    model = tiny_causal_lm(vocab_size)
    with pytest.raises(ValueError, match="compute_loss_func"):
        PackedSFTTrainer(
            model=model,
            args=sft_args(tmp_path, padding_free=True, max_length=None),
            train_dataset=synthetic_dataset(vocab_size),
            processing_class=sft_tokenizer(),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.loss,
        )


def test_packed_sft_trainer_takes_training_arguments_as_trl_does(tmp_path):
    """``args=TrainingArguments(...)``: converted to an ``SFTConfig`` as stock trl converts it (the
    same fields, the hub token kept) before any option is read, and the step is the
    per-conversation mean."""
    from transformers import TrainingArguments
    from trl import SFTConfig, SFTTrainer

    tokenizer = sft_tokenizer()
    vocab_size = len(tokenizer)
    plain = sft_args(tmp_path, per_device_train_batch_size=len(SFT_LENGTHS)).to_dict()
    fields = {k: v for k, v in plain.items() if k in TrainingArguments.__dataclass_fields__}
    arguments = TrainingArguments(**{**fields, "hub_token": "token"})
    model = tiny_causal_lm(vocab_size)
    trainer = PackedSFTTrainer(
        model=model, args=arguments, train_dataset=synthetic_dataset(vocab_size),
        processing_class=tokenizer, optimizers=sgd(model),
    )
    stock = SFTTrainer(model=tiny_causal_lm(vocab_size), args=arguments,
                       train_dataset=synthetic_dataset(vocab_size), processing_class=tokenizer)
    assert type(trainer.args) is SFTConfig
    assert trainer.args.to_dict() == stock.args.to_dict()
    assert trainer.args.hub_token == stock.args.hub_token == "token"
    initial = snapshot(model)
    trainer.train()
    check_step(trainer, model, initial, vocab_size, accumulation=1)


def test_packed_sft_trainer_without_args_as_trl(tmp_path, monkeypatch):
    """``args=None``: trl's default ``SFTConfig("<model name>-SFT")``, equal to stock trl's. Its
    default ``bf16=True`` wants a GPU, stood in for here (nothing is trained)."""
    from transformers import training_args
    from trl import SFTConfig, SFTTrainer

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)
    tokenizer = sft_tokenizer()
    vocab_size = len(tokenizer)
    trainers = []
    for trainer_class in (PackedSFTTrainer, SFTTrainer):
        model = tiny_causal_lm(vocab_size)
        model.config._name_or_path = "org/tiny-model"
        trainers.append(trainer_class(model=model, train_dataset=synthetic_dataset(vocab_size),
                                      processing_class=tokenizer))
    packed, stock = trainers
    assert type(packed.args) is SFTConfig and packed.args.output_dir == "tiny-model-SFT"
    assert packed.args.to_dict() == stock.args.to_dict()


def test_packed_sft_trainer_refuses_an_inexact_option_of_training_arguments(tmp_path):
    """An option of a plain ``TrainingArguments`` is read after the conversion: refused by name."""
    from transformers import TrainingArguments

    vocab_size = len(sft_tokenizer())
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        PackedSFTTrainer(
            model=tiny_causal_lm(vocab_size),
            args=TrainingArguments(str(tmp_path), use_cpu=True, label_smoothing_factor=0.1, report_to=[]),
            train_dataset=synthetic_dataset(vocab_size), processing_class=sft_tokenizer(),
        )
