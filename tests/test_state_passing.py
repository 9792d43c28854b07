"""Gated delta nets, Mamba 2's mixers and LFM2's short convolutions under context parallelism
pass their state between the ranks (``context_parallel/state.py``) instead of gathering the row's
inputs: exact.

- one process, a row of many chunks (the halos and the states passed from chunk to chunk on
  one rank): the mixer's output and every gradient equal its own forward on each conversation
  alone; chunks shorter than the convolution's reach gather instead;
- the check of the first call: the module's own forward agrees; one that does not is warned of
  and gathered;
- 2, 3 and 4 gloo ranks, Qwen3.5's tiny model (a gated delta net and full attention; Qwen3-Next's,
  whose projections are fused, LFM2's, a short convolution, and Nemotron-H's and Granite
  4.0-H's, Mamba 2, on 3; Bamba's on 2), a row of conversations over up to four chunks: the shares
  add up to every conversation alone (float32) and equal the gathered route (float64), every
  gated delta net having passed its state.

The family's rule (and Mamba 2's scan) runs in float32 whatever the model's dtype; the float64
comparisons patch in the rule or the scan token by token in float64 (:func:`recurrent_rule`,
:func:`recurrent_scan`, for the family's module and ours alike). The family computes its decay ``g`` in float32 too, so the gradients reaching ``A_log``,
``dt_bias`` and ``in_proj_a`` (and, through the latter, the inputs) carry float32 rounding: they
are compared within 1e-6, the outputs within 1e-12.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from collators import PackedCollator, shard_batch
from family_models import VOCAB, tiny_family_model
from integration_utils import (
    flat_relative_error,
    rendezvous,
    spawn_ranks,
    start_rank,
    gradients,
    loss_and_gradients,
    one_at_a_time,
    relative_error,
    synthetic_conversations,
)
from packed_ce.integrations import apply_packed_loss, count_num_items, enable_context_parallel
from packed_ce.integrations.context_parallel import state
from packed_ce.integrations.context_parallel.layout import RowLayout

LENGTHS = [9, 14, 5, 11, 23, 2, 17]
DECAY = {"A_log", "dt_bias", "in_proj_a.weight"}  # the gated delta net's float32 decay  # 81 tokens: chunks of 21, 14 and 11 on 2, 3 and 4 ranks


def recurrent_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule token by token, in float64: ``S <- e^g S``, then
    ``S <- S + k (beta (v - k^T S))^T``, ``o = q^T S`` (``q``, ``k`` l2-normalised, ``q`` scaled by
    ``dk^-1/2``), as transformers' ``torch_recurrent_gated_delta_rule`` computes it in float32."""
    groups = value.shape[2] // key.shape[2]
    q, k = (x.repeat_interleave(groups, dim=2).double() for x in (query, key))
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * q.shape[-1] ** -0.5
    v, g, beta = value.double(), g.double(), beta.double()
    batch, length, heads, dk = k.shape
    if initial_state is None:
        initial_state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float64)
    s, outputs = initial_state.double(), []
    for t in range(length):
        s = s * g[:, t, :, None, None].exp()
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], s)) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * delta[:, :, None, :]
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
    return torch.stack(outputs, 1).to(value.dtype), s if output_final_state else None


def recurrent_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None,
                   initial_states=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                   return_final_states=False, **kwargs):
    """Mamba 2's scan token by token, in float64: ``h <- e^(dt A) h + dt x B^T``,
    ``y = h C + D x``, per head (``dt`` shifted by ``dt_bias``, softplus, clamped to ``dt_limit``;
    ``B``, ``C`` shared by the heads of a group), as transformers' ``mamba2_chunk_scan`` computes
    it in float32."""
    x = hidden_states.double()
    batch, length, heads, _ = x.shape
    groups = heads // B.shape[2]
    b, c = (m.double().repeat_interleave(groups, dim=2) for m in (B, C))
    dt = dt.double() + (0 if dt_bias is None else dt_bias.double())
    dt = torch.nn.functional.softplus(dt) if dt_softplus else dt
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    h = (torch.zeros(batch, heads, x.shape[-1], b.shape[-1], dtype=torch.float64)
         if initial_states is None else initial_states.double())
    outputs = []
    for t in range(length):
        h = h * (dt[:, t] * A.double()).exp()[..., None, None]
        h = h + dt[:, t, :, None, None] * x[:, t, :, :, None] * b[:, t, :, None, :]
        y = torch.einsum("bhpn,bhn->bhp", h, c[:, t])
        outputs.append(y if D is None else y + D.double()[:, None] * x[:, t])
    out = torch.stack(outputs, 1).to(hidden_states.dtype)
    return (out, h) if return_final_states else out


