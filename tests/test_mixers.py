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
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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
    free_port,
    gradients,
    loss_and_gradients,
    one_at_a_time,
    synthetic_conversations,
)

# one family of each kind of mixer: gated delta rule (conv + rule), Mamba 2, short convolution,
# Kimi delta attention (its kernel takes no boundary), Mamba 1 in a layer that calls it without
# keywords (the decoder layer's call gives the boundaries), lightning attention (position
# embeddings and a mask beside the hidden states)
FAMILIES = ["qwen3_5_text", "nemotron_h", "lfm2", "kimi_linear", "jamba", "minimax"]
LENGTHS = [9, 14, 5, 11]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    # two packed rows of two conversations each, the shorter row ending in a padding segment
    rows = [PackedCollator(pad_to_multiple_of=32)(found[:2]), PackedCollator(pad_to_multiple_of=32)(found[2:])]
    return {k: torch.cat([row[k] for row in rows]) for k in ("input_ids", "labels", "position_ids")}


def built(family: str):
    return tiny_family_model(family, "eager")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["PackedCollator", "position_ids only", "trl padding-free", "two rows"])
def test_every_batch_format_is_every_conversation_alone(family, name):
    model = built(family)
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    apply_packed_loss(model, backend="torch")
    assert mixers_of(model)
    batch = batch_format(name)
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    assert_loss_close(loss, expected_loss)
    assert_gradients_close(grads, expected_grads, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_5_text", "nemotron_h", "lfm2"])
def test_gradient_checkpointing_recomputes_per_conversation(family):
    """The recomputation in the backward finds the conversations again (in the mixer's own
    call)."""
    model = built(family)
    expected_loss, expected_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_packed_loss(model, backend="torch")
    batch = batch_format("position_ids only")
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    assert_loss_close(loss, expected_loss)
    assert_gradients_close(grads, expected_grads, rtol=1e-5)


def test_a_mixer_called_without_boundaries_is_refused_checkpointed():
    """Jamba's layers call their Mamba mixer without keywords: its boundaries come from the layer's
    call, which transformers' checkpointing recomputes outside every hook. Refused by name before
    any wrong gradient; exact without checkpointing (above)."""
    model = built("jamba")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_packed_loss(model, backend="torch")
    with pytest.raises(ValueError, match="JambaMambaMixer is called without the batch's boundaries by its "
                                         "JambaMambaDecoderLayer, which gradient checkpointing recomputes"):
        model(**batch_format("position_ids only")).loss.backward()


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


# --- context parallelism --------------------------------------------------------------------

CP_FAMILIES = ["qwen3_5_text", "nemotron_h", "lfm2", "jamba"]


def cp_batch(world: int) -> dict:
    return PackedCollator(pad_to_multiple_of=2 * world)(conversations())


def cp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
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
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_shares_add_up_to_every_conversation_alone(world, tmp_path):
    mp.spawn(cp_worker, args=(world, free_port(), str(tmp_path)), nprocs=world, join=True)
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
        model = built(family).to(device="cuda", dtype=dtype)
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
