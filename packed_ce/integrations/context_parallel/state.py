"""Hybrid mixers under context parallelism: each chunk's state handed on, not the row gathered.

A recurrent mixer reads the row before each token only through its state: a short convolution
through its last ``K - 1`` inputs, a gated delta rule through its ``(dk, dv)`` matrix per head.
A rank that holds chunk ``c`` of a conversation begun in an earlier chunk needs those of chunk
``c - 1`` (held by another rank, or by itself), nothing else:

- the convolution: every chunk's last ``K - 1`` inputs go to the owner of the next chunk, in one
  exchange (the ones of another conversation zeroed: that conversation's padding);
- the rule: its state after a chunk is affine in its state before,
  ``S_out = M S_in + B``, and the chunk's outputs are ``O = O_0 + U S_in``. One call of the
  family's own rule gives ``O_0``, ``U``, ``M`` and ``B`` at once: the values padded with ``dk``
  zero columns and the initial state ``[0 | I]`` (``dk x (dv + dk)``) carry ``S_0`` and the
  transition side by side (the rule is linear in its initial state). The states then pass along
  the row in order (:class:`_StateChain`, small messages, the only sequential part), and each
  chunk's outputs are corrected by its ``S_in``.

The backward goes the same ways back: the halos' gradients to the chunks they came from, the
states' gradients along the row in reverse (``g_in = dS_in + M^T g_out``, ``dM = g_out S_in^T``,
``dB = g_out``), everything else through autograd on this rank's tokens. Nothing a rank holds
grows with the row.

A short convolution alone (LFM2's, :data:`SHORT_CONVOLUTIONS`: ``in_proj`` to ``B``, ``C``,
``x``; the convolution of ``B x``; ``C`` times it; ``out_proj``) needs the halos only.

Mamba 2's scan (:data:`MAMBA2_MIXERS`) is the same chain with its own state: per head a
``(P, N)`` matrix ``h`` that decays by a scalar and gains ``dt x B^T`` per token, read as
``y = h C + D x``. It is affine in its initial state too, ``h_out = h_in T + b`` (``T`` the
chunk's decay times ``I``), and ``y = y_0 + (h_in V)`` per token: the family's own chunked scan
run with ``N`` extra rows of ``x`` (zeros) whose initial state is ``I`` gives ``V`` as those rows'
outputs and ``T`` as their final state. The chain carries ``h^T`` (``(N, P)`` per head), so
``M = T^T``, ``B = b^T`` and the correction is ``V h_in^T`` as for the delta rule.

Done for LFM2's short convolutions, for the Mamba 2 mixers of Nemotron-H, Bamba and Granite
4.0-H (``in_proj`` to the gate, ``x B C`` and ``dt``; a depthwise ``conv1d``; the family's
``mamba2_chunk_scan``; the gated ``norm``; ``out_proj``) and for the gated delta nets of
Qwen3.5's and Qwen3-Next's layouts (:data:`GATED_DELTA_NETS`: separate
``in_proj_qkv``/``z``/``b``/``a`` projections, or Qwen3-Next's fused ``in_proj_qkvz`` and
``in_proj_ba`` split by the module's own ``fix_query_key_value_ordering``; a depthwise
``conv1d``, the family's ``torch_chunk_gated_delta_rule``), written against their transformers
forward and checked against it on the first call of each row (:func:`_agrees_with_own_forward`);
every other mixer, and rows cut into chunks shorter than the convolution's reach, gather the
row's inputs (``model/mixers.py``).
"""

from __future__ import annotations

import sys
import warnings
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from .layout import RowLayout