# the families whose mixers pass their state, and where each one's float64 stand-in goes: the
# module and name of its gated delta rule or Mamba 2 scan (None: a short convolution, float64
# as it is)
RULES = {
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "torch_chunk_gated_delta_rule", recurrent_rule),
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule", recurrent_rule),
    "lfm2": None,
    "nemotron_h": ("transformers.models.nemotron_h.modeling_nemotron_h", "mamba2_chunk_scan", recurrent_scan),
    "granitemoehybrid": ("transformers.models.granitemoehybrid.modeling_granitemoehybrid", "mamba2_chunk_scan", recurrent_scan),
    "bamba": ("transformers.models.bamba.modeling_bamba", "mamba2_chunk_scan", recurrent_scan),
}


def float64_rule(family: str = "qwen3_5_text"):
    """Patches the family's float64 stand-in in (its forward's and ours)."""
    if RULES[family] is None:
        return contextlib.nullcontext()
    module, name, stand_in = RULES[family]
    return mock.patch(f"{module}.{name}", stand_in)


def mixer_of(model):
    layer = model.model.layers[0]
    for name in ("conv", "linear_attn", "mixer", "mamba"):
        if hasattr(layer, name):
            return getattr(layer, name)
    raise AssertionError(f"no mixer in {type(layer).__name__}")


