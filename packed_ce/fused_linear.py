"""``fused_linear_cross_entropy``: the LM head and the packed loss without the ``(N, V)`` logits
(the chunked algorithm: :mod:`packed_ce.chunks`).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .chunks import chunked_loss
from .options import ChunkOptions, LossOptions, changed_fields, split_keywords
from .pipeline import run_loss
from .runtime import resolve_backend
from .validation import allowed_dtypes, check_linear, check_tensor, checked_boundaries


def _autocast(hidden, weight, bias):
    """The casts ``F.linear`` gets under ``torch.autocast``: float32 to the autocast dtype."""
    device_type = hidden.device.type
    # meta tensors (shape inference) have no autocast, and asking about it raises
    if device_type == "meta" or not torch.is_autocast_enabled(device_type):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(
        t.to(dtype) if t is not None and t.dtype == torch.float32 else t
        for t in (hidden, weight, bias)
    )


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    num_items_in_batch: int | torch.Tensor | None = None,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    options: LossOptions | None = None,
    chunk_options: ChunkOptions | None = None,
    **keywords,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`packed_ce.cross_entropy` of ``hidden @ weight.T + bias``, never forming the logits.

    The value and gradients (``hidden``, ``weight``, ``bias``) of
    ``cross_entropy(F.linear(hidden, weight, bias), labels, ...)``, exactly, for every option,
    with one chunk of ``chunk_size`` rows of logits at a time (:mod:`packed_ce.chunks`).

    Args:
        hidden: ``(N, H)`` or ``(B, T, H)``, float32/bfloat16/float16 (float64 too with
            ``backend="torch"``); under ``torch.autocast`` float32 inputs are cast to the
            autocast dtype, as ``F.linear`` would.
        weight: ``(V, H)``, the dtype and device of ``hidden`` (an ``lm_head.weight``).
        labels: ``(N,)`` or ``(B, T)`` integer class indices or ``ignore_index``.
        bias: ``(V,)`` or None.
        cu_seqlens, position_ids, num_items_in_batch, seq_targets, seq_weights: as in
            :func:`packed_ce.cross_entropy` (the weights ``w_t`` and the normaliser ``D``).
        options, chunk_options, **keywords: a :class:`packed_ce.LossOptions`, a
            :class:`packed_ce.ChunkOptions` and/or their fields (``inplace_backward`` has no
            effect: the chunk buffer always takes the gradient in place).

    Returns:
        As :func:`packed_ce.cross_entropy`; gradients have their inputs' dtypes.

    Raises:
        As :func:`packed_ce.cross_entropy`, and for mismatched ``hidden``/``weight``/``bias``;
        RuntimeError for a second backward or ``create_graph=True`` on either backend.

    Example:
        >>> import torch, packed_ce
        >>> hidden = torch.zeros(5, 8)                      # zero logits: every l_t = log 4
        >>> weight = torch.randn(4, 8, requires_grad=True)
        >>> labels = torch.tensor([1, 2, 3, -100, 0])
        >>> cu_seqlens = torch.tensor([0, 3, 5], dtype=torch.int32)
        >>> loss = packed_ce.fused_linear_cross_entropy(
        ...     hidden, weight, labels, cu_seqlens=cu_seqlens, is_packed=True)
        >>> loss
        tensor(1.3863, grad_fn=<FusedLinearCrossEntropyFunctionBackward>)
    """
    options, chunk_options = split_keywords(
        keywords, options, chunked=True, chunk_options=chunk_options
    )
    boundaries = checked_boundaries(
        cu_seqlens, position_ids, num_items_in_batch, seq_targets, seq_weights
    )
    return fused_linear_call(hidden, weight, labels, bias, boundaries, options, chunk_options)


def fused_linear_call(hidden, weight, labels, bias, boundaries, options, chunk_options):
    """:func:`fused_linear_cross_entropy` with its keywords as objects."""
    check_tensor("hidden", hidden)
    check_tensor("weight", weight)
    check_tensor("bias", bias, optional=True)
    backend = resolve_backend(options.backend, hidden)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    check_linear(hidden, weight, bias, allowed_dtypes(backend))
    rows = hidden.reshape(math.prod(hidden.shape[:-1]), hidden.shape[-1])  # H = 0 too
    return run_loss(
        lambda prepared, stats: chunked_loss(
            rows,
            weight,
            bias,
            prepared,
            backend=backend,
            options=options,
            chunk_options=chunk_options,
            stats=stats,
        ),
        labels,
        boundaries,
        options,
        backend=backend,
        logits_shape=torch.Size((*hidden.shape[:-1], weight.shape[0])),
        dtype=hidden.dtype,
        device=hidden.device,
        name="hidden @ weight.T",
    )


class FusedLinearPackedCrossEntropyLoss(nn.Module):
    """Module form of :func:`fused_linear_cross_entropy`: holds the keyword options.

    Args:
        **options: the fields of :class:`packed_ce.LossOptions` and :class:`packed_ce.ChunkOptions`;
            the tensors go to ``forward``.

    Example:
        >>> loss_fn = FusedLinearPackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> loss_fn
        FusedLinearPackedCrossEntropyLoss(is_packed=True, shift=True)
        >>> loss = loss_fn(hidden, model.lm_head.weight, batch["labels"],
        ...                cu_seqlens=batch["cu_seqlens"])  # doctest: +SKIP
    """

    def __init__(self, **options):
        super().__init__()
        self.options, self.chunk_options = split_keywords(options, chunked=True)

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        bias: torch.Tensor | None = None,  # after the contract's arguments: an extension
        *,
        seq_targets: torch.Tensor | None = None,
        seq_weights: torch.Tensor | None = None,
    ):
        boundaries = checked_boundaries(
            cu_seqlens, position_ids, num_items_in_batch, seq_targets, seq_weights
        )
        return fused_linear_call(
            hidden, weight, labels, bias, boundaries, self.options, self.chunk_options
        )

    def extra_repr(self) -> str:
        return changed_fields(self.options, self.chunk_options)