GATED_DELTA_NETS = (
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "Qwen4ExpTextGatedDeltaNet",
    "LaraMiniGatedDeltaNet",
    "Qwen3NextGatedDeltaNet",
)
SHORT_CONVOLUTIONS = ("Lfm2ShortConv", "Lfm2MoeShortConv", "Lfm3ShortConv")
MAMBA2_MIXERS = ("NemotronHMamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer")
# What :func:`_mamba2` reads of such a module.
_MAMBA2_PARTS = (
    "in_proj",
    "conv1d",
    "activation",
    "A_log",
    "D",
    "dt_bias",
    "norm",
    "out_proj",
    "intermediate_size",
    "conv_dim",
    "num_heads",
    "head_dim",
    "n_groups",
    "ssm_state_size",
    "chunk_size",
    "time_step_limit",
)
# What :func:`_short_convolution` reads of such a module.
_SHORT_PARTS = ("in_proj", "conv", "out_proj")
# The input projections the gated delta net reads, in either layout (:func:`_projections`).
_SEPARATE = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_FUSED = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
# What else it reads of such a module (a module without one of them, or without either set of
# projections, gathers).
_PARTS = (
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "activation",
    "head_k_dim",
    "head_v_dim",
    "num_v_heads",
    "key_dim",
    "value_dim",
)
# Arguments of the forward that the one below does not read (the others, boundary keywords and
# what the decoder passes on, it ignores: the row layout says where conversations start).
_READ = ("cache", "cache_params", "past_key_values", "attention_mask")
# The first call's check: our forward and the module's own on a few tokens of noise, within this
# many units in the last place of the dtype (and at least this relative error) times the output's
# scale: room for the installed kernels' rounding (flash-linear-attention, causal_conv1d), where a
# formula that differed would be off by the output's own size.
_PROBE_TOKENS, _PROBE_ULPS, _PROBE_RTOL = 12, 64, 1e-4


class ChunkPlan(NamedTuple):
    """One chunk of this rank, as the mixers see it.

    Attributes:
        segments: ``(start, end)`` local token ranges of its conversation pieces, in order.
        continued: its first segment continues the conversation of the row token before it.
        carries: it is one segment, continued: its state out depends on its state in.
        continues: its last conversation goes on in the next row chunk.
    """

    segments: list
    continued: bool
    carries: bool
    continues: bool


class MixerPlan(NamedTuple):
    """Who sends which chunk's halo and state to whom (global ranks), and this rank's chunks.

    Attributes:
        chunks: a :class:`ChunkPlan` per local chunk, in local order.
        sends: ``(local chunk, rank)`` whose tail and state go to the next chunk's owner.
        receives: ``(local chunk, rank)`` whose halo and state come from the previous chunk's.
        local_links: ``(local chunk, local chunk)``: the next chunk is this rank's own.
        order: the local chunks in row order, each with the rank (or None) its state comes from
            and goes to.
    """

    chunks: list
    sends: list
    receives: list
    local_links: list
    order: list


def mixer_plan(layout: RowLayout, reach: int) -> MixerPlan | None:
    """The row's chunks as this rank's mixers pass them on (module docstring), or None when a
    chunk is shorter than ``reach`` (the convolution's ``K - 1``): its halo would span chunks.
    Planned on the host once per row.
    """
    key = ("state", reach)
    if key in layout.plans:
        return layout.plans[key]
    documents = layout.row_documents()
    chunks = np.asarray(layout.chunks, dtype=np.int64)  # (W, m)
    size = documents.size // chunks.size
    if size < reach:
        layout.plans[key] = None
        return None
    owner = np.empty(chunks.size, dtype=np.int64)
    local_index = np.empty(chunks.size, dtype=np.int64)
    for rank, held in enumerate(chunks):
        owner[held], local_index[held] = rank, np.arange(held.size)
    global_rank = _global_ranks(layout)
    continued = np.zeros(chunks.size, dtype=bool)
    continued[1:] = documents[size::size] == documents[size - 1 : -1 : size]
    plans, sends, receives, local_links, order = [], [], [], [], []
    for j, chunk in enumerate(chunks[layout.rank]):
        pieces = documents[chunk * size : (chunk + 1) * size]
        cuts = [0, *(np.flatnonzero(pieces[1:] != pieces[:-1]) + 1).tolist(), size]
        segments = [(j * size + a, j * size + b) for a, b in zip(cuts[:-1], cuts[1:])]
        goes_on = bool(chunk + 1 < chunks.size and continued[chunk + 1])
        plans.append(
            ChunkPlan(
                segments,
                bool(continued[chunk]),
                bool(continued[chunk]) and len(segments) == 1,
                goes_on,
            )
        )
        source = destination = None
        if continued[chunk] and owner[chunk - 1] != layout.rank:
            source = global_rank[owner[chunk - 1]]
            receives.append((j, source))
        if goes_on and owner[chunk + 1] != layout.rank:
            destination = global_rank[owner[chunk + 1]]
            sends.append((j, destination))
        elif goes_on:
            local_links.append((j, int(local_index[chunk + 1])))
        order.append((j, source, destination))
    plan = MixerPlan(plans, sends, receives, local_links, order)
    layout.plans[key] = plan
    return plan


