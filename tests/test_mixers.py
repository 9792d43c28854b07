"""Hybrid families (convolutions, gated delta rules, state-space scans, linear attention) exact
packed, in every batch format, under gradient checkpointing, copied, and under context parallelism.

The families' own packed calls on CPU leak or are refused by transformers (its kernels missing);
with ``apply_packed_loss`` each token mixer runs per conversation (``families.MIXERS``). Each
case's loss and every parameter gradient must be every conversation alone (``one_at_a_time``),
float32. The batch formats are the ones users bring: ``PackedCollator``'s (``cu_seqlens`` and the
varlen keywords), ``position_ids`` only (transformers' ``DataCollatorWithFlattening``), trl's
padding-free batch (``seq_idx`` too), and two packed rows in one batch. Under context parallelism
two and three gloo ranks' shares add up to one process's (Qwen3.5's gated delta net passing its
state between the ranks, context_parallel/state.py; the other mixers gathering the row).
"""

from __future__ import annotations

import copy
import functools
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from collators import PackedCollator, shard_batch
from packed_ce.integrations import (
    apply_packed_loss,
    count_num_items,
    enable_context_parallel,
    remove_packed_loss,
)
from packed_ce.integrations.model.mixers import PerConversation, mixers_of

from family_models import VOCAB, tiny_family_model
from integration_utils import (
    assert_gradients_close,
    assert_loss_close,
    flat_relative_error,
    gradients,
    loss_and_gradients,
    one_at_a_time,
    rendezvous,
    spawn_ranks,
    start_rank,
    synthetic_conversations,
)

# one family of each kind of mixer: gated delta rule (conv + rule), Mamba 2, short convolution,
# Kimi delta attention (its kernel takes no boundary), Mamba 1 in a layer that calls it without
# keywords (the decoder layer's call gives the boundaries), lightning attention (position
# embeddings and a mask beside the hidden states)
FAMILIES = ["qwen3_5_text", "nemotron_h", "lfm2", "kimi_linear", "jamba", "minimax"]
LENGTHS = [9, 14, 5, 11]


def conversations() -> list[dict]:
    return synthetic_conversations(LENGTHS, VOCAB, seed=5)


def batch_format(name: str) -> dict:
    """The four conversations in one of the batch formats users bring."""
    found = conversations()
    packed = PackedCollator()(found)
    if name == "PackedCollator":
        return packed
    keys = ["input_ids", "labels", "position_ids"]
    if name == "trl padding-free":
        keys += ["cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"]
        seq_idx = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
        return {**{k: packed[k] for k in keys}, "seq_idx": seq_idx[None].to(torch.int32)}
    if name == "position_ids only":
        return {k: packed[k] for k in keys}
    # two packed rows, each ending in a padding segment: two conversations each, or three and one
    split = 2 if name == "two rows" else 3
    rows = [PackedCollator(pad_to_multiple_of=32)(found[:split]), PackedCollator(pad_to_multiple_of=32)(found[split:])]
    return {k: torch.cat([row[k] for row in rows]) for k in ("input_ids", "labels", "position_ids")}


def built(family: str, device: str = "cpu"):
    return tiny_family_model(family, "eager", device=device)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "name", ["PackedCollator", "position_ids only", "trl padding-free", "two rows", "uneven rows"])
