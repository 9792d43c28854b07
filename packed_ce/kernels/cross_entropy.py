"""Triton cross entropy over rows of logits, weighted per row.

The kernel knows nothing about sequences: :mod:`packed_ce.targets` folds packing, shift and
the reduction into one float32 coefficient per row, ``coef[t]``, and the kernel computes

    loss[t] = coef[t] * l_t,   l_t = (1-eps)(lse - x_y) + eps (lse - mean_j x_j) + z lse^2
    dL/dx_j = g_t * coef[t] * (p_j (1 + 2 z lse) - eps / V - (1-eps) [j == y])

with ``p = softmax(x)``, ``g_t`` the upstream gradient of row ``t`` and, under ``softcap``
(``x = c tanh(raw / c)``), the chain factor ``dx/draw = 1 - (x / c)^2``.

Each row is split into chunks of CHUNK columns, one program a chunk, that exchange their
partial logsumexp through a small scratch buffer; each program keeps its chunk in registers from
the loss to the gradient. Two ways to run it:
- fused (reductions "mean"/"sum" in eager mode): one launch computes the loss and the gradient
  for ``g = 1``; backward only rescales by the scalar upstream gradient, and skips even that
  on the device when it is 1 (read N*V, write N*V in all: the floor).
- recompute (reduction "none", whose upstream gradient is per row, and ``torch.compile``,
  whose functional ops cannot hand back an in-place gradient): the forward writes the loss
  and ``lse``; the backward reads the logits again and writes the gradient.

Dimensions: N rows (tokens), V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..runtime import interpreting

@triton.jit
def _apply_softcap(x, softcap):
    # c * tanh(x / c) through exp, since tl has no tanh: tanh(u) = 1 - 2 / (exp(2u) + 1).
    # exp overflows to inf for large u and the formula goes to +-1, as tanh does.
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * x / softcap) + 1.0))


@triton.heuristics(
    {
        "HAS_SMOOTHING": lambda args: args["label_smoothing"] > 0.0,
        "HAS_Z_LOSS": lambda args: args["z_loss_scale"] > 0.0,
        "HAS_SOFTCAP": lambda args: args["softcap"] > 0.0,
        "SPLIT": lambda args: args["K"] > 1,
    }
)
@triton.jit
def _cross_entropy_kernel(
    # data ptrs
    logits_ptr,  # (N, V) fp32/bf16/fp16, unit column stride
    grad_ptr,  # (N, V) logits' dtype, written if COMPUTE_GRAD; may be logits_ptr (in place)
    targets_ptr,  # (N,) int64 target class; read only where coef != 0
    coef_ptr,  # (N,) fp32 weight of the row in the reduced loss, 0 = no target
    grad_out_ptr,  # (N,) fp32 upstream gradient per row, if HAS_GRAD_OUT
    loss_ptr,  # (N,) fp32 out: coef * l_t, if COMPUTE_LOSS
    z_ptr,  # (N,) fp32 out: coef * z_loss_scale * lse^2, if COMPUTE_LOSS
    lse_ptr,  # (N,) fp32: written if COMPUTE_LOSS, else read
    partials_ptr,  # (N, K, 3) fp32 scratch: per chunk max, sum of exp, sum of x (if SPLIT)
    arrivals_ptr,  # (N,) int32 zeros: chunks of the row that published their partials
    # shapes
    V,
    K,  # chunks per row, cdiv(V, CHUNK)
    # strides
    stride_logits_n,
    stride_grad_n,
    stride_grad_out_n,  # 0 broadcasts one upstream gradient to every row
    # hyperparameters: runtime floats, so a new value does not recompile
    label_smoothing,
    z_loss_scale,
    softcap,  # 0.0 = no softcap
    # switches
    COMPUTE_LOSS: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    HAS_GRAD_OUT: tl.constexpr,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z_LOSS: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    SPLIT: tl.constexpr,
    CHUNK: tl.constexpr,
    MAX_K: tl.constexpr,  # next power of 2 of K
):
    # Program (row, k) owns columns [k * CHUNK, (k+1) * CHUNK) of one row and keeps them in
    # registers from the loss to the gradient: the logits are read from memory once and the
    # gradient written once (2 * N * V element moves, the floor).
    pid = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 at LLM shapes
    row = pid // K
    k = pid % K
    cols = k * CHUNK + tl.arange(0, CHUNK)
    mask = cols < V
    grad_row = grad_ptr + row * stride_grad_n
    coef = tl.load(coef_ptr + row)

    if coef != 0.0:
        logits_row = logits_ptr + row * stride_logits_n
        target = tl.load(targets_ptr + row)
        # Labels are range-checked on the host unless tracing; here an out-of-range label
        # must not read out of bounds and must not pass silently: its loss and gradient are NaN.
        bad_target = (target < 0) | (target >= V)
        target = tl.where(bad_target, 0, target)
        x = tl.load(logits_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            x = _apply_softcap(x, softcap)

        if COMPUTE_LOSS:
            # Read before the first reduction's barrier and before this row's arrival: once
            # every chunk has arrived, in-place gradients may overwrite the target's logit.
            x_target = tl.load(logits_row + target).to(tl.float32)
            if HAS_SOFTCAP:
                x_target = _apply_softcap(x_target, softcap)
            x_max = tl.max(tl.where(mask, x, float("-inf")), 0)
            sum_exp = tl.sum(tl.where(mask, tl.exp(x - x_max), 0.0), 0)
            x_sum = tl.sum(tl.where(mask, x, 0.0), 0)
            if SPLIT:
                # Publish this chunk's partials, then wait until every chunk of the row has.
                # The K programs of a row are adjacent in launch order and K is far below the
                # programs the GPU holds at once, so the ones waited for are resident or next.
                part = partials_ptr + (row * K + k) * 3
                tl.store(part, x_max)
                tl.store(part + 1, sum_exp)
                tl.store(part + 2, x_sum)
                tl.debug_barrier()  # every thread's stores precede the release below
                arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="release") + 1
                while arrived < K:
                    arrived = tl.atomic_add(arrivals_ptr + row, 0, sem="acquire")
                ks = tl.arange(0, MAX_K)
                part_row = partials_ptr + row * K * 3 + ks * 3
                # volatile: the partials come from other multiprocessors, never from this L1
                maxes = tl.load(part_row, mask=ks < K, other=float("-inf"), volatile=True)
                sums = tl.load(part_row + 1, mask=ks < K, other=0.0, volatile=True)
                x_sum = tl.sum(tl.load(part_row + 2, mask=ks < K, other=0.0, volatile=True), 0)
                x_max = tl.max(maxes, 0)
                sum_exp = tl.sum(sums * tl.exp(maxes - x_max), 0)
            lse = x_max + tl.log(sum_exp)
            if k == 0:
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
            d = tl.exp(x - lse) * p_scale
            if HAS_SMOOTHING:
                d -= label_smoothing / V
            # p_y - (1 - eps) is formed in fp32, so p_y near 1 does not cancel in bf16.
            d = tl.where(cols == target, d - (1.0 - label_smoothing), d)
            if HAS_SOFTCAP:
                d *= 1.0 - (x / softcap) * (x / softcap)
            # Every element was loaded into registers above, so grad_ptr may alias the logits.
            tl.store(grad_row + cols, (g * d).to(grad_ptr.dtype.element_ty), mask=mask)
    else:
        # Not a target: no loss, a zero gradient, and the logits are never read.
        if COMPUTE_LOSS:
            if k == 0:
                tl.store(loss_ptr + row, 0.0)
                tl.store(z_ptr + row, 0.0)
                tl.store(lse_ptr + row, 0.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros((CHUNK,), tl.float32).to(grad_ptr.dtype.element_ty)
            tl.store(grad_row + cols, zeros, mask=mask)


@triton.jit
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
    # Backward of the fused path. The branch is taken on the device, so the common case of an
    # upstream gradient of exactly 1 costs one launch of idle programs, no pass over N*V and no
    # host sync; any other value (loss scaling, Trainer's loss * num_processes) is honoured.
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


def _launch_config(vocab_size: int, device: torch.device) -> dict:
    """Columns per program (CHUNK) and warps for rows of ``vocab_size`` logits."""
    if interpreting() or device.type != "cuda":
        # The interpreter runs programs one after another, so the programs of a row could never
        # wait for each other: one chunk per row there (the split path runs on GPUs only).
        return dict(CHUNK=triton.next_power_of_2(vocab_size), num_warps=1)
    # 16384 fp32 values over 8 warps is 64 registers a thread for the chunk: held from the
    # loss to the gradient without spilling, with 32 KB of bf16 loads in flight per program.
    return dict(CHUNK=min(triton.next_power_of_2(vocab_size), 16384), num_warps=8)


def _launch(
    logits: torch.Tensor,
    grad: torch.Tensor | None,
    targets: torch.Tensor,
    coef: torch.Tensor,
    grad_rows: torch.Tensor | None,
    loss: torch.Tensor,
    z_rows: torch.Tensor,
    lse: torch.Tensor,
    *,
    compute_loss: bool,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
) -> None:
    n, vocab = logits.shape
    if n == 0:
        return
    config = _launch_config(vocab, logits.device)
    chunks = triton.cdiv(vocab, config["CHUNK"])
    split = compute_loss and chunks > 1
    partials = torch.empty((n, chunks, 3) if split else (1,), dtype=torch.float32, device=logits.device)
    arrivals = torch.zeros(n if split else 1, dtype=torch.int32, device=logits.device)
    _cross_entropy_kernel[(n * chunks,)](
        logits_ptr=logits,
        grad_ptr=grad if grad is not None else logits,
        targets_ptr=targets,
        coef_ptr=coef,
        grad_out_ptr=grad_rows if grad_rows is not None else coef,
        loss_ptr=loss,
        z_ptr=z_rows,
        lse_ptr=lse,
        partials_ptr=partials,
        arrivals_ptr=arrivals,
        V=vocab,
        K=chunks,
        stride_logits_n=logits.stride(0),
        stride_grad_n=grad.stride(0) if grad is not None else 0,
        stride_grad_out_n=grad_rows.stride(0) if grad_rows is not None else 0,
        label_smoothing=float(label_smoothing),
        z_loss_scale=float(z_loss_scale),
        softcap=float(softcap),
        COMPUTE_LOSS=compute_loss,
        COMPUTE_GRAD=grad is not None,
        HAS_GRAD_OUT=grad_rows is not None,
        MAX_K=triton.next_power_of_2(chunks),
        **config,
    )


def launch_forward(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    grad: torch.Tensor | None,
    *,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Loss rows, z rows and lse; also the gradient for an upstream gradient of 1 if ``grad``.

    Args:
        logits: ``(N, V)`` fp32/bf16/fp16 with unit column stride.
        targets: ``(N,)`` int64. coef: ``(N,)`` fp32.
        grad: ``(N, V)`` buffer of the logits' dtype (may be ``logits`` itself) or None.

    Returns:
        ``(loss, z, lse)``, each ``(N,)`` fp32.
    """
    n = logits.shape[0]
    # three allocations, not views of one: custom-op outputs must not alias each other
    loss, z_rows, lse = (
        torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    _launch(
        logits, grad, targets, coef, None, loss, z_rows, lse, compute_loss=True,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
    )
    return loss, z_rows, lse


def launch_backward(
    logits: torch.Tensor,
    grad: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    *,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
) -> torch.Tensor:
    """Writes ``dL/dlogits`` into ``grad`` from the saved ``lse`` and per-row upstream gradients.

    Args:
        logits, grad: ``(N, V)``, ``grad`` may be ``logits`` itself.
        targets, coef, lse: ``(N,)`` int64 / fp32 / fp32 from the forward.
        grad_rows: ``(N,)`` fp32 upstream gradient, any stride (0 for a broadcast scalar).
    """
    _launch(
        logits, grad, targets, coef, grad_rows, lse, lse, lse, compute_loss=False,
        label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap,
    )
    return grad


def scale_in_place(grad: torch.Tensor, scale: torch.Tensor) -> None:
    """``grad *= scale`` for a 0-d device ``scale``, with no work at all when it is 1."""
    n, vocab = grad.shape
    if n == 0:
        return
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
        BLOCK_V=min(triton.next_power_of_2(vocab), 4096),
        num_warps=8,
    )


