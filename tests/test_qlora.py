"""QLoRA: ``PackedSFTTrainer(peft_config=...)`` on a 4-bit base model (bitsandbytes nf4, bf16
compute) trains on the per-conversation mean, through the fused head where the head is not
quantized.

The base model is a tiny Llama built from its config, saved and loaded back with a
``BitsAndBytesConfig``, as ``from_pretrained(..., quantization_config=...)`` loads a released
one: every linear layer of the decoder becomes a ``bnb.nn.Linear4bit``, the output embedding
stays an ``nn.Linear`` in bf16. The reference runs the same quantized model and adapter, in the
trainer's autocast, on each conversation alone and averages transformers' own loss over the
conversations.

Tolerance: ``BF16_RTOL`` = 5e-3, relative. Both sides compute in bf16 (8 significant bits, a
rounding of 2**-9 = 2e-3 relative per value): a packed row and a conversation alone round their
activations at different shapes (sdpa over one block-diagonal row or one short causal one), and
the fused head accumulates its logits in float32 where the reference's head rounds them to bf16.
On the CPU the two differ by 1.5e-4. The test also asserts that the token mean of the same step
is more than ``SEPARATION`` times the tolerance away (4e-2 here: weights of standard deviation
0.2 make the per-token losses uneven), so that a trainer on the wrong objective cannot pass. The
adapter's gradients of the step (bf16 parameters, as trl keeps a quantized model's adapter) are
each compared with a float32 run of the same 4-bit weights: within twice the bf16 reference's own
error plus ``BF16_GRAD_SLACK`` = 1e-2, norm-wise. Measured: 2.8e-2 against 2.9e-2 (CPU), 3.6e-2
against 3.5e-2 (H100). Compared with the bf16 reference directly, the attention's q/k adapter
gradients differed by 17% on an H100 (2-3e-2 on a CPU) while the trainer's kept within that
bound of float32; a gradient path that is lost gives an error of order 1.

Runs on CPU where bitsandbytes is installed (its CPU kernels) and, marked ``cuda``, on a GPU.
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("trl")
pytest.importorskip("peft")
Dataset = pytest.importorskip("datasets").Dataset

from transformers import TrainerCallback  # noqa: E402

from packed_ce.integrations import PackedSFTTrainer, fusable_reason, tiny_causal_lm  # noqa: E402

from integration_utils import (  # noqa: E402
    SFT_LENGTHS,
    assert_gradients_close,
    has_target,
    one_at_a_time,
    relative_error,
    sft_args,
    synthetic_conversations,
    tiny_tokenizer,
)

VOCAB = 256
BF16_RTOL = 5e-3
BF16_GRAD_SLACK = 1e-2
SEPARATION = 3.0
# hidden and intermediate sizes multiples of nf4's block of 64 values; initializer_range 0.2 (std
# of every weight) spreads the per-token losses, so that the two means of a batch differ
FIELDS = dict(hidden_size=128, intermediate_size=256, initializer_range=0.2)

DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


def quantized_model(device: str, folder, quantized_head: bool = False):
    """The tiny Llama of ``FIELDS`` saved and loaded back in 4 bits (nf4, bf16 compute); the
    head too with ``quantized_head`` (bitsandbytes leaves it alone unless told otherwise)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if not (folder / "config.json").exists():  # the first call saves, later calls load it again
        tiny_causal_lm(VOCAB, **FIELDS).save_pretrained(folder)
    skip = {"llm_int8_skip_modules": []} if quantized_head else {}  # [] leaves out nothing
    quantization = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
        **skip,
    )
    return AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=quantization, dtype=torch.bfloat16, device_map={"": device}
    )


def lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: B random too, so that the adapter changes the first step's loss
    return LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                      init_lora_weights=False)  # fmt: skip


class FirstStepGradients(TrainerCallback):
    """The trainable parameters' gradients of the first optimiser step, as the optimiser gets
    them (float32 copies)."""

    grads: dict | None = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self.grads is None:
            self.grads = {
                name: p.grad.detach().float().clone()
                for name, p in model.named_parameters()
                if p.requires_grad
            }


def float32_gradients(device: str, folder, quantized_head: bool, adapter: dict, conversations) -> dict:
    """The adapter's gradients of the per-conversation mean in float32: the saved model loaded
    again in 4 bits (the same nf4 weights), the adapter set to ``adapter``, the 4-bit layers
    computing in float32 and every other parameter cast to float32, no autocast. (Not a
    ``copy.deepcopy`` of the trained model: a forward wrapper the trainer installs keeps the
    original model's bound method, so the copy's loss would run the original's adapter.)"""
    from peft import get_peft_model

    exact = get_peft_model(quantized_model(device, folder, quantized_head), lora_config())
    missing = exact.load_state_dict({n: t.float() for n, t in adapter.items()}, strict=False)
    assert not missing.unexpected_keys and not any("lora_" in n for n in missing.missing_keys)
    for module in exact.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.compute_dtype = torch.float32
    exact.float()  # the 4-bit weights are integers: float() leaves them
    exact.train()
    one_at_a_time(exact, conversations).backward()
    return {n: p.grad.float() for n, p in exact.named_parameters() if p.requires_grad}