def _global_ranks(layout: RowLayout) -> list[int]:
    group = dist.group.WORLD if layout.group is None else layout.group
    return [dist.get_global_rank(group, rank) for rank in range(layout.world_size)]


class _Halos(torch.autograd.Function):
    """Each local chunk's halo: the previous row chunk's last ``K - 1`` convolution inputs.

    Forward: ``tails`` ``(m, K - 1, Cd)`` (each local chunk's last inputs, another conversation's
    already zeroed) -> ``halos`` ``(m, K - 1, Cd)`` (zeros for a chunk not continued). Backward:
    each halo's gradient back to the tail it came from. One batch of sends and receives each way.
    """

    @staticmethod
    def forward(ctx, tails, plan: MixerPlan, group):
        ctx.plan, ctx.group = plan, group
        halos = torch.zeros_like(tails)
        for j, k in plan.local_links:
            halos[k] = tails[j]
        _exchange(
            [(tails[j].contiguous(), rank) for j, rank in plan.sends],
            [(halos[j], rank) for j, rank in plan.receives],
            group,
        )
        return halos

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_halos):
        plan = ctx.plan
        grad_tails = torch.zeros_like(grad_halos)
        for j, k in plan.local_links:
            grad_tails[j] += grad_halos[k]
        received = [torch.empty_like(grad_halos[0]) for _ in plan.sends]
        _exchange(
            [(grad_halos[j].contiguous(), rank) for j, rank in plan.receives],
            list(zip(received, (rank for _, rank in plan.sends))),
            ctx.group,
        )
        for (j, _), grad in zip(plan.sends, received):
            grad_tails[j] += grad
        return grad_tails, None, None


def _exchange(sends: list, receives: list, group) -> None:
    """Posts every send and receive ``(tensor, global rank)`` at once and waits for them. Two
    ranks post their messages to each other in row order, so they match in order.
    """
    ops = [dist.P2POp(dist.isend, tensor, rank, group) for tensor, rank in sends]
    ops += [dist.P2POp(dist.irecv, tensor, rank, group) for tensor, rank in receives]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