class CrossEntropyFunction(torch.autograd.Function):
    """Autograd for eager mode: fused for scalar reductions, recompute for "none"."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,  # (N, V) fp32/bf16/fp16, unit column stride
        targets: torch.Tensor,  # (N,) int64
        coef: torch.Tensor,  # (N,) fp32
        label_smoothing: float,
        z_loss_scale: float,
        softcap: float,
        reduce: bool,  # True: return the sum of the rows ("mean"/"sum"); False: the rows
        inplace_backward: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hyper = dict(label_smoothing=label_smoothing, z_loss_scale=z_loss_scale, softcap=softcap)
        needs_grad = ctx.needs_input_grad[0]
        # With one scalar upstream gradient the whole gradient is known up to that scalar now,
        # so compute it in the same pass that reads the logits for the loss.
        fused = needs_grad and reduce
        grad = None
        if fused:
            grad = logits if inplace_backward else torch.empty_like(logits)
        loss, z_rows, lse = launch_forward(logits, targets, coef, grad, **hyper)
        if reduce:
            loss, z_rows = loss.sum(), z_rows.sum()
        ctx.mark_non_differentiable(z_rows)
        ctx.fused, ctx.inplace_backward, ctx.hyper = fused, inplace_backward, hyper
        ctx.backward_done = False
        if fused:
            ctx.save_for_backward(grad)
        elif needs_grad:
            ctx.save_for_backward(logits, targets, coef, lse)
        return loss, z_rows

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_z: torch.Tensor):
        if ctx.backward_done:
            # The fused gradient is scaled in place: a second backward would scale it twice.
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
            launch_backward(
                logits, grad, targets, coef, lse, grad_loss.float(), **ctx.hyper
            )
        # One gradient per forward input: logits, then targets, coef and the five options.
        return grad, None, None, None, None, None, None, None


# torch.compile path: two functional custom ops with registered autograd and fake kernels, so
# that a compiled graph keeps the Triton kernels as opaque calls with no graph break.


@torch.library.custom_op("packed_ce::cross_entropy_forward", mutates_args=())
def cross_entropy_forward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return launch_forward(
        logits,
        targets,
        coef,
        None,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
    )


@cross_entropy_forward_op.register_fake
def _(logits, targets, coef, label_smoothing, z_loss_scale, softcap):
    rows = logits.new_empty(logits.shape[0], dtype=torch.float32)
    return rows, torch.empty_like(rows), torch.empty_like(rows)


@torch.library.custom_op("packed_ce::cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
) -> torch.Tensor:
    return launch_backward(
        logits,
        torch.empty_like(logits),
        targets,
        coef,
        lse,
        grad_rows.float(),
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
    )


@cross_entropy_backward_op.register_fake
def _(logits, targets, coef, lse, grad_rows, label_smoothing, z_loss_scale, softcap):
    return torch.empty_like(logits)


def _setup_context(ctx, inputs, output):
    logits, targets, coef, label_smoothing, z_loss_scale, softcap = inputs
    ctx.save_for_backward(logits, targets, coef, output[2])
    ctx.hyper = (label_smoothing, z_loss_scale, softcap)


def _backward(ctx, grad_loss_rows, grad_z_rows, grad_lse):
    logits, targets, coef, lse = ctx.saved_tensors
    grad = cross_entropy_backward_op(logits, targets, coef, lse, grad_loss_rows, *ctx.hyper)
    # One gradient per forward input: logits, then targets, coef and the three options.
    return grad, None, None, None, None, None


cross_entropy_forward_op.register_autograd(_backward, setup_context=_setup_context)


def triton_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    coef: torch.Tensor,
    *,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float,
    reduce: bool,
    inplace_backward: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, z)``: 0-d fp32 sums if ``reduce``, else ``(N,)`` fp32 rows (z detached).

    Args:
        logits: ``(N, V)`` fp32/bf16/fp16 with unit column stride.
        targets: ``(N,)`` int64; coef: ``(N,)`` fp32 (see :mod:`packed_ce.targets`).
    """
    if torch.compiler.is_compiling():
        loss, z_rows, _ = cross_entropy_forward_op(
            logits, targets, coef, label_smoothing, z_loss_scale, softcap
        )
        if reduce:
            return loss.sum(), z_rows.sum().detach()
        return loss, z_rows.detach()
    return CrossEntropyFunction.apply(
        logits, targets, coef, label_smoothing, z_loss_scale, softcap, reduce, inplace_backward
    )
