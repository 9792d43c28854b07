"""Attention over the whole row with only this rank's keys and values held at a time: a ring.

Each rank holds ``L`` of the row's ``T = W L`` tokens. The keys and values travel around the ranks:
at step ``i`` of ``W`` rank ``r`` holds rank ``(r - i) mod W``'s, computes what its queries see of
them (``blocks.py``: the blocks the plan leaves, none where a conversation boundary, causality or
the window rules a step out) and folds the result into each query's running output by the
log-sum-exp (``blocks.merge``), while the next step's keys and values are already on their way
(``isend``/``irecv``, awaited after the step's attention). The backward runs the same ring again:
the keys' and values' gradients travel with them, each rank adding its queries' share, and arrive
at their owner after the last step. No rank holds more than two ranks' keys and values (the
step's and the next one's) and one gradient in transit: memory follows ``L``, not ``T``.

Messages between two ranks are matched in the order they are posted (NCCL ignores tags), and
every rank posts the same sequence: per step, the keys and values, then the gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .blocks import DenseSteps, FlexSteps
from .layout import DENSE_MASK_ELEMENTS, RowLayout


class _Ring:
    """The ranks of a group in a ring: each sends to the next and receives from the one before."""

    def __init__(self, group, rank: int, world_size: int):
        self.group = group
        world = dist.group.WORLD if group is None else group
        self.next = dist.get_global_rank(world, (rank + 1) % world_size)
        self.previous = dist.get_global_rank(world, (rank - 1) % world_size)

    def pass_on(self, tensor: torch.Tensor) -> _Transfer:
        """Sends ``tensor`` (contiguous) to the next rank and receives the previous rank's."""
        received = torch.empty_like(tensor)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, tensor, self.next, self.group),
                dist.P2POp(dist.irecv, received, self.previous, self.group),
            ]
        )
        return _Transfer(works, received, tensor)


class _Transfer:
    """A transfer in flight; :meth:`wait` gives the tensor received."""

    def __init__(self, works: list, received: torch.Tensor, sent: torch.Tensor):
        # the tensor sent is kept alive until the send completes
        self.works, self.received, self.sent = works, received, sent

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.sent = None
        return self.received


def _steps(layout: RowLayout, window, scale: float, softcap, device: torch.device):
    """Dense blocks on the CPU and for short rows; flex attention per step on CUDA beyond
    :data:`DENSE_MASK_ELEMENTS` pairs per rank.
    """
    local = layout.local
    if device.type == "cuda" and local * local * layout.world_size > DENSE_MASK_ELEMENTS:
        return FlexSteps(layout, window, scale, softcap, device)
    return DenseSteps(layout, window, scale, softcap)


class _RingAttention(torch.autograd.Function):
    """``(out, lse)`` of this rank's queries over the row (module docstring).

    Forward inputs: ``query`` ``(Hkv, G, L, D)`` (grouped by key head), ``key``, ``value``
    ``(Hkv, L, D)``, in the model's dtype; outputs ``out`` ``(Hkv, G, L, D)`` and ``lse``
    ``(Hkv, G, L)`` in the compute dtype (float32 at least). Only this rank's tensors and the
    outputs are saved.
    """

    @staticmethod
    def forward(ctx, query, key, value, steps, ring, compute_dtype):
        world = steps.layout.world_size
        dense = isinstance(steps, DenseSteps)
        cast = (lambda t: t.to(compute_dtype)) if dense else (lambda t: t)
        kv = torch.stack((key, value))  # (2, Hkv, L, D): one message per step
        out = query.new_zeros(query.shape, dtype=compute_dtype)
        lse = query.new_full(query.shape[:-1], float("-inf"), dtype=compute_dtype)
        grouped = cast(query)
        for step in range(world):
            transfer = ring.pass_on(kv) if step < world - 1 else None
            if steps.active(step):
                steps.forward(step, grouped, cast(kv), out, lse)
            if transfer is not None:
                kv = transfer.wait()
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.steps, ctx.ring, ctx.cast = steps, ring, cast
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        steps, ring, cast = ctx.steps, ctx.ring, ctx.cast
        world = steps.layout.world_size
        grad_out = grad_out.to(out.dtype).contiguous()
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O) - dlse: blocks.py
        if grad_lse is not None:
            delta = delta - grad_lse.to(out.dtype)
        grouped = cast(query)
        grad_query = torch.zeros_like(out)
        kv = torch.stack((key, value))
        arriving = None  # the accumulated gradient of the next step's keys and values
        for step in range(world):
            transfer = ring.pass_on(kv) if step < world - 1 else None
            grad_kv = out.new_zeros(kv.shape)
            if steps.active(step):
                steps.backward(step, grouped, cast(kv), lse, grad_out, delta, grad_query, grad_kv)
            if arriving is not None:  # the earlier ranks' share of this step's keys and values
                grad_kv += arriving.wait()
            arriving = ring.pass_on(grad_kv) if world > 1 else None
            if transfer is not None:
                kv = transfer.wait()
        # after the last step the gradient of this rank's own keys and values arrives
        own = arriving.wait() if arriving is not None else grad_kv
        return (
            grad_query.to(query.dtype),
            own[0].to(key.dtype),
            own[1].to(value.dtype),
            None,
            None,
            None,
        )


def ring_attention(
    query: torch.Tensor,  # (1, Hq, L, D)
    key: torch.Tensor,  # (1, Hkv, L, D)
    value: torch.Tensor,  # (1, Hkv, L, D)
    layout: RowLayout,
    window: int | None,
    scale: float,
    softcap: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's queries over the whole row's keys (each query within its conversation,
    causal, within ``window``), the keys and values streamed around the ranks; differentiable.

    Returns:
        ``out`` ``(1, Hq, L, D)`` and its natural-log ``lse`` ``(1, Hq, L)``, both in float32 at
        least (float64 for float64 inputs).
    """
    heads, local, dim = query.shape[1:]
    kv_heads = key.shape[1]
    compute_dtype = torch.promote_types(query.dtype, torch.float32)
    steps = _steps(layout, window, scale, softcap, query.device)
    ring = _Ring(layout.group, layout.rank, layout.world_size) if layout.world_size > 1 else None
    grouped = query[0].reshape(kv_heads, heads // kv_heads, local, dim)
    out, lse = _RingAttention.apply(grouped, key[0], value[0], steps, ring, compute_dtype)
    return out.view(1, heads, local, dim), lse.view(1, heads, local)