class _StateChain(torch.autograd.Function):
    """Each local chunk's state in, from the row's chunks' affine steps in row order.

    Forward: ``transitions`` ``(m, Hv, dk, dk)`` (``M``, zero where a chunk does not carry),
    ``offsets`` ``(m, Hv, dk, dv)`` (``B``) -> ``states`` ``(m, Hv, dk, dv)`` (``S_in``, zero for
    a chunk not continued). Each rank walks its chunks in row order, receiving a state where the
    chunk before is another rank's and sending its state out where the next one is.

    ``halos`` (the :class:`_Halos` output) and ``anchor`` (a 0-d zero that requires a gradient
    wherever the mixer does) are inputs for the backward's sake only: every rank must run this
    backward (it relays the others' gradients, even on a rank whose own chunks pass no state and
    whose ``transitions`` and ``offsets`` need no gradient), and before the halos', never after,
    or two ranks' messages would pair up crosswise.
    """

    @staticmethod
    def forward(ctx, transitions, offsets, halos, anchor, plan: MixerPlan, group):
        ctx.plan, ctx.group = plan, group
        states = torch.zeros_like(offsets)
        outgoing = {}  # local chunk -> its state out, for a local next chunk
        next_local = dict(plan.local_links)
        works = []
        for j, source, destination in plan.order:
            chunk = plan.chunks[j]
            if source is not None:
                dist.recv(states[j], source, group)
            elif chunk.continued:
                states[j] = outgoing.pop(j)
            if not chunk.continues:
                continue
            state_out = offsets[j] + (transitions[j] @ states[j] if chunk.carries else 0)
            if destination is not None:
                state_out = state_out.contiguous()  # kept alive (in works) until sent
                works.append((dist.isend(state_out, destination, group), state_out))
            else:
                outgoing[next_local[j]] = state_out
        for work, _ in works:
            work.wait()
        ctx.save_for_backward(transitions, states)
        return states

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_states):
        transitions, states = ctx.saved_tensors
        plan, group = ctx.plan, ctx.group
        grad_transitions = torch.zeros_like(transitions)
        grad_offsets = torch.zeros_like(grad_states)
        incoming = {}  # local chunk -> the gradient of its state in, for a local chunk before
        next_local = dict(plan.local_links)
        works = []
        for j, source, destination in reversed(plan.order):
            chunk = plan.chunks[j]
            if chunk.continues:  # the gradient of its state out comes from the next chunk
                grad_out = torch.empty_like(grad_offsets[j])
                if destination is not None:
                    dist.recv(grad_out, destination, group)
                else:
                    grad_out = incoming.pop(next_local[j])
                grad_offsets[j] = grad_out
                grad_in = grad_states[j]
                if chunk.carries:
                    grad_transitions[j] = grad_out @ states[j].transpose(-1, -2)
                    grad_in = grad_in + transitions[j].transpose(-1, -2) @ grad_out
            else:
                grad_in = grad_states[j]
            if not chunk.continued:
                continue
            if source is not None:
                grad_in = grad_in.contiguous()
                works.append((dist.isend(grad_in, source, group), grad_in))
            else:
                incoming[j] = grad_in
        for work, _ in works:
            work.wait()
        return grad_transitions, grad_offsets, None, None, None, None


def _streamed_forward(module: nn.Module):
    """The forward below that passes ``module``'s state (:func:`_gated_delta_net`,
    :func:`_mamba2` or :func:`_short_convolution`) and its convolution, or None where the module
    is not one of theirs.
    """
    name = type(module).__name__
    if name in SHORT_CONVOLUTIONS and all(hasattr(module, part) for part in _SHORT_PARTS):
        return _short_convolution, module.conv
    if name in MAMBA2_MIXERS:
        if any(not hasattr(module, part) for part in _MAMBA2_PARTS) or _scan(module) is None:
            return None
        return _mamba2, module.conv1d
    if (
        name not in GATED_DELTA_NETS
        or any(not hasattr(module, part) for part in _PARTS)
        or not any(all(hasattr(module, part) for part in parts) for parts in (_SEPARATE, _FUSED))
        or _rule(module) is None
    ):
        return None
    return _gated_delta_net, module.conv1d


def streamed_mixer(module: nn.Module, bound: dict, layout: RowLayout):
    """The output of mixer ``module`` called with arguments ``bound`` on this rank's tokens, its
    state passed between the ranks (module docstring); None where it gathers instead.
    """
    found = _streamed_forward(module)
    if found is None:
        return None
    forward, convolution = found
    hidden = bound.get("hidden_states")
    if not isinstance(hidden, torch.Tensor) or any(bound.get(name) is not None for name in _READ):
        return None  # a cache or a padding mask: the gathered route reads them
    plan = mixer_plan(layout, convolution.kernel_size[0] - 1)
    if plan is None or not _agrees_with_own_forward(module, layout):
        return None
    return forward(module, hidden, layout, plan)


