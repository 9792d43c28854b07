"""Targets and per-token weights from labels and ``cu_seqlens`` in one launch.

The PyTorch version in :mod:`packed_ce.targets` takes about 25 small kernels (searchsorted,
shifts, index_add, ...): a few microseconds of device time each and, worse, their host-side
launch cost, which shows at small shapes and whenever a host sync empties the launch queue.
Here one program per sequence counts its targets and writes them with their weights.

Dimensions: N tokens, S sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import interpreting


@triton.jit
def _sequence_targets_kernel(
    # data ptrs
    labels_ptr,  # (N,) int64 labels, aligned with the inputs if SHIFT
    cu_seqlens_ptr,  # (S+1,) int32/int64 sequence boundaries
    targets_ptr,  # (N,) int64 out: the class row t is scored against, or ignore_index
    weight_ptr,  # (N,) fp32 out: w_t = 1/n_s (IS_PACKED) or 1 for a target, 0 otherwise
    num_items_ptr,  # () fp32 zero-initialised, atomically increased: D before num_items_in_batch
    # shapes
    N,
    # scalars
    ignore_index,
    # switches
    SHIFT: tl.constexpr,
    IS_PACKED: tl.constexpr,
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

    # pass 2 (the sequence's labels again, from L1/L2): targets and weights
    if IS_PACKED:
        w = 1.0 / tl.maximum(count, 1).to(tl.float32)
    else:
        w = 1.0
    for block_start in range(start, end, BLOCK):
        t = block_start + offsets
        if SHIFT:
            y = tl.load(labels_ptr + t + 1, mask=t + 1 < end, other=ignore_index)
        else:
            y = tl.load(labels_ptr + t, mask=t < end, other=ignore_index)
        tl.store(targets_ptr + t, y, mask=t < end)
        tl.store(weight_ptr + t, tl.where(y != ignore_index, w, 0.0), mask=t < end)

    if IS_PACKED:
        tl.atomic_add(num_items_ptr, (count > 0).to(tl.float32))
    else:
        tl.atomic_add(num_items_ptr, count.to(tl.float32))


def sequence_targets(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    is_packed: bool,
    shift: bool,
    ignore_index: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Targets, unnormalised weights and the default normaliser ``D``.

    Args:
        labels: ``(N,)`` int64 (flattened). cu_seqlens: ``(S+1,)`` int32/int64.

    Returns:
        ``targets`` ``(N,)`` int64, ``weight`` ``(N,)`` fp32 (``w_t`` of :mod:`packed_ce.targets`)
        and ``num_items`` ``()`` fp32: sequences with a target (``is_packed``) or targets.
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
        cu_seqlens_ptr=cu_seqlens,
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
