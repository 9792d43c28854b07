"""The one collective of a context-parallel layer: every rank's tokens, rank-major.

Forward: one all-gather of the ranks' ``(L, ...)`` tokens into ``(W L, ...)`` (the layout's
:class:`~.layout.RowLayout` maps each entry to its row token). Backward: one reduce-scatter, every
rank's outputs having read every rank's tokens, so the parameter gradients summed over the ranks
are one process's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import RowLayout


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, layout: RowLayout) -> torch.Tensor:
        ctx.layout = layout
        local = local.contiguous()
        gathered = local.new_empty((layout.world_size * local.shape[0], *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local, group=layout.group)
        return gathered

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layout = ctx.layout
        # a new contiguous buffer: a gradient may arrive as a permuted view, and NCCL's
        # reduce-scatter splits the raw memory, not the first dimension (a buffer keeping a view's
        # strides came back mixed between the ranks)
        grad = grad.contiguous()
        local = grad.shape[0] // layout.world_size
        if dist.get_backend(layout.group) == "nccl":
            own = grad.new_empty((local, *grad.shape[1:]))
            dist.reduce_scatter_tensor(own, grad, group=layout.group)
        else:  # gloo has no reduce-scatter: sum everything, keep this rank's slice
            dist.all_reduce(grad, group=layout.group)
            own = grad[layout.rank * local : (layout.rank + 1) * local]
        return own, None  # no gradient for the layout


def gather_tokens(local: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """``local`` ``(L, ...)`` of every rank as ``(W L, ...)``, rank-major; differentiable."""
    return _GatherTokens.apply(local, layout)