def _agrees_with_own_forward(module: nn.Module, layout: RowLayout) -> bool:
    """Whether the forward below computes what ``module``'s own forward does, on a few tokens of
    noise; decided once per row and class, the same on every rank (one all-reduce).
    """
    key = ("agrees", type(module))
    if key not in layout.plans:
        weight = module.out_proj.weight
        generator = torch.Generator(device=weight.device).manual_seed(0)
        hidden = torch.randn(
            (1, _PROBE_TOKENS, weight.shape[0]),  # out_proj: back to the hidden size
            generator=generator,
            device=weight.device,
        ).to(weight.dtype)
        with torch.no_grad():
            own = type(module).forward(module, hidden)
            ours = _streamed_forward(module)[0](module, hidden, None, None)
        relative = max(_PROBE_ULPS * torch.finfo(own.dtype).eps, _PROBE_RTOL)
        tolerance = relative * own.abs().max().float()
        agrees = torch.tensor(
            int(bool((ours.float() - own.float()).abs().max() <= tolerance)), device=weight.device
        )
        dist.all_reduce(agrees, op=dist.ReduceOp.MIN, group=layout.group)
        layout.plans[key] = bool(agrees.item())
        if not layout.plans[key]:
            warnings.warn(
                f"{type(module).__name__}'s forward is not the one context parallelism passes the "
                "state of (packed_ce/integrations/context_parallel/state.py): its layers gather "
                "the row's inputs instead (exact, memory of the whole row)",
                stacklevel=2,
            )
    return layout.plans[key]


def _projections(module: nn.Module, hidden: torch.Tensor):
    """The gated delta net's input projections of ``hidden`` ``(1, L, H)``: the convolution's
    input ``(L, Cd)`` (queries, keys and values side by side), the gate ``z`` ``(1, L, Hv, dv)``
    and the pre-activations ``b`` and ``a`` ``(1, L, Hv)`` of the write strength and the decay.
    Qwen3-Next's fused projections interleave the heads: the module's own
    ``fix_query_key_value_ordering`` takes them apart, as its forward does.
    """
    length = hidden.shape[1]
    if all(hasattr(module, part) for part in _SEPARATE):
        z = module.in_proj_z(hidden).reshape(1, length, -1, module.head_v_dim)
        return module.in_proj_qkv(hidden)[0], z, module.in_proj_b(hidden), module.in_proj_a(hidden)
    query, key, value, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(hidden), module.in_proj_ba(hidden)
    )
    mixed = torch.cat([part.reshape(length, -1) for part in (query, key, value)], dim=-1)
    return mixed, z, b, a


def _gated_delta_net(module, hidden, layout: RowLayout | None, plan: MixerPlan | None):
    """A gated delta net's forward (Qwen3.5's or Qwen3-Next's layout) on ``hidden``
    ``(1, L, H)``: with ``plan``, this rank's chunks of the row (halos and states from the other
    ranks); without, ``hidden`` as one conversation (the check against the module's own forward).
    """
    length = hidden.shape[1]
    key_dim, value_dim = module.key_dim, module.value_dim
    dk, dv, heads = module.head_k_dim, module.head_v_dim, module.num_v_heads
    mixed, z, b, a = _projections(module, hidden)  # (L, Cd), (1, L, Hv, dv), (1, L, Hv) twice
    beta = b.sigmoid()
    # as the family computes it: float32, so that exp(A_log) cannot overflow in half precision
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    rule = _rule(module)

    def piece(convolved, start: int, end: int, continued: bool, last: bool):
        query, key, value = torch.split(convolved, [key_dim, key_dim, value_dim], dim=-1)
        query, key = query.reshape(1, end - start, -1, dk), key.reshape(1, end - start, -1, dk)
        value = value.reshape(1, end - start, -1, dv)
        initial = None
        if continued:  # (module docstring) [V | 0] from [0 | I]: O_0 and U, B and M
            value = torch.cat((value, value.new_zeros(value.shape[:-1] + (dk,))), -1)
            identity = torch.eye(dk, device=hidden.device).expand(1, heads, dk, dk)
            initial = torch.cat((identity.new_zeros(1, heads, dk, dv), identity), -1)
        out, final = rule(
            query,
            key,
            value,
            g=g[:, start:end],
            beta=beta[:, start:end],
            initial_state=initial,
            output_final_state=last,
            use_qk_l2norm_in_kernel=True,
        )
        states = (final[0, ..., :dv], final[0, ..., dv:]) if last else None  # B, M
        return out[..., :dv], out[..., dv:] if continued else None, states

    core = _stream_pieces(module, hidden, mixed, layout, plan, piece, (heads, dk, dv))
    core = module.norm(core.reshape(-1, dv), z.reshape(-1, dv)).reshape(1, length, -1)
    return module.out_proj(core)