def one_rank_layout(lengths: list[int], chunk: int) -> RowLayout:
    """The layout of a row of ``lengths`` on a one-rank group, cut into chunks of ``chunk``."""
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    chunks = (tuple(range(positions.shape[1] // chunk)),)
    return RowLayout.gather(None, 0, 1, positions, chunks)


@pytest.mark.parametrize("family", list(RULES))
def test_states_passed_from_chunk_to_chunk_are_each_conversation_alone(family, one_rank_group):
    """A row of 48 tokens in 6 chunks of 8 on one rank (conversations over up to three chunks,
    one of a single token, a chunk that begins one conversation and carries another on): output
    and gradients of the mixer's own forward on every conversation alone."""
    lengths = [13, 1, 20, 3, 11]
    model = tiny_family_model(family, "eager").double()
    mixer = mixer_of(model)
    hidden = torch.randn(1, sum(lengths), model.config.hidden_size, dtype=torch.float64,
                         generator=torch.Generator().manual_seed(0))
    upstream = torch.randn_like(hidden)
    with float64_rule(family):
        streamed = state.streamed_mixer(mixer, {"hidden_states": hidden.requires_grad_()},
                                        one_rank_layout(lengths, 8))
        got = loss_and_gradients(mixer, lambda m: (streamed * upstream).sum())[1]
        got_hidden, hidden.grad = hidden.grad, None
        alone = torch.cat([type(mixer).forward(mixer, part) for part in hidden.split(lengths, 1)], 1)
        expected = loss_and_gradients(mixer, lambda m: (alone * upstream).sum())[1]
    torch.testing.assert_close(streamed, alone, rtol=1e-12, atol=1e-12)
    assert relative_error(got_hidden, hidden.grad) <= 1e-6
    for name, grad in expected.items():
        assert relative_error(got[name], grad) <= (1e-6 if name in DECAY else 1e-12), name


def test_chunks_shorter_than_the_convolution_gather(one_rank_group):
    mixer = mixer_of(tiny_family_model("qwen3_5_text", "eager"))
    hidden = torch.randn(1, 12, mixer.hidden_size)
    assert state.streamed_mixer(mixer, {"hidden_states": hidden}, one_rank_layout([5, 7], 2)) is None
    assert state.streamed_mixer(mixer, {"hidden_states": hidden}, one_rank_layout([5, 7], 3)) is not None


def test_a_forward_that_differs_is_gathered_with_a_warning(one_rank_group):
    mixer = mixer_of(tiny_family_model("qwen3_5_text", "eager"))
    own = type(mixer).forward
    assert state._agrees_with_own_forward(mixer, one_rank_layout([6], 3))
    with mock.patch.object(type(mixer), "forward", lambda self, hidden_states, **kw: 2 * own(self, hidden_states)):
        with pytest.warns(UserWarning, match="gather the row's inputs instead"):
            hidden = torch.randn(1, 6, mixer.hidden_size)
            assert state.streamed_mixer(mixer, {"hidden_states": hidden}, one_rank_layout([6], 3)) is None


# --- on gloo ranks ---------------------------------------------------------------------------


def conversations() -> list[dict]:
    return synthetic_conversations(LENGTHS, VOCAB, seed=5)


def share(rank: int, world: int, family: str, dtype, gather: bool) -> dict:
    """This rank's loss share and gradients; ``gather``: the mixers gather the row instead."""
    batch = PackedCollator(pad_to_multiple_of=2 * world)(conversations())
    model = tiny_family_model(family, "eager").to(dtype)
    if dtype == torch.float64 and model._can_set_experts_implementation():
        model.set_experts_implementation("eager")  # torch's grouped_mm takes no float64
    model = apply_packed_loss(model, backend="torch")
    enable_context_parallel(model)
    streamed, original = [], state.streamed_mixer

    def spy(*args):
        streamed.append(None if gather else original(*args))
        return streamed[-1]

    with mock.patch("packed_ce.integrations.context_parallel.state.streamed_mixer", spy):
        loss = model(**shard_batch(batch, rank, world), num_items_in_batch=count_num_items(batch)).loss
        loss.backward()
    assert gather or (streamed and all(out is not None for out in streamed)), "the state was not passed"
    return {"loss": loss.detach().double(), "grads": {k: v.double() for k, v in gradients(model).items()}}


def worker(rank: int, world: int, family: str, store: str, out_dir: str) -> None:
    start_rank(rank, world, store)
    try:
        results = {"float32": share(rank, world, family, torch.float32, gather=False)}
        with float64_rule(family):
            results["streamed"] = share(rank, world, family, torch.float64, gather=False)
            results["gathered"] = share(rank, world, family, torch.float64, gather=True)
        torch.save(results, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("family", "world"),
    [("qwen3_5_text", 2), ("qwen3_5_text", 3), ("qwen3_5_text", 4), ("qwen3_next", 3), ("lfm2", 3),
     ("nemotron_h", 3), ("granitemoehybrid", 3), ("bamba", 2)],
)
def test_states_passed_between_ranks_are_exact(family, world, tmp_path):
    """The shares of ``world`` ranks whose mixers pass their state: float32, within 1e-5 of
    every conversation alone (loss; the gradients as one vector, as for the gathered route in
    tests/test_mixers.py); float64, the gathered route's loss within 1e-12 and every gradient
    within 1e-6 (measured: the loss bit for bit, which the packed loss rounds to float32; the
    gradients outside the gated delta net bit for bit, its own within 5e-8: the float32 decay,
    module docstring; Nemotron-H's, Granite 4.0-H's and Bamba's within 1.2e-7: the Mamba 2
    mixer's gated norm computes in float32)."""
    spawn_ranks(worker, (world, family, rendezvous(tmp_path), str(tmp_path)), world)
    ranks = [torch.load(tmp_path / f"{rank}.pt") for rank in range(world)]
    summed = {
        kind: {
            "loss": sum(r[kind]["loss"] for r in ranks),
            "grads": {k: sum(r[kind]["grads"][k] for r in ranks) for k in ranks[0][kind]["grads"]},
        }
        for kind in ranks[0]
    }
    expected_loss, expected_grads = loss_and_gradients(
        tiny_family_model(family, "eager"), lambda m: one_at_a_time(m, conversations())
    )
    assert relative_error(summed["float32"]["loss"], expected_loss) <= 1e-5
    assert flat_relative_error(summed["float32"]["grads"], expected_grads) <= 1e-5
    streamed, gathered = summed["streamed"], summed["gathered"]
    assert relative_error(streamed["loss"], gathered["loss"]) <= 1e-12
    errors = {k: relative_error(streamed["grads"][k], v) for k, v in gathered["grads"].items()}
    print(f"{family}, {world} ranks: float64 loss {relative_error(streamed['loss'], gathered['loss']):.1e}, worst gradient {max(errors.values()):.1e} "
          f"(others than the decay's {max(e for k, e in errors.items() if 'linear_attn' not in k):.1e})")
    assert max(errors.values()) <= 1e-6, errors
