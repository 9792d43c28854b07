"""Targets and per-token weights from labels and ``cu_seqlens`` in one launch, and the weights
divided by the normaliser ``D`` in one more.

The PyTorch path (:mod:`packed_ce.targets`) takes ~25 small launches, whose host cost shows at
small shapes and after every host sync; here one program per sequence counts and writes its
targets and weights.

Dimensions: N tokens, S sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import interpreting


@triton.heuristics(
    {
        "HAS_SEQ_TARGETS": lambda args: args["seq_targets_ptr"] is not None,
        "HAS_SEQ_WEIGHTS": lambda args: args["seq_weights_ptr"] is not None,
    }
)
@triton.jit(do_not_specialize=["N"])  # N varies with every batch: one compile, not one per N % 16
def _sequence_targets_kernel(
    # data ptrs
    labels_ptr,  # (N,) int64 labels, aligned with the inputs if SHIFT
    cu_seqlens_ptr,  # (S+1,) int32/int64 sequence boundaries
    seq_targets_ptr,  # (S,) int m_s, targets of each sequence's whole conversation, or None
    seq_weights_ptr,  # (S,) float a_s, each sequence's weight, or None
    targets_ptr,  # (N,) int64 out: the class row t is scored against, or ignore_index
    weight_ptr,  # (N,) fp32 out: w_t (a_s / m_s if IS_PACKED, else a_s) for a target, else 0
    num_items_ptr,  # () fp32 zero-initialised, atomically increased: D before num_items_in_batch
    # shapes
    N,
    # scalars
    ignore_index,
    # switches
    SHIFT: tl.constexpr,
    IS_PACKED: tl.constexpr,
    HAS_SEQ_TARGETS: tl.constexpr,
    HAS_SEQ_WEIGHTS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    # cu_seqlens is range-checked on the host unless tracing; clamping keeps a malformed one
    # from reading or writing out of bounds there.
    start = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + s).to(tl.int64), 0), N)
    end = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + s + 1).to(tl.int64), start), N)
    offsets = tl.arange(0, BLOCK)

    # pass 1: n_s, the targets of the sequence
    count = tl.zeros((), tl.int32)
    for block_start in range(start, end, BLOCK):
        t = block_start + offsets
        if SHIFT:  # the target of t is label t+1 of the same sequence: never across a boundary
            y = tl.load(labels_ptr + t + 1, mask=t + 1 < end, other=ignore_index)
        else:
            y = tl.load(labels_ptr + t, mask=t < end, other=ignore_index)
        count += tl.sum(((y != ignore_index) & (t < end)).to(tl.int32), 0)

    # w = a_s / m_s per target, and this sequence's share of D = sum_s a_s * n_s / m_s
    if IS_PACKED:
        if HAS_SEQ_TARGETS:
            # >= 1 on the host unless validation is off: clamped as the PyTorch path does
            whole = tl.maximum(tl.load(seq_targets_ptr + s).to(tl.int64), 1).to(tl.float32)
            w = 1.0 / whole
            share = count.to(tl.float32) * w
        else:
            w = 1.0 / tl.maximum(count, 1).to(tl.float32)
            share = (count > 0).to(tl.float32)
    else:
        w = 1.0
        share = count.to(tl.float32)
    if HAS_SEQ_WEIGHTS:
        a = tl.load(seq_weights_ptr + s).to(tl.float32)
        w = a * w
        share = a * share

    # pass 2 (the sequence's labels again, from L1/L2): targets and weights
    for block_start in range(start, end, BLOCK):
        t = block_start + offsets
        if SHIFT:
            y = tl.load(labels_ptr + t + 1, mask=t + 1 < end, other=ignore_index)
        else:
            y = tl.load(labels_ptr + t, mask=t < end, other=ignore_index)
        tl.store(targets_ptr + t, y, mask=t < end)
        tl.store(weight_ptr + t, tl.where(y != ignore_index, w, 0.0), mask=t < end)

    tl.atomic_add(num_items_ptr, share)


def sequence_targets(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
    *,
    is_packed: bool,
    shift: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets, unnormalised weights and the default normaliser ``D``.

    Args:
        labels: ``(N,)`` int64 (flattened). cu_seqlens: ``(S+1,)`` int32/int64.
        seq_targets: ``(S,)`` integer ``m_s`` or None (each sequence's own count ``n_s``).
        seq_weights: ``(S,)`` float ``a_s`` or None (1).

    Returns:
        ``targets`` ``(N,)`` int64, ``weight`` ``(N,)`` fp32 (``w_t``, docs/reference.md "The loss,
        exactly") and ``num_items`` ``()`` fp32: the weight mass ``sum_s a_s n_s / m_s``
        (``is_packed``) or ``sum_s a_s n_s``; without ``seq_targets`` the ``n_s / m_s`` are the
        exact 0 or 1.
    """
    n = labels.numel()
    # Filled, not empty: tokens outside every sequence (only with a malformed cu_seqlens while
    # tracing) must still be "no target".
    targets = torch.full((n,), ignore_index, dtype=torch.int64, device=labels.device)
    weight = torch.zeros(n, dtype=torch.float32, device=labels.device)
    num_items = torch.zeros((), dtype=torch.float32, device=labels.device)
    sequences = cu_seqlens.numel() - 1
    if n == 0 or sequences <= 0:
        return targets, weight, num_items
    # The interpreter runs blocks as numpy arrays: small blocks exercise the loops at test sizes.
    block = 64 if interpreting() else 1024
    _sequence_targets_kernel[(sequences,)](
        labels_ptr=labels,
        cu_seqlens_ptr=cu_seqlens.contiguous(),  # read as a dense (S+1,) array
        seq_targets_ptr=None if seq_targets is None else seq_targets.contiguous(),
        seq_weights_ptr=None if seq_weights is None else seq_weights.detach().contiguous(),
        targets_ptr=targets,
        weight_ptr=weight,
        num_items_ptr=num_items,
        N=n,
        ignore_index=ignore_index,
        SHIFT=shift,
        IS_PACKED=is_packed,
        BLOCK=block,
        num_warps=4,
    )
    return targets, weight, num_items