def _mamba2(module, hidden, layout: RowLayout | None, plan: MixerPlan | None):
    """A Mamba 2 mixer's forward on ``hidden`` ``(1, L, H)``: with ``plan``, this rank's chunks of
    the row (halos and states from the other ranks); without, ``hidden`` as one conversation (the
    check against the module's own forward).
    """
    length = hidden.shape[1]
    heads, head_dim, state_size = module.num_heads, module.head_dim, module.ssm_state_size
    groups = module.n_groups
    gate, mixed, dt = module.in_proj(hidden).split(
        [module.intermediate_size, module.conv_dim, heads], dim=-1
    )  # (1, L, I), (1, L, Cd), (1, L, Hm)
    decay = -torch.exp(module.A_log.float())  # (Hm,) A, as the family computes it
    scan = _scan(module)

    def piece(convolved, start: int, end: int, continued: bool, last: bool):
        size = end - start
        x, b, c = torch.split(
            convolved,
            [module.intermediate_size, groups * state_size, groups * state_size],
            dim=-1,
        )
        x = x.reshape(1, size, heads, head_dim)
        initial = None
        if continued:  # (module docstring) N zero rows of x whose initial state is I
            x = torch.cat((x, x.new_zeros(1, size, heads, state_size)), -1)
            identity = torch.eye(state_size, device=hidden.device).expand(
                1, heads, state_size, state_size
            )
            initial = torch.cat((identity.new_zeros(1, heads, head_dim, state_size), identity), -2)
        result = scan(
            x,
            dt[:, start:end],
            decay,
            b.reshape(1, size, groups, state_size),
            c.reshape(1, size, groups, state_size),
            chunk_size=module.chunk_size,
            D=module.D,
            dt_bias=module.dt_bias,
            dt_softplus=True,
            initial_states=initial,
            dt_limit=module.time_step_limit,
            return_final_states=last,
        )
        out, final = result if last else (result, None)
        # the chain carries h^T: B = b^T (Hm, N, P), M = T^T
        states = (final[0, :, :head_dim].mT, final[0, :, head_dim:].mT) if last else None
        return out[..., :head_dim], out[..., head_dim:] if continued else None, states

    scanned = _stream_pieces(
        module, hidden, mixed[0], layout, plan, piece, (heads, state_size, head_dim)
    )
    return module.out_proj(module.norm(scanned.reshape(1, length, -1), gate).to(hidden.dtype))


