"""Triton cross entropy over rows of logits, weighted per row.

``coef[t]`` (:mod:`packed_ce.targets`) folds packing, shift and the reduction into one float32
weight per row; the kernel computes ``loss[t] = coef[t] * l_t`` and ``dL/dx_j`` as
docs/reference.md ("The loss, exactly") defines them. One program per row, two ways:
- fused ("mean"/"sum", eager): one launch gives the loss and the gradient for ``g = 1``; the
  backward rescales by the scalar ``g`` (nothing when it is 1). A row one block spans
  (:mod:`packed_ce.kernels.config`) is read once and held in registers: 2 * N * V element
  moves, the floor; a longer row is read twice: 3 * N * V (benchmarks/NOTES.md).
- recompute ("none", whose ``g`` is per row; fp16, whose gradient must see the loss scale
  before rounding; ``torch.compile``, whose functional ops cannot return an in-place
  gradient): the forward writes loss and ``lse``, the backward reads the logits again.

Dimensions: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import check_first_order
from .config import launch_config as _launch_config


@triton.jit
def _softcap_and_slope(raw, softcap):
    # x = c tanh(u) with u = raw / c, and its slope dx/draw = 1 - tanh(u)^2, both to fp32
    # rounding. tl has no tanh, and the textbook forms cancel: 1 - 2 / (exp(2u) + 1) for small
    # |u| (an absolute error of ~c * 2**-24 whatever the size of x: up to 4.6e-6 at c = 30,
    # gradients 4.8e-6 off torch.tanh), and 1 - (x / c)^2 near saturation (the slope of a
    # capped logit lost every digit once x / c rounded to 1). So, with a = |u|:
    # - a < 0.4: the odd Taylor series of tanh to a**13 (the next term is below 2**-24 relative
    #   there), and 1 - t^2 >= 0.86, which does not cancel;
    # - a >= 0.4: e = exp(-2a) in (0, 0.45], tanh = (1 - e) / (1 + e) and
    #   1 - tanh^2 = 4 e / (1 + e)^2, neither of which cancels; e never overflows, and underflows
    #   to 0 (tanh = 1, slope 0) where the true slope is below fp32's range anyway.
    # NaN stays NaN; +-inf logits cap to +-c with slope 0.
    u = raw / softcap
    a = tl.abs(u)
    s = tl.minimum(a, 0.4)  # the series' argument, kept in its range so it never overflows
    a2 = s * s
    series = 21844.0 / 6081075.0
    series = series * a2 - 1382.0 / 155925.0
    series = series * a2 + 62.0 / 2835.0
    series = series * a2 - 17.0 / 315.0
    series = series * a2 + 2.0 / 15.0
    series = series * a2 - 1.0 / 3.0
    series = s + s * (a2 * series)
    e = tl.exp(-2.0 * a)
    small = a < 0.4
    t = tl.where(small, series, (1.0 - e) / (1.0 + e))
    slope = tl.where(small, 1.0 - series * series, 4.0 * e / ((1.0 + e) * (1.0 + e)))
    return softcap * tl.where(u < 0.0, -t, t), slope


@triton.jit
def _apply_softcap(raw, softcap):
    # The capped value alone. Unpacking ``x, _ = _softcap_and_slope(...)`` in the kernel would
    # bind ``_`` to a scalar before the block loop that rebinds it to a block: Triton 3.6 then
    # refuses to compile ("Loop-carried variable _ has initial type fp32 but is re-assigned").
    x, _ = _softcap_and_slope(raw, softcap)
    return x


@triton.jit
def _load_block(logits_row, offs, mask, softcap, HAS_SOFTCAP: tl.constexpr):
    # x (capped if HAS_SOFTCAP, -inf where masked) and its slope dx/draw (1.0 without softcap)
    # for the columns ``offs`` of one row, in fp32.
    raw = tl.load(logits_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SOFTCAP:
        x, slope = _softcap_and_slope(raw, softcap)
    else:
        x, slope = raw, 1.0
    return tl.where(mask, x, float("-inf")), slope


@triton.jit
def _block_gradient(
    x,
    slope,
    offs,
    target,
    lse,
    p_scale,
    g,
    label_smoothing,
    V,
    HAS_SMOOTHING: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
):
    # g * dl/dx_j * dx/draw_j for the columns ``offs`` (x = -inf where masked gives 0 there).
    d = tl.exp(x - lse) * p_scale
    if HAS_SMOOTHING:
        d -= label_smoothing / V
    # p_y - (1 - eps) is formed in fp32, so p_y near 1 does not cancel in bf16.
    d = tl.where(offs == target, d - (1.0 - label_smoothing), d)
    if HAS_SOFTCAP:
        d *= slope
    return g * d


@triton.heuristics(
    {
        "HAS_SMOOTHING": lambda args: args["label_smoothing"] > 0.0,
        "HAS_Z_LOSS": lambda args: args["z_loss_scale"] > 0.0,
        "HAS_SOFTCAP": lambda args: args["softcap"] > 0.0,
        # One block spans the row and the loss is computed here: hold the row from the
        # logsumexp to the gradient instead of reading it twice.
        "ROW_ON_CHIP": lambda args: args["COMPUTE_LOSS"] and args["BLOCK_V"] >= args["V"],
    }
)
@triton.jit
def _cross_entropy_kernel(
    # data ptrs
    logits_ptr,  # (N, V) fp32/bf16/fp16, unit column stride
    grad_ptr,  # (N, V) logits' dtype, written if COMPUTE_GRAD; may be logits_ptr (in place)
    targets_ptr,  # (N,) int64 target class; used only where coef != 0
    coef_ptr,  # (N,) fp32 weight of the row in the reduced loss, 0 = no target
    grad_out_ptr,  # (N,) fp32 upstream gradient per row, if HAS_GRAD_OUT
    loss_ptr,  # (N,) fp32 out: coef * l_t, if COMPUTE_LOSS
    z_ptr,  # (N,) fp32 out: coef * z_loss_scale * lse^2, if COMPUTE_LOSS
    lse_ptr,  # (N,) fp32: written if COMPUTE_LOSS, else read
    stats_ptr,  # (N, >=2) fp32 out if COMPUTE_STATS: entropy of softmax(x), 1.0 if y is an argmax
    # shapes
    V,
    # strides
    stride_logits_n,
    stride_grad_n,
    stride_grad_out_n,  # 0 broadcasts one upstream gradient to every row
    stride_stats_n,
    # hyperparameters: runtime floats, so a new value does not recompile
    label_smoothing,
    z_loss_scale,
    softcap,  # 0.0 = no softcap
    # switches
    COMPUTE_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    HAS_GRAD_OUT: tl.constexpr,
    COMPUTE_STATS: tl.constexpr,  # with COMPUTE_LOSS only
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ROW_ON_CHIP: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 at LLM shapes
    logits_row = logits_ptr + row * stride_logits_n
    grad_row = grad_ptr + row * stride_grad_n
    cols = tl.arange(0, BLOCK_V)
    # Both loads are issued before the branch waits for coef: one memory latency per row before
    # its logits are requested, not two.
    coef = tl.load(coef_ptr + row)
    target = tl.load(targets_ptr + row)

    if coef != 0.0:
        # Labels are range-checked on the host unless tracing; here an out-of-range label
        # must not read out of bounds and must not pass silently: its loss and gradient are NaN.
        bad_target = (target < 0) | (target >= V)
        target = tl.where(bad_target, 0, target)

        if COMPUTE_LOSS:
            x_sum = tl.zeros((), tl.float32)
            px_sum = tl.zeros((), tl.float32)  # sum_j exp(x_j - m) x_j, for the entropy
            if ROW_ON_CHIP:
                # Pass 1 over the whole row, read N*V, kept in registers for the gradient. Both
                # loads land before the reductions' barriers, so before any warp writes the
                # gradient, which may overwrite the logits in place.
                row_mask = cols < V
                x_row, slope_row = _load_block(logits_row, cols, row_mask, softcap, HAS_SOFTCAP)
                x_target = tl.load(logits_row + target).to(tl.float32)
                if HAS_SOFTCAP:
                    x_target = _apply_softcap(x_target, softcap)
                m = tl.max(x_row, 0)
                e = tl.exp(x_row - m)
                s = tl.sum(e, 0)
                if COMPUTE_STATS:
                    # e == 0 where x == -inf (masked columns, masked vocabulary): 0, not 0 * inf
                    px_sum = tl.sum(e * tl.where(e > 0.0, x_row, 0.0), 0)
                if HAS_SMOOTHING:
                    x_sum = tl.sum(tl.where(row_mask, x_row, 0.0), 0)
            else:
                # Read before pass 1: its reductions are barriers that every warp passes before
                # any warp starts pass 2, whose in-place gradient may overwrite this logit.
                x_target = tl.load(logits_row + target).to(tl.float32)
                if HAS_SOFTCAP:
                    x_target = _apply_softcap(x_target, softcap)
                # Pass 1, read N*V: online logsumexp, one exp per element and one max per block.
                m = tl.full((), float("-inf"), tl.float32)
                s = tl.zeros((), tl.float32)
                for start in range(0, V, BLOCK_V):
                    mask = start + cols < V
                    x, _ = _load_block(logits_row, start + cols, mask, softcap, HAS_SOFTCAP)
                    m_new = tl.maximum(m, tl.max(x, 0))
                    e = tl.exp(x - m_new)
                    rescale = tl.exp(m - m_new)
                    s = s * rescale + tl.sum(e, 0)
                    if COMPUTE_STATS:
                        px_sum = px_sum * rescale + tl.sum(e * tl.where(e > 0.0, x, 0.0), 0)
                    m = m_new
                    if HAS_SMOOTHING:
                        x_sum += tl.sum(tl.where(mask, x, 0.0), 0)
            lse = m + tl.log(s)
            loss = lse - x_target
            if HAS_SMOOTHING:
                loss = (1.0 - label_smoothing) * loss + label_smoothing * (lse - x_sum / V)
            z_term = 0.0
            if HAS_Z_LOSS:
                z_term = z_loss_scale * lse * lse
            loss = tl.where(bad_target, float("nan"), loss + z_term)
            tl.store(loss_ptr + row, coef * loss)
            tl.store(z_ptr + row, coef * z_term)
            tl.store(lse_ptr + row, lse)
            if COMPUTE_STATS:
                # H = -sum_j p_j log p_j = lse - sum_j p_j x_j; the target is a top-1 class when
                # no logit exceeds its own (ties count as correct, as for any argmax).
                tl.store(stats_ptr + row * stride_stats_n, lse - px_sum / s)
                tl.store(stats_ptr + row * stride_stats_n + 1, (x_target >= m).to(tl.float32))
        else:
            lse = tl.load(lse_ptr + row)

        if COMPUTE_GRAD:
            g = coef
            if HAS_GRAD_OUT:
                g = g * tl.load(grad_out_ptr + row * stride_grad_out_n).to(tl.float32)
            g = tl.where(bad_target, float("nan"), g)
            p_scale = 1.0
            if HAS_Z_LOSS:
                p_scale = 1.0 + 2.0 * z_loss_scale * lse  # d(z lse^2)/dx_j = 2 z lse p_j
            if ROW_ON_CHIP:
                # Write N*V from the row held since pass 1. Every store waits for lse, i.e. for
                # the reductions over all of the row's loads: grad_ptr may alias logits.
                d = _block_gradient(
                    x_row,
                    slope_row,
                    cols,
                    target,
                    lse,
                    p_scale,
                    g,
                    label_smoothing,
                    V,
                    HAS_SMOOTHING,
                    HAS_SOFTCAP,
                )
                tl.store(grad_row + cols, d.to(grad_ptr.dtype.element_ty), mask=row_mask)
            else:
                # Pass 2, read N*V again (partly from L2 right after pass 1) and write N*V.
                # Each element is read before it is written by the same thread, so grad_ptr may
                # alias logits.
                for start in range(0, V, BLOCK_V):
                    mask = start + cols < V
                    x, slope = _load_block(logits_row, start + cols, mask, softcap, HAS_SOFTCAP)
                    d = _block_gradient(
                        x,
                        slope,
                        start + cols,
                        target,
                        lse,
                        p_scale,
                        g,
                        label_smoothing,
                        V,
                        HAS_SMOOTHING,
                        HAS_SOFTCAP,
                    )
                    tl.store(grad_row + start + cols, d.to(grad_ptr.dtype.element_ty), mask=mask)
    else:
        # Not a target: no loss, a zero gradient, and the logits are never read.
        if COMPUTE_LOSS:
            tl.store(loss_ptr + row, 0.0)
            tl.store(z_ptr + row, 0.0)
            tl.store(lse_ptr + row, 0.0)
            if COMPUTE_STATS:
                tl.store(stats_ptr + row * stride_stats_n, 0.0)
                tl.store(stats_ptr + row * stride_stats_n + 1, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros((BLOCK_V,), tl.float32).to(grad_ptr.dtype.element_ty)
            for start in range(0, V, BLOCK_V):
                tl.store(grad_row + start + cols, zeros, mask=start + cols < V)


@triton.jit(do_not_specialize=["N"])  # N varies with every batch: one compile, not one per N % 16
def _scale_rows_kernel(
    # data ptrs
    grad_ptr,  # (N, V) fp32/bf16/fp16, scaled in place
    scale_ptr,  # () fp32 upstream gradient
    # shapes
    N,
    V,
    # strides
    stride_grad_n,
    # switches
    BLOCK_V: tl.constexpr,
):
    # Backward of the fused path, branching on the device: g == 1 costs idle programs only, no
    # pass over N*V and no host sync; any other g (loss scaling, * num_processes) is applied.
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        cols = tl.arange(0, BLOCK_V)
        for row in range(tl.program_id(0), N, tl.num_programs(0)):
            grad_row = grad_ptr + tl.cast(row, tl.int64) * stride_grad_n
            for start in range(0, V, BLOCK_V):
                mask = start + cols < V
                g = tl.load(grad_row + start + cols, mask=mask).to(tl.float32)
                tl.store(
                    grad_row + start + cols,
                    (g * scale).to(grad_ptr.dtype.element_ty),
                    mask=mask,
                )


def launch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    floats,
    *,
    lse: torch.Tensor | None = None,
    grad: torch.Tensor | None = None,
    grad_rows: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """One launch of the row kernel: the forward, or (given ``lse``) the backward.

    Args:
        logits: ``(N, V)`` fp32/bf16/fp16 with unit column stride.
        targets: ``(N,)`` int64. coef: ``(N,)`` fp32.
        floats: ``(label_smoothing, z_loss_scale, softcap)``, a
            :class:`packed_ce.options.KernelFloats` (softcap 0.0: none).
        lse: None for the forward; the forward's ``(N,)`` fp32 ``lse`` for the backward.
        grad: ``(N, V)`` of the logits' dtype (may be ``logits``) or None: ``dL/dlogits`` for
            ``g = 1`` (forward) or ``grad_rows`` (backward).
        grad_rows: ``(N,)`` fp32 upstream gradient of the backward, any stride (0 broadcasts).
        stats: forward only, ``(N, >=2)`` fp32 or None: each row's entropy and top-1 hit.

    Returns:
        The forward's ``(loss, z, lse)``, each ``(N,)`` fp32 (separate allocations: custom-op
        outputs must not alias); None for the backward.
    """
    n, vocab = logits.shape
    forward = lse is None
    loss = z_rows = None
    if forward:
        loss, z_rows, lse = (
            torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3)
        )
    if n > 0:
        block, num_warps = _launch_config(vocab, logits.device)
        label_smoothing, z_loss_scale, softcap = (float(value) for value in floats)
        _cross_entropy_kernel[(n,)](
            logits_ptr=logits,
            grad_ptr=grad if grad is not None else logits,  # unused pointers stand in for others
            targets_ptr=targets,
            coef_ptr=coef,
            grad_out_ptr=grad_rows if grad_rows is not None else coef,
            loss_ptr=loss if forward else lse,
            z_ptr=z_rows if forward else lse,
            lse_ptr=lse,
            stats_ptr=stats if stats is not None else lse,
            V=vocab,
            stride_logits_n=logits.stride(0),
            stride_grad_n=grad.stride(0) if grad is not None else 0,
            stride_grad_out_n=grad_rows.stride(0) if grad_rows is not None else 0,
            stride_stats_n=stats.stride(0) if stats is not None else 0,
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            softcap=softcap,
            COMPUTE_LOSS=forward,
            COMPUTE_GRAD=grad is not None,
            HAS_GRAD_OUT=grad_rows is not None,
            COMPUTE_STATS=stats is not None,
            BLOCK_V=block,
            num_warps=num_warps,
        )
    return (loss, z_rows, lse) if forward else None


def scale_in_place(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """``grad *= scale`` for a 0-d device ``scale``, with no work at all when it is 1."""
    n, vocab = grad.shape
    if n == 0:
        return
    block, num_warps = _launch_config(vocab, grad.device)
    if grad.is_cuda:
        programs = 4 * torch.cuda.get_device_properties(grad.device).multi_processor_count
    else:
        programs = 4
    _scale_rows_kernel[(min(n, programs),)](
        grad_ptr=grad,
        scale_ptr=scale.reshape(()).to(torch.float32),
        N=n,
        V=vocab,
        stride_grad_n=grad.stride(0),
        BLOCK_V=block,
        num_warps=num_warps,
    )


def _mark_overwritten(logits: torch.Tensor) -> None:
    """Bumps the autograd version of ``logits``, now holding their gradient: a node that saved
    them raises "modified by an inplace operation" instead of reading the gradient as logits.
    """
    torch.autograd.graph.increment_version(logits)


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd for eager mode: fused for scalar reductions, recompute for "none" and fp16."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,  # (N, V) fp32/bf16/fp16, unit column stride
        targets: torch.Tensor,  # (N,) int64
        coef: torch.Tensor,  # (N,) fp32
        floats,  # packed_ce.options.KernelFloats
        reduce: bool,  # True: return the sum of the rows ("mean"/"sum"); False: the rows
        inplace_backward: bool,
        stats: torch.Tensor | None,  # (N, 3) fp32 out-buffer: launch's two columns, loss rows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        needs_grad = ctx.needs_input_grad[0]
        # A scalar upstream gradient: the gradient up to that scalar comes from the loss's pass.
        # Not in fp16: entries coef * p_j (often < 1e-7) would flush to zero before the backward
        # applies the loss scale; fp16 recomputes with the scaled upstream gradient.
        fused = needs_grad and reduce and logits.dtype != torch.float16
        grad = None
        if fused:
            grad = logits if inplace_backward else torch.empty_like(logits)
        loss, z_rows, lse = launch(logits, targets, coef, floats, grad=grad, stats=stats)
        if stats is not None:
            stats[:, 2] = loss  # the rows' weighted losses, before they are summed
        if fused and inplace_backward:
            _mark_overwritten(logits)
        if reduce:
            loss, z_rows = loss.sum(), z_rows.sum()
        ctx.mark_non_differentiable(z_rows)
        ctx.fused, ctx.inplace_backward, ctx.floats = fused, inplace_backward, floats
        ctx.backward_done = False
        if fused:
            ctx.save_for_backward(grad)
        elif needs_grad:
            ctx.save_for_backward(logits, targets, coef, lse)
        return loss, z_rows

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_z: torch.Tensor):
        check_first_order("packed_ce.cross_entropy with backend='triton'", "backend='torch'")
        if ctx.backward_done:
            # The fused gradient is scaled in place: a second backward would scale it twice.
            # The recompute paths refuse too, so that every path behaves alike.
            raise RuntimeError(
                "packed_ce.cross_entropy supports one backward per forward; "
                "recompute the loss instead of retain_graph=True"
            )
        ctx.backward_done = True
        if ctx.fused:
            (grad,) = ctx.saved_tensors
            scale_in_place(grad, grad_loss)
        else:
            logits, targets, coef, lse = ctx.saved_tensors
            grad = logits if ctx.inplace_backward else torch.empty_like(logits)
            # a 0-d upstream gradient (fp16 reductions) is broadcast with stride 0
            grad_rows = grad_loss.float().expand(logits.shape[0])
            launch(logits, targets, coef, ctx.floats, lse=lse, grad=grad, grad_rows=grad_rows)
            if ctx.inplace_backward:
                _mark_overwritten(logits)
        # One gradient per forward input: logits, then none for targets, coef, floats, reduce,
        # inplace_backward and stats.
        return grad, None, None, None, None, None, None


# torch.compile path: two functional custom ops with registered autograd and fake kernels, so
# that a compiled graph keeps the Triton kernels as opaque calls with no graph break.


@torch.library.custom_op("packed_ce::cross_entropy_forward", mutates_args=())
def cross_entropy_forward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    floats: list[float],  # KernelFloats as a list: a custom op's schema has no named tuple
    compute_stats: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # stats are an output here (a custom op's outputs are fresh tensors): (N, 2), or (0, 2)
    stats = logits.new_empty((logits.shape[0] if compute_stats else 0, 2), dtype=torch.float32)
    loss, z_rows, lse = launch(
        logits, targets, coef, floats, stats=stats if compute_stats else None
    )
    return loss, z_rows, lse, stats


@cross_entropy_forward_op.register_fake
def _(logits, targets, coef, floats, compute_stats):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    stats = logits.new_empty((logits.shape[0] if compute_stats else 0, 2), dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows), stats


@torch.library.custom_op("packed_ce::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    floats: list[float],
) -> torch.Tensor:
    grad = torch.empty_like(logits)
    launch(logits, targets, coef, floats, lse=lse, grad=grad, grad_rows=grad_rows.float())
    return grad


@cross_entropy_backward_op.register_fake
def _(logits, targets, coef, lse, grad_rows, floats):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, targets, coef, floats, _ = inputs
    ctx.save_for_backward(logits, targets, coef, output[2])
    ctx.floats = floats
    ctx.mark_non_differentiable(output[3])


def _backward(ctx, grad_loss_rows, grad_z_rows, grad_lse, grad_stats):
    check_first_order("packed_ce.cross_entropy with backend='triton'", "backend='torch'")
    logits, targets, coef, lse = ctx.saved_tensors
    grad = cross_entropy_backward_op(logits, targets, coef, lse, grad_loss_rows, ctx.floats)
    # One gradient per forward input: logits, then none for targets, coef, floats, compute_stats.
    return grad, None, None, None, None


cross_entropy_forward_op.register_autograd(_backward, setup_context=_setup_context)


def triton_cross_entropy(
    logits: torch.Tensor, options, prepared, stats: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, z)``: 0-d fp32 sums for "mean"/"sum", else ``(N,)`` fp32 rows (z detached).

    The ``run`` of :func:`packed_ce.pipeline.run_loss`, bound to ``logits`` and ``options``.

    Args:
        logits: ``(N, V)`` or ``(B, T, V)`` fp32/bf16/fp16. options: a LossOptions.
        prepared: a :class:`packed_ce.targets.Targets` (``(N,)`` int64 targets, fp32 coef).
        stats: ``(N, 3)`` fp32 (entropy, top-1 hit, ``coef_t * l_t``) or None.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    targets, coef, floats = prepared.targets, prepared.coef, options.kernel_floats
    reduce = options.reduction != "none"
    if torch.compiler.is_compiling():
        loss, z_rows, _, row_stats = cross_entropy_forward_op(
            rows, targets, coef, list(floats), stats is not None
        )
        if stats is not None:
            stats[:, :2] = row_stats
            stats[:, 2] = loss
        if reduce:
            return loss.sum(), z_rows.sum().detach()
        return loss, z_rows.detach()
    return CrossEntropyFunction.apply(
        rows, targets, coef, floats, reduce, options.inplace_backward, stats
    )
