"""The value checks of the loss (label range, ``cu_seqlens`` contents) in one launch.

Computed with PyTorch ops (:func:`packed_ce.records.encode`), the record takes a few dozen small
kernels of a few microseconds of device time each, several percent of a whole forward and
backward at N=8192, V=32000 (0.5 ms on an H100). Here one program per 4096 labels reads them
once (8 bytes each at int64) and writes one row of the record (:class:`packed_ce.records.Field`),
which the host reads later (:mod:`packed_ce.pending`): nothing waits for the device.

While the error is on its way to the host, the call's loss must not look usable: the loss kernel
makes the row of an out-of-range target NaN by itself, but a malformed ``cu_seqlens`` gives a
finite, wrong loss, and a bad label that is no target (the first label of a sequence under
``shift``) changes nothing. So a program that finds a failed check sets its block of the loss
coefficients to NaN: the loss and every gradient of that call are NaN.

Dimensions: N tokens, S sequences, P programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..records import PER_SEQUENCE, WIDTH, Field
from ..runtime import interpreting

# The record's columns, as constants a kernel may read (Triton reads no other globals).
BAD_LABELS = tl.constexpr(int(Field.BAD_LABELS))
BAD_LABEL_AT = tl.constexpr(int(Field.BAD_LABEL_AT))
BAD_LABEL_VALUE = tl.constexpr(int(Field.BAD_LABEL_VALUE))
CU_FIRST = tl.constexpr(int(Field.CU_FIRST))
CU_LAST = tl.constexpr(int(Field.CU_LAST))
DECREASE_AT = tl.constexpr(int(Field.DECREASE_AT))
DECREASE_BEFORE = tl.constexpr(int(Field.DECREASE_BEFORE))
DECREASE_AFTER = tl.constexpr(int(Field.DECREASE_AFTER))
BAD_COUNT = tl.constexpr(int(Field.BAD_COUNT))
# the per-sequence fields, filled by PyTorch ops: here "nothing found", -1 for a position
FIRST_PER_SEQUENCE = tl.constexpr(int(PER_SEQUENCE))
TARGETS_BELOW_ONE_AT = tl.constexpr(int(Field.TARGETS_BELOW_ONE_AT))
TARGETS_BELOW_OWN_AT = tl.constexpr(int(Field.TARGETS_BELOW_OWN_AT))
BAD_WEIGHT_AT = tl.constexpr(int(Field.BAD_WEIGHT_AT))


# N and S vary with every batch: specialising on their divisibility by 16 would compile a new
# variant whenever a batch first flips it (seen as 2 s steps inside a trained run)
@triton.jit(do_not_specialize=["N", "num_bounds"])
def _value_checks_kernel(
    # data ptrs
    labels_ptr,  # (N,) int8/uint8/int16/int32/int64 labels, flattened
    cu_seqlens_ptr,  # (S+1,) int32/int64 boundaries; not read unless HAS_CU
    coef_ptr,  # (N,) fp32 loss coefficients: NaN in this block if a check fails
    count_ptr,  # () int/float num_items_in_batch; not read unless HAS_COUNT
    record_ptr,  # (P, WIDTH) int64 out: this program's row (packed_ce.records.Field)
    # shapes
    N,
    num_bounds,  # S+1, the entries of cu_seqlens
    # scalars
    vocab_size,
    ignore_index,
    # switches
    HAS_CU: tl.constexpr,
    HAS_COUNT: tl.constexpr,
    WIDTH: tl.constexpr,
    BLOCK: tl.constexpr,
    CU_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < N
    y = tl.load(labels_ptr + t, mask=in_range, other=ignore_index).to(tl.int64)
    # the predicate of packed_ce.records.bad_label_mask: not ignored and outside [0, V)
    bad = in_range & (y != ignore_index) & ((y < 0) | (y >= vocab_size))
    bad_labels = tl.sum(bad.to(tl.int64), 0)
    first_bad = tl.min(tl.where(bad, t, N), 0)  # N: none in this block
    first_bad_value = tl.load(labels_ptr + first_bad, mask=first_bad < N, other=0).to(tl.int64)
    first_bad = tl.where(first_bad < N, first_bad, -1)

    row = record_ptr + pid.to(tl.int64) * WIDTH
    tl.store(row + BAD_LABELS, bad_labels)
    tl.store(row + BAD_LABEL_AT, first_bad)
    tl.store(row + BAD_LABEL_VALUE, first_bad_value)
    if HAS_CU:
        # Every program reads all of cu_seqlens (S+1 entries, a few KB from L2) to know whether
        # to poison its block: one launch, no second pass.
        cu_first = tl.load(cu_seqlens_ptr).to(tl.int64)
        cu_last = tl.load(cu_seqlens_ptr + num_bounds - 1).to(tl.int64)
        decrease_at = tl.zeros((), tl.int64) + num_bounds  # num_bounds: none
        for start in range(0, num_bounds - 1, CU_BLOCK):
            s = start + tl.arange(0, CU_BLOCK).to(tl.int64)
            pair = s + 1 < num_bounds
            before = tl.load(cu_seqlens_ptr + s, mask=pair, other=0).to(tl.int64)
            after = tl.load(cu_seqlens_ptr + s + 1, mask=pair, other=0).to(tl.int64)
            found = tl.min(tl.where(pair & (after < before), s, num_bounds), 0)
            decrease_at = tl.minimum(decrease_at, found)
        has_decrease = decrease_at < num_bounds
        before = tl.load(cu_seqlens_ptr + decrease_at, mask=has_decrease, other=0).to(tl.int64)
        after = tl.load(cu_seqlens_ptr + decrease_at + 1, mask=has_decrease, other=0).to(tl.int64)
        tl.store(row + CU_FIRST, cu_first)
        tl.store(row + CU_LAST, cu_last)
        tl.store(row + DECREASE_AT, tl.where(has_decrease, decrease_at, -1))
        tl.store(row + DECREASE_BEFORE, before)
        tl.store(row + DECREASE_AFTER, after)
        failed = (bad_labels > 0) | (cu_first != 0) | (cu_last != N) | has_decrease
    else:  # no boundaries: the fields of well-formed ones
        tl.store(row + CU_FIRST, tl.zeros((), tl.int64))
        tl.store(row + CU_LAST, tl.zeros((), tl.int64) + N)
        tl.store(row + DECREASE_AT, tl.zeros((), tl.int64) - 1)
        tl.store(row + DECREASE_BEFORE, tl.zeros((), tl.int64))
        tl.store(row + DECREASE_AFTER, tl.zeros((), tl.int64))
        failed = bad_labels > 0
    if HAS_COUNT:
        # a normaliser that is negative or not finite (NaN != NaN; inf - inf is NaN)
        count = tl.load(count_ptr).to(tl.float32)
        count_failed = (count != count) | (count - count != 0.0) | (count < 0.0)
        tl.store(row + BAD_COUNT, count_failed.to(tl.int64))
        failed = failed | count_failed
    else:
        tl.store(row + BAD_COUNT, tl.zeros((), tl.int64))
    for field in tl.static_range(FIRST_PER_SEQUENCE, WIDTH):
        tl.store(row + field, tl.zeros((), tl.int64))
    none = tl.zeros((), tl.int64) - 1
    tl.store(row + TARGETS_BELOW_ONE_AT, none)
    tl.store(row + TARGETS_BELOW_OWN_AT, none)
    tl.store(row + BAD_WEIGHT_AT, none)
    # A NaN coefficient makes the loss kernel give the row a NaN loss and gradient, target or
    # not. The store is masked off, so no memory traffic, unless a check failed.
    poison_end = tl.where(failed, N, 0)
    nan = tl.full((BLOCK,), float("nan"), tl.float32)
    tl.store(coef_ptr + t, nan, mask=t < poison_end)


def launch_value_checks(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    coef: torch.Tensor,
    count: torch.Tensor | None,
    *,
    vocab_size: int,
    ignore_index: int,
) -> torch.Tensor:
    """Queue the value checks; where one fails, ``coef`` turns NaN (in place).

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer labels, as given to the loss.
        cu_seqlens: ``(S+1,)`` int32/int64 or None (nothing to check about boundaries).
        coef: ``(N,)`` fp32 coefficients of this call (:class:`packed_ce.targets.Targets`).
        count: the call's tensor ``num_items_in_batch`` (one element, on the labels' device),
            or None.
        vocab_size, ignore_index: what a valid label is.

    Returns:
        ``(P, WIDTH)`` int64 on the labels' device, one row per program of the record
        (:mod:`packed_ce.records`); :func:`packed_ce.records.message` reads it.
    """
    flat = labels.reshape(-1).contiguous()  # the kernel reads label t at offset t
    n = flat.numel()
    # The interpreter runs blocks as numpy arrays: small blocks exercise several programs and
    # the cu_seqlens loop at test sizes.
    block, cu_block = (64, 8) if interpreting() else (4096, 1024)
    programs = max(triton.cdiv(n, block), 1)  # one program at N = 0: cu_seqlens is still read
    record = torch.empty(programs, WIDTH, dtype=torch.int64, device=labels.device)
    _value_checks_kernel[(programs,)](
        labels_ptr=flat,
        cu_seqlens_ptr=cu_seqlens.contiguous() if cu_seqlens is not None else flat,
        coef_ptr=coef,
        count_ptr=count.reshape(()).to(labels.device) if count is not None else coef,
        record_ptr=record,
        N=n,
        num_bounds=cu_seqlens.numel() if cu_seqlens is not None else 0,
        vocab_size=vocab_size,
        ignore_index=ignore_index,
        HAS_CU=cu_seqlens is not None,
        HAS_COUNT=count is not None,
        WIDTH=WIDTH,
        BLOCK=block,
        CU_BLOCK=cu_block,
        num_warps=4,
    )
    return record
