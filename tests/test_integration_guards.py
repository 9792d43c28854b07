"""No silent wrong set-up: each way of running the packed loss on another objective is refused,
and a packed batch stays exact whatever the model call.

- a model with the packed loss under the stock ``Trainer`` (a token-count normaliser) and under
  trl's ``SFTTrainer`` (its fused head never calls the loss): ValueError naming the trainer to
  use; a class mixing ``PackedTrainer`` with ``SFTTrainer`` trains the packed mean;
- each guard on its own, on the installed trl (a guard that goes quiet on a new release is a
  silent wrong objective): the trainers' callback, trl's fused LM head past it (on a plain and a
  PEFT model), trl's ``fused_lm_head`` keyword reaching the installed forward; every private
  trl / transformers name the trainers rely on (``integrations/seams.py``) still exists, the
  ``trl`` extra pins the tested range and an untested trl warns; no stack-frame inspection;
- a packed batch with the model's default ``use_cache=True``, an explicit ``use_cache=True`` or
  an all-ones ``attention_mask``: the loss of every conversation alone (the same calls without
  the packed loss's pre-hook let conversations attend to each other, shown by the test);
- a packed batch with an ``attention_mask`` that masks tokens, or with ``past_key_values``:
  ValueError.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

import packed_ce
from collators import PackedCollator
from packed_ce.integrations import PackedTrainer, apply_packed_loss, remove_packed_loss

from integration_utils import (
    assert_loss_close,
    one_at_a_time,
    relative_error,
    synthetic_conversations,
    tiny_model,
)

VOCAB = 96
LENGTHS = [9, 14, 5, 11]  # one packed row of four conversations


def conversations():
    return synthetic_conversations(LENGTHS, VOCAB, seed=5)


def packed_batch() -> dict:
    return PackedCollator()([{**c, "seq_lengths": [len(c["input_ids"])]} for c in conversations()])


def training_args(tmp_path, **overrides):
    fields = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return TrainingArguments(**{**fields, **overrides})


@pytest.mark.parametrize("accumulation", [1, 2])
def test_stock_trainer_with_the_packed_loss_is_refused(accumulation, tmp_path):
    model = apply_packed_loss(tiny_model("llama", VOCAB))
    trainer = Trainer(
        model=model,
        args=training_args(tmp_path, gradient_accumulation_steps=accumulation),
        train_dataset=conversations(),
        data_collator=PackedCollator(),
    )
    with pytest.raises(ValueError, match="use packed_ce.integrations.PackedTrainer"):
        trainer.train()


def sft_trainer(trainer_class, model, tmp_path, batch_size=2):
    from datasets import Dataset

    from integration_utils import sft_args, sft_tokenizer

    return trainer_class(
        model=model,
        args=sft_args(tmp_path, padding_free=True, max_length=None,
                      per_device_train_batch_size=batch_size),
        train_dataset=Dataset.from_list(synthetic_conversations(LENGTHS, 3072, seed=5)),
        processing_class=sft_tokenizer(),
    )


def test_stock_sft_trainer_with_the_packed_loss_is_refused(tmp_path):
    trl = pytest.importorskip("trl")
    model = apply_packed_loss(tiny_model("llama", 3072))
    trainer = sft_trainer(trl.SFTTrainer, model, tmp_path)
    with pytest.raises(ValueError, match="PackedSFTTrainer instead of trl.SFTTrainer"):
        trainer.train()


@pytest.mark.parametrize("wrapper", ["plain", "peft"])
def test_trl_fused_lm_head_past_the_trainer_guard_is_refused(wrapper, tmp_path):
    """Without the callback that refuses stock trainers, trl's fused LM head (a wrapper of the
    installed forward that runs the decoder and trl's token mean) is refused by the decoder's
    pre-hook: on the model itself and inside a PEFT adapter, which calls ``forward`` directly."""
    trl = pytest.importorskip("trl")
    from packed_ce.integrations.model.installation import base_model
    from packed_ce.integrations.model.other_trainers import RefuseOtherTrainers

    model = apply_packed_loss(tiny_model("llama", 3072))
    if wrapper == "peft":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer = sft_trainer(trl.SFTTrainer, model, tmp_path)
    trainer.remove_callback(RefuseOtherTrainers)
    with pytest.raises(ValueError, match="runs its decoder and computes its own token mean"):
        trainer.train()
    decoder = base_model(model).get_decoder()
    assert decoder.training
    with torch.no_grad():  # a pass without gradients trains nothing: it runs
        decoder(input_ids=torch.tensor([[1, 2, 3]]))


def test_trl_fused_lm_head_keyword_is_refused(tmp_path):
    """The packed loss installed after trl's fused head: trl's ``fused_lm_head=True`` reaches the
    installed forward first and is refused there."""
    trl = pytest.importorskip("trl")
    from packed_ce.integrations.model.other_trainers import RefuseOtherTrainers

    model = tiny_model("llama", 3072)
    trainer = sft_trainer(trl.SFTTrainer, model, tmp_path)
    apply_packed_loss(model)
    trainer.remove_callback(RefuseOtherTrainers)
    with pytest.raises(ValueError, match="fused_lm_head=True computes trl's own token mean"):
        trainer.train()


def test_private_seams_exist_in_the_installed_versions(tmp_path):
    """Every private name of another library listed in ``seams.py`` is still there, and each
    method takes the parameters listed: an override of a method trl no longer calls, or calls with
    other arguments, would silently do nothing."""
    import importlib
    import inspect

    trl = pytest.importorskip("trl")
    from datasets import Dataset

    from packed_ce.integrations import PackedSFTTrainer
    from packed_ce.integrations.trainers.seams import PRIVATE_SEAMS

    trainer = sft_trainer(PackedSFTTrainer, tiny_model("llama", 3072), tmp_path)
    assert isinstance(trainer, trl.SFTTrainer)
    model = tiny_model("llama", 64)
    model.loss_function = model.loss_function  # the property's setter stores the instance's own
    from accelerate import Accelerator
    from accelerate.data_loader import BatchSamplerShard
    from torch.nn.attention.flex_attention import create_block_mask

    # accelerate's mark lives on the model it prepared (in evaluation mode, as evaluate() does)
    prepared = Accelerator(cpu=True).prepare_model(torch.nn.Linear(1, 1), evaluation_mode=True)
    sampler = BatchSamplerShard(torch.utils.data.BatchSampler(range(4), 2, False), 2, 0)
    block_mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 4, 4, device="cpu", _compile=False)
    checkpointed = tiny_model("llama", 64)
    checkpointed.gradient_checkpointing_enable()
    instances = {"SFTTrainer": trainer, "Trainer": trainer, "PreTrainedModel": model,
                 "GradientCheckpointingLayer": checkpointed.model.layers[0],
                 "PretrainedConfig": model.config, "Dataset": Dataset.from_dict({"a": [1]}),
                 "Accelerator": prepared, "BatchSamplerShard": sampler, "BlockMask": block_mask}  # fmt: skip
    for seam in PRIVATE_SEAMS:
        module, _, attribute = seam.owner.rpartition(".")
        owner = getattr(importlib.import_module(module), attribute)
        # a method or class field on the owner, or an attribute an instance of it holds
        found = hasattr(owner, seam.name) or seam.name in vars(instances.get(attribute, owner))
        assert found, f"{seam.owner}.{seam.name} is gone from the installed version ({seam.why})"
        if seam.parameters is not None:
            parameters = list(inspect.signature(getattr(owner, seam.name)).parameters)
            assert parameters == ["self", *seam.parameters], (seam.owner, seam.name, parameters)


def test_global_changes_are_the_ledgers(one_rank_group):
    """apply_packed_loss and remove_packed_loss, enable_context_parallel and its undoing change
    nothing process-wide beyond seams.GLOBAL_STATE: the Trainer's default callbacks gain
    RefuseOtherTrainers once, the attention interface nothing on one rank, the model is as before."""
    from transformers import AttentionInterface, trainer

    from packed_ce.integrations import disable_context_parallel, enable_context_parallel
    from packed_ce.integrations.model.other_trainers import RefuseOtherTrainers
    from packed_ce.integrations.trainers.seams import GLOBAL_STATE

    assert {where for where, *_ in GLOBAL_STATE} >= {"transformers.trainer.DEFAULT_CALLBACKS"}
    model = tiny_model("llama", 64)
    before = dict(vars(model))
    attention = set(AttentionInterface._global_mapping)
    disable_context_parallel(enable_context_parallel(apply_packed_loss(model)))
    remove_packed_loss(model)
    assert vars(model).keys() == before.keys() and model.config._attn_implementation == "sdpa"
    assert set(AttentionInterface._global_mapping) == attention
    assert trainer.DEFAULT_CALLBACKS.count(RefuseOtherTrainers) == 1


def test_trl_extra_pins_the_tested_range():
    import tomllib
    from pathlib import Path

    from packaging.specifiers import SpecifierSet

    trl = pytest.importorskip("trl")
    from packed_ce.integrations.trainers.seams import TRL_TESTED

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert f"trl{TRL_TESTED}" in pyproject["project"]["optional-dependencies"]["trl"]
    # a new trl: check every place in seams.py against it, then widen TRL_TESTED
    assert SpecifierSet(TRL_TESTED).contains(trl.__version__, prereleases=True), trl.__version__


@pytest.mark.parametrize("version", ["installed", "1.17.0", "1.15.2"])
def test_untested_trl_warns_once_at_construction(version, tmp_path, monkeypatch):
    import warnings

    trl = pytest.importorskip("trl")
    from packed_ce.integrations import PackedSFTTrainer

    if version != "installed":
        monkeypatch.setattr(trl, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sft_trainer(PackedSFTTrainer, tiny_model("llama", 3072), tmp_path)
    untested = [w for w in caught if "is tested with trl" in str(w.message)]
    if version == "installed":
        assert not untested
    else:
        assert len(untested) == 1
        assert f"trl>=1.16,<1.17 (pip install 'packed-ce[trl]'), this is trl {version}" in str(
            untested[0].message
        )


def test_no_stack_frame_inspection_in_the_library():
    """The seams decide from what a call carries, never from a caller's frame."""
    from pathlib import Path

    root = Path(__file__).parents[1]
    words = ("_getframe", "inspect.stack", "inspect.currentframe", "f_back", "f_locals")
    found = [
        f"{path.relative_to(root)}: {word}"
        for folder in ("packed_ce", "collators")
        for path in sorted((root / folder).rglob("*.py"))
        for word in words
        if word in path.read_text()
    ]
    assert not found