def _stream_pieces(module, hidden, mixed, layout, plan, piece, state_shape):
    """The recurrent mixer's output ``(1, L, H, v)`` on this rank's chunks of the row (or on
    ``hidden`` as one conversation without ``plan``): each conversation piece convolved (after
    its halo where it continues one), run by ``piece``, and corrected by the state passed in.

    Args:
        mixed: ``(L, Cd)`` the convolution's inputs.
        piece: ``(convolved (l, Cd), start, end, continued, last) -> (out (1, l, H, v),
            U (1, l, H, k) where continued else None, (B (H, k, v), M (H, k, k)) where last else
            None)``: the family's kernel on one piece (module docstring).
        state_shape: ``(H, k, v)`` of the state the chain carries.
    """
    heads, k, v = state_shape
    chunks, halos = _chunks_and_halos(mixed, layout, plan, module.conv1d.kernel_size[0] - 1)
    state_dtype = torch.promote_types(hidden.dtype, torch.float32)  # the kernel's, at least
    zeros = hidden.new_zeros((heads, k, k + v), dtype=state_dtype)
    outputs, corrections, transitions, offsets = [], [], [], []
    for j, chunk in enumerate(chunks):
        transition, offset = zeros[..., :k], zeros[..., k:]  # where the chunk passes nothing on
        for index, (start, end) in enumerate(chunk.segments):
            inputs = mixed[start:end]
            continued = chunk.continued and index == 0
            if continued:  # the convolution reads the previous chunk's last inputs first
                inputs = torch.cat((halos[j], inputs))
            last = index == len(chunk.segments) - 1 and chunk.continues
            convolved = _convolve(module, inputs)[-(end - start) :]
            out, reads, states = piece(convolved, start, end, continued, last)
            if continued:
                corrections.append((len(outputs), j, reads))
            if last:
                offset = states[0].to(state_dtype)
                if chunk.carries:
                    transition = states[1].to(state_dtype)
            outputs.append(out)
        transitions.append(transition)
        offsets.append(offset)
    if plan is not None:  # every rank walks the chain: its chunks may pass a state on
        _corrected(module, hidden, outputs, corrections, transitions, offsets, halos, layout, plan)
    return torch.cat(outputs, dim=1)


def _corrected(module, hidden, outputs, corrections, transitions, offsets, halos, layout, plan):
    """Every chunk's state in from the chain (:class:`_StateChain`), and the outputs of the
    segments that continue a conversation corrected in place by it: ``O = O_0 + U S_in``.

    Args:
        outputs: the segments' outputs ``(1, l, H, v)``, changed in place (list items).
        corrections: ``(position in outputs, chunk, U (1, l, H, k))`` for each continued segment.
        transitions, offsets: per local chunk ``M`` ``(H, k, k)`` and ``B`` ``(H, k, v)`` (zeros
            where the chunk passes nothing on), in the state's dtype.
        halos: the convolution's exchanged halos (an input of the chain's backward).
    """
    # the same on every rank: the model's parameters and the layer's input alike
    training = torch.is_grad_enabled() and (
        hidden.requires_grad or any(p.requires_grad for p in module.parameters())
    )
    anchor = torch.zeros((), device=hidden.device, requires_grad=training)
    states = _StateChain.apply(
        torch.stack(transitions), torch.stack(offsets), halos, anchor, plan, layout.group
    )
    for position, j, reads in corrections:
        correction = torch.einsum("blhk,hkv->blhv", reads.to(states.dtype), states[j])
        outputs[position] = (outputs[position] + correction).to(outputs[position].dtype)
    # the chain's backward runs on every rank, one whose chunks read no state included
    # (_StateChain): its states join the output with weight 0
    outputs[0] = outputs[0] + 0 * states.sum().to(outputs[0].dtype)