def test_every_batch_format_is_every_conversation_alone(family, name):
    model = built(family)
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    apply_packed_loss(model, backend="torch")
    assert mixers_of(model)
    batch = batch_format(name)
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    assert_loss_close(loss, expected_loss)
    assert_gradients_close(grads, expected_grads, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_checkpointing_recomputes_per_conversation(family):
    """The recomputation in the backward finds the conversations again: in the mixer's own call,
    or (Jamba's layers call their mixer without keywords; transformers recomputes a layer past its
    hooks) in the decoder layer's keywords."""
    model = built(family)
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_packed_loss(model, backend="torch")
    batch = batch_format("position_ids only")
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    assert_loss_close(loss, expected_loss)
    assert_gradients_close(grads, expected_grads, rtol=1e-5)


def test_a_mixer_whose_conversations_only_its_layer_knows_is_refused_checkpointed():
    """A decoder layer that gets the row's position_ids but no keywords, and calls its mixer
    without them: the packed row is found in the layer's call only, which a recomputation under
    checkpointing (past the layer's hooks) could not find again. Refused by name before any wrong
    gradient; found without checkpointing."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from packed_ce.integrations.model import mixers

    class JambaMambaMixer(torch.nn.Module):  # a name of families.MIXERS: runs per conversation
        def forward(self, hidden_states):
            return hidden_states.cumsum(1)

    class Layer(GradientCheckpointingLayer):
        def __init__(self):
            super().__init__()
            self.mamba = JambaMambaMixer()

        def forward(self, hidden_states, position_ids):
            return self.mamba(hidden_states)

    layer = Layer()
    mixers.install(layer, [layer])
    positions = torch.tensor([[0, 1, 2, 0, 1]])
    hidden = torch.ones(1, 5, 2)
    assert layer(hidden, positions)[0, :, 0].tolist() == [1, 2, 3, 1, 2]
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
    with pytest.raises(ValueError, match="JambaMambaMixer is called without the batch's boundaries by its "
                                         "Layer, which gradient checkpointing recomputes"):
        layer(hidden.requires_grad_(), positions)


def test_copies_keep_the_mixers_and_remove_puts_them_back():
    model = built("qwen3_5_text")
    own = {name: type(m).forward for name, m in model.named_modules() if m in mixers_of(model)}
    apply_packed_loss(model, backend="torch")
    batch = batch_format("PackedCollator")
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        for mixer in mixers_of(twin):
            assert isinstance(mixer.__dict__["forward"], PerConversation) and mixer.forward.module is mixer
        loss, grads = loss_and_gradients(twin, lambda m: m(**batch).loss)
        assert_loss_close(loss, expected_loss)
        assert_gradients_close(grads, expected_grads, rtol=1e-6)
    remove_packed_loss(model)
    for name, mixer in model.named_modules():
        if name in own:
            assert "forward" not in mixer.__dict__
    assert not any(layer._forward_pre_hooks or layer._forward_hooks for layer in model.modules())


# --- the whole-row route: which route a row takes, and what its kernels receive -------------

# family -> (the kernel's name in its modeling module, the keyword its cu_seqlens arrive under)
KERNELS = {
    "qwen3_5_text": ("torch_chunk_gated_delta_rule", "cu_seqlens"),
    "kimi_linear": ("chunk_kimi_delta_attention", "cu_seqlens"),
}


def stand_in_kernel(own, calls: list):
    """A varlen kernel as fla's takes it: one ``(1, N, ...)`` row and ``cu_seqlens``; computed as
    transformers' PyTorch rule on each segment alone, and every call's row and boundaries
    recorded."""

    def kernel(query, key, value, g, beta, *, cu_seqlens=None, initial_state=None,
               output_final_state=False, **kwargs):
        calls.append((tuple(query.shape[:2]), None if cu_seqlens is None else cu_seqlens.tolist()))
        assert cu_seqlens is not None and query.shape[0] == 1
        cuts = cu_seqlens.tolist()
        pieces = [
            own(*(t[:, a:b] for t in (query, key, value, g, beta)), initial_state=None,
                output_final_state=False, **{k: v for k, v in kwargs.items() if k == "use_qk_l2norm_in_kernel"})[0]
            for a, b in zip(cuts[:-1], cuts[1:])
        ]
        return torch.cat(pieces, dim=1), None

    return kernel


@pytest.mark.parametrize("family", sorted(KERNELS))
@pytest.mark.parametrize("name", ["PackedCollator", "two rows"])
def test_with_the_kernels_installed_a_row_runs_whole_with_its_own_boundaries(family, name, monkeypatch):
    """Where the kernels that keep conversations apart are installed (stood in for here: a varlen
    rule computed per segment), every layer's mixer runs once per call on the whole batch
    flattened into one row, with the layout's cu_seqlens; its short convolution is kept per
    conversation by packed-ce (no causal-conv1d); loss and gradients are every conversation
    alone."""
    import sys

    from packed_ce.integrations.model import mixers

    model = built(family)
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    apply_packed_loss(model, backend="torch")
    module = sys.modules[type(mixers_of(model)[0]).__module__]
    function, _ = KERNELS[family]
    calls = []
    monkeypatch.setattr(module, function, stand_in_kernel(getattr(module, function), calls))
    monkeypatch.setattr(mixers, "whole_row", lambda mixer, hidden: True)
    batch = batch_format(name)
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    assert_loss_close(loss, expected_loss)
    assert_gradients_close(grads, expected_grads, rtol=1e-5)
    rows, width = batch["input_ids"].shape
    cuts = [0, *torch.cumsum(torch.tensor(LENGTHS), 0).tolist()]
    if name == "two rows":  # each row: two conversations, then its padding segment
        first = cuts[2]
        cuts = [0, cuts[1], first, width, width + cuts[3] - first, width + cuts[4] - first, 2 * width]
    forward_calls = calls[-len(mixers_of(model)):]  # the call's (the first call's probe ran before)
    assert forward_calls and all(call == ((1, rows * width), cuts) for call in forward_calls)


def test_the_route_follows_the_installed_kernels(monkeypatch):
    """A whole row needs every kernel package of the mixer's entry, on CUDA; a short convolution
    needs none; a mixer no kernel can keep apart never runs whole."""
    from types import SimpleNamespace

    from packed_ce.integrations.model import convolution, mixers

    model = built("qwen3_5_text")
    delta, = mixers_of(model)
    lfm2, = mixers_of(built("lfm2"))
    jamba, = mixers_of(built("jamba"))
    cuda, cpu = SimpleNamespace(is_cuda=True), SimpleNamespace(is_cuda=False)
    monkeypatch.setattr(convolution, "installed", lambda package: package == "fla")
    assert mixers.whole_row(delta, cuda) and not mixers.whole_row(delta, cpu)
    assert mixers.whole_row(lfm2, cpu) and not mixers.whole_row(jamba, cuda)
    monkeypatch.setattr(convolution, "installed", lambda package: False)
    assert not mixers.whole_row(delta, cuda)


def test_a_row_run_per_conversation_says_once_what_would_run_it_whole():
    from packed_ce.integrations.model import mixers

    model = apply_packed_loss(built("qwen3_5_text"), backend="torch")
    mixers._warned.discard("Qwen3_5GatedDeltaNet")
    with pytest.warns(UserWarning, match="Qwen3_5GatedDeltaNet runs each conversation of a packed row alone "
                                         r"\(exact, slower than the whole row\): on a CUDA device with fla"):
        model(**batch_format("PackedCollator"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch_format("PackedCollator"))


def test_a_masked_convolution_is_each_conversation_alone():
    """packed-ce's short convolution on a row (every tap of another conversation masked) against
    the family's own on each conversation alone, value and gradients, float64."""
    import torch.nn.functional as F

    from packed_ce.integrations.model.convolution import masked_convolution

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 11, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = torch.randn(6, 4, dtype=torch.float64, generator=gen, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=gen, requires_grad=True)
    seq_idx = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 2, 3, 3, 3], [0] * 4 + [1] * 7])
    packed = masked_convolution(x, weight, bias, "silu", seq_idx)
    alone = torch.zeros_like(packed)
    for row in range(2):
        for conversation in seq_idx[row].unique():
            where = (seq_idx[row] == conversation).nonzero().flatten()
            piece = x[row : row + 1, :, where]
            own = F.conv1d(piece, weight[:, None], bias, padding=3, groups=6)[..., : len(where)]
            alone[row, :, where] = F.silu(own[0])
    torch.testing.assert_close(packed, alone, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(packed)
    got = torch.autograd.grad(packed, (x, weight, bias), grad)
    want = torch.autograd.grad(alone, (x, weight, bias), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --- context parallelism --------------------------------------------------------------------

# granitemoehybrid: refused packed (transformers 5.24 builds its masks without position_ids),
# exact under context parallelism, whose attention takes the conversations from the row layout
CP_FAMILIES = ["qwen3_5_text", "nemotron_h", "lfm2", "jamba", "granitemoehybrid"]


def cp_batch(world: int) -> dict:
    return PackedCollator(pad_to_multiple_of=2 * world)(conversations())


def cp_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    start_rank(rank, world, store)
    try:
        batch = cp_batch(world)
        count = count_num_items(batch)
        shard = shard_batch(batch, rank, world)
        for family in CP_FAMILIES:
            model = enable_context_parallel(apply_packed_loss(built(family), backend="torch"))
            loss = model(**shard, num_items_in_batch=count).loss
            loss.backward()
            torch.save({"loss": loss.detach(), "grads": gradients(model)},
                       os.path.join(out_dir, f"{family}-{world}-{rank}.pt"))
        # Gemma 3n's padding segment of its embedding's padding_idx 0 (NaN gradients) lies in some
        # ranks' shards: every rank must refuse it, none may wait in a collective for the others
        found = [{key: [t or 2 for t in c[key]] for key in ("input_ids", "labels")} for c in conversations()]
        padded = PackedCollator(pad_to_multiple_of=8 * world)(found)
        local = shard_batch(padded, rank, world)
        model = enable_context_parallel(apply_packed_loss(built("gemma3n_text"), backend="torch"))
        try:
            model(**local, num_items_in_batch=count_num_items(padded))
            outcome = "ran"
        except ValueError as error:
            outcome = str(error)
        torch.save({"outcome": outcome, "holds": bool((local["input_ids"] == 0).any())},
                   os.path.join(out_dir, f"gemma3n-{world}-{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_shares_add_up_to_every_conversation_alone(world, tmp_path):
    spawn_ranks(cp_worker, (world, rendezvous(tmp_path), str(tmp_path)), world)
    for family in CP_FAMILIES:
        ranks = [torch.load(tmp_path / f"{family}-{world}-{rank}.pt") for rank in range(world)]
        model = built(family)
        expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
        assert_loss_close(sum(r["loss"] for r in ranks), expected_loss)
        grads = {name: sum(r["grads"][name] for r in ranks) for name in expected_grads}
        # all parameters as one vector: a gated delta rule's A_log and dt_bias gradients are sums
        # with cancellation (1e-6 from terms near 1e-3), which splitting the backward into the
        # ranks' partial sums moves by up to 2e-3 relative, the same in one process
        error = flat_relative_error(grads, expected_grads)
        assert error <= 1e-5, f"{family} on {world} ranks: gradients {error:.1e} from every conversation alone"
    gemma3n = [torch.load(tmp_path / f"gemma3n-{world}-{rank}.pt") for rank in range(world)]
    assert 0 < sum(r["holds"] for r in gemma3n) < world  # the padding is in some ranks' shards
    assert len({r["outcome"] for r in gemma3n}) == 1 and "pad_token_id=1" in gemma3n[0]["outcome"]


# --- on a GPU: the installed kernels (flash-linear-attention's gated delta rule where carried) ---

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def relative(actual: dict, expected: dict) -> float:
    return flat_relative_error({k: v.float() for k, v in actual.items()}, {k: v.float() for k, v in expected.items()})


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "lfm2", "kimi_linear"])
def test_exact_on_cuda_in_float32_and_bfloat16(family):
    """float32: within 1e-5 of every conversation alone. bfloat16: packed against alone no
    further than bfloat16's own error (alone in bfloat16 against alone in float32) allows."""
    batch = {k: v.cuda() if torch.is_tensor(v) else v for k, v in batch_format("PackedCollator").items()}
    truth = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = built(family, "cuda").to(dtype=dtype)
        truth[dtype] = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
        apply_packed_loss(model, backend="torch")
        loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
        if dtype == torch.float32:
            assert_loss_close(loss, truth[dtype][0])
            assert relative(grads, truth[dtype][1]) <= 1e-5
        else:
            own_error = relative(truth[dtype][1], truth[torch.float32][1])  # bfloat16's own, alone
            error = relative(grads, truth[dtype][1])
            print(f"{family} bfloat16: packed vs alone {error:.1e}, alone vs float32 {own_error:.1e}")
            assert error <= 2 * own_error + 1e-3


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "kimi_linear"])
def test_inputs_refilled_in_place_are_split_as_they_are_now(family):
    """A loop that refills its input tensors in place (static buffers, CUDA graphs): the second
    step's conversations are the second step's, loss and every gradient."""
    model = apply_packed_loss(built(family), backend="torch")
    found = conversations()
    buffers = PackedCollator()(found)
    with torch.no_grad():
        model(**buffers)
    regrouped = [{k: found[0][k] + found[1][k] for k in ("input_ids", "labels")}, *found[2:]]
    refill = PackedCollator()(regrouped)
    for key in ("input_ids", "labels", "position_ids"):
        buffers[key].copy_(refill[key])
    batch = {k: buffers[k] for k in ("input_ids", "labels", "position_ids")}
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, regrouped))
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    assert_loss_close(loss, expected_loss)
    assert_gradients_close(grads, expected_grads, rtol=1e-5)