def test_packed_trainer_mixed_with_sft_trainer_trains_the_packed_mean(tmp_path):
    """The MRO runs PackedTrainer.compute_loss: the packed loss, never trl's fused token mean."""
    trl = pytest.importorskip("trl")

    class Mixed(PackedTrainer, trl.SFTTrainer):
        pass

    model = apply_packed_loss(tiny_model("llama", 3072))
    with torch.no_grad():
        expected = one_at_a_time(tiny_model("llama", 3072), synthetic_conversations(LENGTHS, 3072, seed=5))
    trainer = sft_trainer(Mixed, model, tmp_path, batch_size=len(LENGTHS))
    trainer.train()
    assert_loss_close(torch.tensor(trainer.state.log_history[0]["loss"]), expected)


# How a packed batch can reach the model with attention across conversations.
CALLS = {
    "config-use_cache": {},  # every released config has use_cache=True
    "use_cache=True": {"use_cache": True},
    "all-ones-attention_mask": {"attention_mask": "ones"},
}


@pytest.mark.parametrize("boundaries", ["cu_seqlens", "position_ids"])
@pytest.mark.parametrize("call", list(CALLS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_batch_is_exact_whatever_the_call(arch, attn, call, boundaries):
    model = tiny_model(arch, VOCAB, attn=attn)
    assert model.config.use_cache
    batch = packed_batch()
    if boundaries == "position_ids":  # trl's padding-free layout without cu_seqlens
        batch = {k: batch[k] for k in ("input_ids", "labels", "position_ids")}
    extra = dict(CALLS[call])
    if extra.get("attention_mask") == "ones":
        extra["attention_mask"] = torch.ones_like(batch["input_ids"])
    with torch.no_grad():
        expected = one_at_a_time(model, conversations())
        # without the pre-hook: the packed loss on the logits of the same call attends across
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}, **extra).logits
        crossed = packed_ce.cross_entropy(
            logits, batch["labels"], position_ids=batch["position_ids"], is_packed=True, shift=True
        )
        apply_packed_loss(model)
        loss = model(**batch, **extra).loss
        remove_packed_loss(model)
    assert_loss_close(loss, expected)
    assert relative_error(crossed, expected) > 1e-4  # the hazard is real in this set-up