def _short_convolution(module, hidden, layout: RowLayout | None, plan: MixerPlan | None):
    """LFM2's short convolution on ``hidden`` ``(1, L, H)``: ``out_proj(C * conv(B * x))`` with
    ``B, C, x = in_proj(hidden)``; with ``plan``, this rank's chunks of the row, each continued
    conversation's convolution reading the previous chunk's last ``K - 1`` values of ``B x`` (its
    halo); without, ``hidden`` as one conversation (the check against the module's own forward).
    """
    gate, out_gate, values = module.in_proj(hidden)[0].chunk(3, dim=-1)  # (L, H) each
    gated = gate * values
    reach = module.conv.kernel_size[0] - 1
    chunks, halos = _chunks_and_halos(gated, layout, plan, reach)
    outputs = []
    for j, chunk in enumerate(chunks):
        for index, (start, end) in enumerate(chunk.segments):
            inputs = gated[start:end]
            if chunk.continued and index == 0:  # the previous chunk's last inputs first
                inputs = torch.cat((halos[j], inputs))
            outputs.append(_depthwise(module.conv, inputs)[-(end - start) :])
    convolved = torch.cat(outputs)
    if halos is not None:
        # the halos' backward is an exchange every rank joins, one whose chunks read none too
        convolved = convolved + 0 * halos.sum().to(convolved.dtype)
    return module.out_proj(out_gate * convolved)[None]


def _chunks_and_halos(inputs, layout: RowLayout | None, plan: MixerPlan | None, reach: int):
    """The chunks the convolution of ``inputs`` ``(L, C)`` runs over, and each chunk's halo
    ``(m, K - 1, C)``: the previous row chunk's last ``reach`` inputs, from whichever rank holds
    it (zeros where they are another conversation's). Without ``plan``, ``inputs`` are one
    conversation: one chunk, no halo.
    """
    if plan is None:
        return [ChunkPlan([(0, inputs.shape[0])], False, False, False)], None
    chunks = plan.chunks
    size = inputs.shape[0] // len(chunks)
    tails = inputs.view(len(chunks), size, -1)[:, size - reach :]  # (m, K - 1, C)
    tails = tails * _same_conversation(layout, plan, size, reach)[..., None]
    return chunks, _Halos.apply(tails, plan, layout.group)


def _same_conversation(layout: RowLayout, plan: MixerPlan, size: int, reach: int) -> torch.Tensor:
    """``(m, K - 1)`` 1 where a chunk's tail token is in the conversation of the row token after
    the chunk (the halo the next chunk reads), else 0; planned on the host once per row.
    """
    key = ("tails", reach)
    if key not in layout.plans:
        documents = layout.row_documents()
        rows = np.asarray(layout.chunks[layout.rank])[:, None] * size + np.arange(
            size - reach, size
        )
        after = np.minimum((rows[:, -1] + 1), documents.size - 1)
        keep = documents[rows] == documents[after][:, None]
        layout.plans[key] = torch.from_numpy(keep).to(layout.queries.device)
    return layout.plans[key]


def _rule(module: nn.Module):
    """The family's chunked gated delta rule (transformers' reference, or the kernel it dispatches
    to), which takes an initial state and returns the final one; None if its module has none.
    """
    return getattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule", None)


def _scan(module: nn.Module):
    """The family's chunked Mamba 2 scan (transformers' reference, or the kernel it dispatches
    to), which takes initial states and returns the final ones; None if its module has none.
    """
    return getattr(sys.modules[type(module).__module__], "mamba2_chunk_scan", None)


def _depthwise(conv: nn.Conv1d, inputs: torch.Tensor) -> torch.Tensor:
    """The causal depthwise convolution ``conv`` on ``inputs`` ``(l, C)`` -> ``(l, C)`` in the
    convolution's dtype (what transformers' reference ``causal_conv1d_fn`` computes).
    """
    weight = conv.weight  # (C, 1, K)
    out = F.conv1d(
        inputs.T[None].to(weight.dtype),
        weight,
        conv.bias,
        padding=weight.shape[-1] - 1,
        groups=weight.shape[0],
    )[..., : inputs.shape[0]]
    return out[0].T


def _convolve(module: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """A mixer's ``conv1d`` and activation on ``inputs`` ``(l, Cd)`` -> ``(l, Cd)``."""
    from transformers.activations import ACT2FN

    return ACT2FN[module.activation](_depthwise(module.conv1d, inputs)).to(inputs.dtype)
