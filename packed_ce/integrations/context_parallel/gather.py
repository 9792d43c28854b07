"""The row's tokens gathered from every rank, rank-major: what a hybrid mixer that cannot pass its
state (``state.py``) reads.

Forward: one all-gather of the ranks' ``(L, ...)`` tokens into ``(W L, ...)`` (the row layout,
``layout.py``, maps each entry to its row token). Backward: one reduce-scatter, every
rank's outputs having read every rank's tokens, so the parameter gradients summed over the ranks
are one process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, group, rank: int, world_size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.world_size = group, rank, world_size
        local = local.contiguous()
        gathered = local.new_empty((world_size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # a new contiguous buffer: a gradient may arrive as a permuted view, and NCCL's
        # reduce-scatter splits the raw memory, not the first dimension (a buffer keeping a view's
        # strides came back mixed between the ranks)
        grad = grad.contiguous()
        local = grad.shape[0] // ctx.world_size
        if dist.get_backend(ctx.group) == "nccl":
            own = grad.new_empty((local, *grad.shape[1:]))
            dist.reduce_scatter_tensor(own, grad, group=ctx.group)
        else:  # gloo has no reduce-scatter: sum everything, keep this rank's slice
            dist.all_reduce(grad, group=ctx.group)
            own = grad[ctx.rank * local : (ctx.rank + 1) * local]
        return own, None, None, None  # the gradient of local only


def gather_tokens(local: torch.Tensor, group, rank: int, world_size: int) -> torch.Tensor:
    """``local`` ``(L, ...)`` of every rank of ``group`` as ``(W L, ...)``, rank-major;
    differentiable.
    """
    return _GatherTokens.apply(local, group, rank, world_size)
