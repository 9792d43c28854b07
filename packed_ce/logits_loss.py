"""``packed_ce.cross_entropy`` and ``PackedCrossEntropyLoss``: the public loss on logits."""

from __future__ import annotations

import functools

import torch
from torch import nn

from .options import Boundaries, LossOptions, changed_fields, split_keywords
from .pipeline import run_loss
from .reference import loss_from_targets, token_stats_rows
from .runtime import resolve_backend
from .validation import check_tensor, checked_boundaries


def cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    options: LossOptions | None = None,
    **keywords,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Cross entropy that can average per packed sequence instead of per token.

    ``sum_t w_t l_t`` ("sum"), over ``D`` ("mean"), or ``w_t l_t`` per token ("none"), weighted per
    token or per sequence (``is_packed``): docs/reference.md, "The loss, exactly".

    Args:
        logits: ``(N, V)`` or ``(B, T, V)``, float32/bfloat16/float16 (float64 with
            ``backend="torch"``).
        labels: ``(N,)`` or ``(B, T)`` integer class indices or ``ignore_index``.
        cu_seqlens: ``(S+1,)`` int32/int64, ``0 = c_0 <= ... <= c_S = N``; sequence ``s`` is
            tokens ``[c_s, c_{s+1})``. position_ids: instead, ``N`` entries (a sequence starts
            wherever ``position_ids[t] != position_ids[t-1] + 1``).
        num_items_in_batch: the global ``D`` (int or 0-d tensor) of an optimiser step that spans
            micro-batches or processes (:func:`packed_ce.count_normaliser`).
        seq_targets: ``(S,)`` integer, the targets of each sequence's whole conversation.
            seq_weights: ``(S,)`` float, each conversation's weight, any scale. Both aligned with
            ``cu_seqlens`` (:class:`packed_ce.options.Boundaries`).
        options, **keywords: a :class:`packed_ce.LossOptions` and/or its fields (explained there).

    Returns:
        float32 loss (float64 for float64 logits on the torch backend), 0-d or ``labels``-shaped
        ("none"); then ``z_loss`` with ``return_z_loss``, then a :class:`packed_ce.TokenStats`
        with ``return_token_stats``. The gradient has the logits' dtype.

    Raises:
        ValueError / TypeError naming the argument (when values are checked:
            :func:`packed_ce.check_pending`); RuntimeError for a second backward or
            ``create_graph=True`` on the Triton backend (see docs/reference.md).

    Example:
        >>> import torch, packed_ce
        >>> logits = torch.zeros(5, 4)                       # uniform: every l_t = log 4
        >>> labels = torch.tensor([1, 2, 3, -100, 0])
        >>> cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> packed_ce.cross_entropy(logits, labels, cu_seqlens=cu_seqlens, is_packed=True)
        tensor(1.3863)
    """
    options, _ = split_keywords(keywords, options)
    boundaries = checked_boundaries(
        cu_seqlens, position_ids, num_items_in_batch, seq_targets, seq_weights
    )
    return cross_entropy_call(logits, labels, boundaries, options)


def cross_entropy_call(
    logits: torch.Tensor, labels: torch.Tensor, boundaries: Boundaries, options: LossOptions
):
    """:func:`cross_entropy` with its keywords as objects."""
    check_tensor("logits", logits)
    backend = resolve_backend(options.backend, logits)
    if options.inplace_backward and not logits.is_contiguous():
        # an overlapping view would mix rows' gradients; a strided one is copied (unwritten)
        raise ValueError(
            "inplace_backward=True writes the gradient into the storage of logits, which must "
            f"be contiguous (got shape {tuple(logits.shape)}, strides {logits.stride()}): "
            "pass logits.contiguous() or inplace_backward=False"
        )
    if backend == "torch":
        run = functools.partial(_torch_rows_loss, logits, options)
    else:
        from .kernels.cross_entropy import triton_cross_entropy

        # a partial, not a closure: run_loss calls the kernel's entry point directly
        run = functools.partial(triton_cross_entropy, logits, options)
    return run_loss(
        run,
        labels,
        boundaries,
        options,
        backend=backend,
        logits_shape=logits.shape,
        dtype=logits.dtype,
        device=logits.device,
    )


def _torch_rows_loss(logits: torch.Tensor, options: LossOptions, prepared, stats):
    """The ``run`` of :func:`packed_ce.pipeline.run_loss` on the PyTorch reference."""
    if options.return_token_stats:  # its own pass over (N, V): only when asked for
        flat = logits.reshape(-1, logits.shape[-1])
        stats[:, :2] = token_stats_rows(flat, prepared.targets, options)
    return loss_from_targets(logits, prepared, options, stats)


class PackedCrossEntropyLoss(nn.Module):
    """Module form of :func:`cross_entropy`: holds the keyword options.

    Args:
        **options: the fields of :class:`packed_ce.LossOptions`, checked here, once.

    Example:
        >>> loss_fn = PackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> loss_fn
        PackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> logits = torch.zeros(5, 4)                       # uniform: every l_t = log 4
        >>> labels = torch.tensor([-100, 1, 2, -100, 3])
        >>> loss_fn(logits, labels, cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
        tensor(1.3863)
    """

    def __init__(self, **options):
        super().__init__()
        self.options, _ = split_keywords(options)

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        *,
        seq_targets: torch.Tensor | None = None,
        seq_weights: torch.Tensor | None = None,
    ):
        boundaries = checked_boundaries(
            cu_seqlens, position_ids, num_items_in_batch, seq_targets, seq_weights
        )
        return cross_entropy_call(logits, labels, boundaries, self.options)

    def extra_repr(self) -> str:
        return changed_fields(self.options)