def test_packed_batch_with_a_masking_attention_mask_is_refused():
    model = apply_packed_loss(tiny_model("llama", VOCAB))
    batch = packed_batch()
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(**batch, attention_mask=mask)


def test_packed_batch_with_past_key_values_is_refused():
    from transformers import DynamicCache

    model = apply_packed_loss(tiny_model("llama", VOCAB))
    with pytest.raises(ValueError, match="past_key_values"):
        model(**packed_batch(), past_key_values=DynamicCache(config=model.config))


def test_padded_batch_keeps_its_attention_mask():
    """One conversation per row (boundaries at row starts): the mask is needed and kept."""
    from collators import PaddedCollator

    model = apply_packed_loss(tiny_model("llama", VOCAB))
    with torch.no_grad():
        loss = model(**PaddedCollator()(conversations())).loss
        assert_loss_close(loss, one_at_a_time(model, conversations()))


@pytest.mark.parametrize("key", ["cu_seqlens", "cu_seq_lens_q", "position_ids", "seq_targets", "seq_weights"])
def test_per_batch_values_that_are_not_tensors_are_refused_by_name(key):
    """A list where the loss reads a tensor: TypeError naming the key, from the patched model's
    call and from the loss and the counter reading a batch, instead of an AttributeError deep
    inside. Each is type-checked once on its way: where the model's forward reads it first
    (``cu_seq_lens_q``, ``position_ids``), else where the loss checks its arguments."""
    from packed_ce.integrations import PackedCausalLMLoss, count_num_items

    model = apply_packed_loss(tiny_model("llama", VOCAB))
    batch = packed_batch()
    batch[key] = batch[key].tolist() if key in batch else [1.0] * (batch["cu_seqlens"].numel() - 1)
    with pytest.raises(TypeError, match=f"^{key} must be a torch.Tensor, got list"):
        model(**batch)
    if key in ("seq_targets", "seq_weights", "cu_seqlens"):
        readers = batch  # read after cu_seqlens, which is a tensor unless it is the key
    else:  # read where the batch has no cu_seqlens
        readers = {k: v for k, v in batch.items() if k != "cu_seqlens"}
        if key == "position_ids":
            readers.pop("cu_seq_lens_q")
    argument = "cu_seqlens" if key == "cu_seq_lens_q" else key  # the loss's argument it is read as
    logits = torch.zeros(*batch["labels"].shape, VOCAB)
    keywords = {k: v for k, v in readers.items() if k != "labels"}
    with pytest.raises(TypeError, match=f"^{argument} must be a torch.Tensor, got list"):
        PackedCausalLMLoss()(logits, batch["labels"], **keywords)
    with pytest.raises(TypeError, match=f"^{argument} must be a torch.Tensor, got list"):
        count_num_items(readers)