def token_mean(model, conversations: list[dict]) -> torch.Tensor:
    """The token mean over every target of ``conversations`` (each run alone): the objective the
    packed trainer must not give."""
    import torch.nn.functional as F

    device = next(model.parameters()).device
    total, count = 0.0, 0
    for conversation in filter(has_target, conversations):
        logits = model(input_ids=torch.tensor([conversation["input_ids"]], device=device)).logits
        labels = torch.tensor(conversation["labels"][1:], device=device)
        total += F.cross_entropy(logits[0, :-1].float(), labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
    return total / count


@pytest.mark.parametrize("quantized_head", [False, True], ids=["bf16-head", "4bit-head"])
@pytest.mark.parametrize("device", DEVICES)
def test_qlora_first_step_is_the_per_conversation_mean(device, quantized_head, tmp_path):
    """The bf16 head is fused (``fusable_reason`` None); a 4-bit head is no ``nn.Linear``, so
    the loss runs on the logits, with the same objective."""
    model = quantized_model(device, tmp_path / "base", quantized_head)
    decoder_linear = model.model.layers[0].self_attn.q_proj
    assert isinstance(decoder_linear, bnb.nn.Linear4bit), type(decoder_linear)
    head = model.get_output_embeddings()
    if quantized_head:
        assert isinstance(head, bnb.nn.Linear4bit)
        assert "nn.Linear, got Linear4bit" in fusable_reason(model)
    else:
        assert type(head) is torch.nn.Linear
        assert fusable_reason(model) is None  # the head is not quantized: the fused loss serves

    conversations = synthetic_conversations(SFT_LENGTHS, VOCAB, seed=3)  # each has a target
    trainer = PackedSFTTrainer(
        model=model,
        args=sft_args(
            tmp_path / "out", padding_free=True, max_length=None, bf16=True,
            use_cpu=device == "cpu", per_device_train_batch_size=len(conversations) // 2,
            gradient_accumulation_steps=2, optim="sgd",
        ),  # fmt: skip
        train_dataset=Dataset.from_list(conversations),
        processing_class=tiny_tokenizer(VOCAB),
        peft_config=lora_config(),
    )
    trained = trainer.model
    fused = trained.get_base_model()._packed_ce.fused_options is not None
    assert fused == (not quantized_head)
    adapter = {n: p.detach().clone() for n, p in trained.named_parameters() if p.requires_grad}
    assert adapter and all("lora_" in name for name in adapter)

    # in training mode, as the trainer runs it (on a CPU, bitsandbytes repacks a 4-bit weight for
    # its inference kernel on the first no-grad call in eval mode, which has no backward)
    trained.train()
    exact = float32_gradients(device, tmp_path / "base", quantized_head, adapter, conversations)
    with trainer.accelerator.autocast():  # the trainer's bf16 autocast
        expected = one_at_a_time(trained, conversations)
        expected.backward()
        with torch.no_grad():
            other = token_mean(trained, conversations)
    expected_grads = {n: p.grad.float() for n, p in trained.named_parameters() if p.requires_grad}
    trained.zero_grad(set_to_none=True)
    step_grads = FirstStepGradients()
    trainer.add_callback(step_grads)
    trainer.train()
    logged = torch.tensor(trainer.state.log_history[0]["loss"])

    expected, other = expected.detach().float().cpu(), other.cpu()
    error = relative_error(logged, expected)
    separation = relative_error(other, expected)
    # each adapter gradient against float32: the trainer's error within twice the bf16
    # reference's own, plus BF16_GRAD_SLACK
    errors = {n: (relative_error(step_grads.grads[n], g), relative_error(expected_grads[n], g))
              for n, g in exact.items()}  # fmt: skip
    name = max(errors, key=lambda n: errors[n][0] - 2 * errors[n][1])
    worst = errors[name]
    print(f"{device}, {'4-bit' if quantized_head else 'bf16'} head: first-step loss "
          f"{logged.item():.5f}, per-conversation mean {expected.item():.5f} (relative "
          f"{error:.1e}), token mean {other.item():.5f} (relative {separation:.1e}); worst "
          f"adapter gradient against float32 {worst[0]:.1e}, the bf16 reference's "
          f"{worst[1]:.1e} ({name})")  # fmt: skip
    assert error <= BF16_RTOL
    assert separation > SEPARATION * BF16_RTOL  # the check tells the two objectives apart
    assert worst[0] <= 2 * worst[1] + BF16_GRAD_SLACK, (name, worst)
    # the step trained the adapter
    moved = [n for n, p in trained.named_parameters() if p.requires_grad and not torch.equal(p, adapter[n])]
    assert moved == list(adapter)