@triton.jit(do_not_specialize=["N"])  # N varies with every batch: one compile, not one per N % 16
def _normalise_kernel(
    weight_ptr,  # (N,) fp32 w_t
    count_ptr,  # () D, any real dtype
    coef_ptr,  # (N,) fp32 out: w_t * scale(D)
    N,
    BLOCK: tl.constexpr,
):
    d = tl.load(count_ptr).to(tl.float32)
    # 1 / D for D > 0, 0 for D == 0, NaN for an unchecked bad D; rounded to nearest, as
    # PyTorch's (an approximate division would differ from the reference in the last bit)
    inverse = tl.math.div_rn(tl.full((), 1.0, tl.float32), tl.maximum(d, 1e-30))
    scale = tl.where(d > 0.0, inverse, 0.0)
    scale = tl.where((d >= 0.0) & (d < float("inf")), scale, float("nan"))
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < N
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0)
    tl.store(coef_ptr + offsets, weight * scale, mask=mask)


def normalise(weight: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``coef = weight * scale(D)`` (:mod:`packed_ce.targets`) in one launch, not fourteen.

    Args:
        weight: ``(N,)`` fp32 per-token weights ``w_t``, contiguous.
        count: ``()`` ``D`` on ``weight``'s device, any real dtype (read as fp32, rounded to
            nearest as ``Tensor.to`` does).

    Returns:
        ``(N,)`` fp32 coefficients.
    """
    coef = torch.empty_like(weight)
    n = weight.numel()
    if n == 0:
        return coef
    block = 64 if interpreting() else 1024
    _normalise_kernel[(triton.cdiv(n, block),)](
        weight_ptr=weight, count_ptr=count, coef_ptr=coef, N=n, BLOCK=block, num_warps=4
    )
    return coef