@pytest.mark.parametrize("without", [(), ("cu_seqlens",), ("cu_seqlens", "cu_seq_lens_q")],
                         ids=["cu_seqlens", "cu_seq_lens_q", "position_ids"])
def test_each_per_call_tensor_is_type_checked_once(without, monkeypatch):
    """A model call of a packed batch type-checks each per-call tensor once on its way to the
    loss: the guard checks what the model's forward reads first and hands it on, the loss checks
    what it reads from elsewhere (counted by object over both type checks; the collator's
    ``cu_seq_lens_q`` is its ``cu_seqlens``, a copy here tells the two keys apart)."""
    from packed_ce import validation
    from packed_ce.integrations.model import guards

    checked = []

    def spy(function, value_at):
        def wrapper(*args, **kwargs):
            checked.append(value_at(*args))
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(guards, "batch_tensor", spy(guards.batch_tensor, lambda batch, key: batch.get(key)))
    monkeypatch.setattr(validation, "check_tensor", spy(validation.check_tensor, lambda name, value, **_: value))
    model = apply_packed_loss(tiny_model("llama", VOCAB))
    batch = {k: v for k, v in packed_batch().items() if k not in without}
    if "cu_seq_lens_q" in batch:
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_q"].clone()
    with torch.no_grad():
        loss = model(**batch).loss
    assert_loss_close(loss, one_at_a_time(model, conversations()))
    boundary = next(batch[key] for key in ("cu_seqlens", "cu_seq_lens_q", "position_ids") if key in batch)
    per_call = [value for value in checked if value is not None and value is not batch["labels"]]
    assert any(value is boundary for value in per_call)  # the loss's boundaries were checked
    assert len({id(value) for value in per_call}) == len(per_call), [type(v) for v in per_call]