def test_every_short_convolution_packed_ce_keeps_apart_is_there():
    """Each MIXERS class with a ``conv`` (a seam: trainers/seams.py) is defined next to that
    module-level function in the installed transformers, and its forward hands it the call's
    ``seq_idx`` (through ``**kwargs`` or by name): else the convolution would read across
    conversations without a word."""
    import re
    from pathlib import Path

    import transformers

    from packed_ce.integrations.model.families import MIXERS

    sources = {path: path.read_text() for path in Path(transformers.__file__).parent.glob("models/*/modeling_*.py")}
    checked = 0
    for name, mixer in MIXERS.items():
        if mixer.conv is None:
            continue
        found = [text for text in sources.values() if f"class {name}(" in text]
        if not found:
            continue  # a family this transformers does not have
        text = found[0]
        body = text[text.index(f"class {name}("):]
        body = body[: re.search(r"\n(class |@)", body[1:]).start() + 1] if re.search(r"\n(class |@)", body[1:]) else body
        assert f"def {mixer.conv}(" in text, name
        call = re.search(rf"{mixer.conv}\((.*?)\n\s*\)", body, re.S) or re.search(rf"{mixer.conv}\(([^\n]*)\)", body)
        assert call and ("**kwargs" in call.group(1) or "seq_idx" in call.group(1)), name
        checked += 1
    assert checked >= 6


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_trl_defaults_train_a_mamba_hybrid_checkpointed(packing, tmp_path):
    """trl's defaults (gradient checkpointing on) with PackedSFTTrainer on a Mamba 2 hybrid, whose
    layers hand their mixer the call's keywords: one step trains, padded and packed (the mixer
    called outside a packed row was refused checkpointed)."""
    pytest.importorskip("trl")
    import collators
    from trl import SFTConfig

    from packed_ce.integrations import PackedSFTTrainer

    tokenizer = collators.load_default_tokenizer()
    model = built("nemotron_h")
    model.resize_token_embeddings(len(tokenizer))
    args = SFTConfig(str(tmp_path), report_to=[], max_steps=1, per_device_train_batch_size=2, packing=packing,
                     max_length=128, use_cpu=True, bf16=False)
    assert args.gradient_checkpointing
    trainer = PackedSFTTrainer(model=model, args=args, processing_class=tokenizer,
                               train_dataset=collators.load_default_dataset().select(range(8)))
    assert torch.isfinite(torch.tensor(trainer.train().training_loss))
