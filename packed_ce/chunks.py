"""The chunk engine of :func:`packed_ce.fused_linear_cross_entropy`: the LM head and the packed
loss over row chunks, without the ``(N, V)`` logits.

Notation: ``X = hidden`` ``(N, H)``, ``W = weight`` ``(V, H)``, ``b = bias`` ``(V,)``, logits
``Z = X W^T + b`` ``(N, V)``, and ``L = sum_t coef[t] * l_t(Z_t)`` (docs/reference.md, "The loss,
exactly"; ``coef`` from :mod:`packed_ce.targets`). With
``G = dL/dZ`` ``(N, V)`` (the cross-entropy kernel's output), the chain rule through the linear
layer gives

    dL/dX = G W            (N, V) @ (V, H)
    dL/dW = G^T X          (V, N) @ (N, H)  = sum over row chunks c of G_c^T X_c
    dL/db = 1^T G          column sums of G

Every term is a sum over rows, so rows go in chunks of ``C``: one ``(C, V)`` logits buffer, reused.
Rows without a target (``coef == 0``) have ``G_t = 0`` and may skip the GEMMs (their number costs
one host wait, ``drop_ignored_rows``).

- "mean" / "sum" (one scalar upstream ``g``): the forward computes the loss and the gradients for
  ``g = 1`` in one pass per chunk (GEMM, kernel writing ``G_c`` over ``Z_c``, two GEMMs); the
  backward rescales by ``g`` (nothing on the device when ``g == 1``, no host sync). ``6 M H V``
  FLOPs.
- "none" (``g`` per row, ``dL/dW = G^T diag(g) X`` cannot be rescaled later), and fp16 for every
  reduction (its ``G`` must see the loss scale or small entries flush to zero): the forward keeps
  ``lse``, the backward recomputes each chunk's logits. ``8 M H V`` FLOPs.

Extra memory: the ``(C, V)`` buffer and, when dropping rows, two ``(C, H)`` blocks, at most 256 MiB
together by default; with ``grad_accumulation_dtype=torch.float32`` and a half-precision weight,
the float32 ``(V, H)`` accumulator of ``dL/dW``.

Dimensions: N tokens, H hidden size, V vocabulary, C rows per chunk, M rows through the GEMMs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .options import ChunkOptions, LossOptions
from .reference import compute_dtype, token_losses, token_stats_rows
from .runtime import check_first_order, is_tracing
from .targets import Targets

# Bytes of one chunk of logits: 1024 rows at V=128256 in bf16 (full GEMM tiles), an eighth of
# the (N, V) logits at N=8192.
CHUNK_BYTES = 256 * 2**20
# Chunks are a multiple of this many rows, so that every GEMM but the last one runs whole tiles.
CHUNK_ROW_MULTIPLE = 128
# N * H * V from which drop_ignored_rows=None drops rows on a GPU. The count costs one host wait
# (the device idles 0.1-0.6 ms on an H100); with 22% of rows without a target dropping broke
# even at 2**38 and saved 16% at 2**41: 2**40 keeps a margin.
DROP_MIN_WORK = 2**40


def default_chunk_size(vocab_size: int, dtype: torch.dtype, gathered_width: int = 0) -> int:
    """Rows per chunk: at most :data:`CHUNK_BYTES` of ``dtype`` per chunk, a multiple of 128 rows.

    Args:
        vocab_size: V, the columns of a chunk of logits.
        dtype: of the chunk of logits.
        gathered_width: more columns of ``dtype`` per row that exist with each chunk: ``2 H``
            when rows are dropped (the gathered ``(C, H)`` rows and their ``(C, H)`` gradient).
    """
    rows = CHUNK_BYTES // ((vocab_size + gathered_width) * dtype.itemsize)
    return max(CHUNK_ROW_MULTIPLE, rows // CHUNK_ROW_MULTIPLE * CHUNK_ROW_MULTIPLE)


def drops_rows(choice: bool | None, hidden: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rows without a target skip the GEMMs (``ChunkOptions.drop_ignored_rows``).

    Args:
        choice: the option: True, False, or None to decide here.
        hidden: ``(N, H)``. weight: ``(V, H)``.
    """
    if is_tracing():
        return False  # the row count would be data-dependent, and a host sync is impossible
    if choice is not None:
        return choice
    if hidden.device.type == "cpu":
        return True  # counting the rows waits for nothing
    if hidden.device.type != "cuda" or torch.cuda.get_sync_debug_mode() != 0:
        return False  # another device, or a user who asked to hear of every host sync
    return hidden.numel() * weight.shape[0] >= DROP_MIN_WORK


# --- the per-chunk cross entropy: the Triton kernel, or the PyTorch reference -----------------


@dataclass(frozen=True)
class _ChunkLoss:
    """How one backend computes the loss and ``dL/dZ`` of a chunk of logits.

    forward(z, targets, coef, write_grad, stats) -> (loss, z_term, lse), each ``(C,)``; with
        ``write_grad`` ``z`` becomes ``dL/dZ`` for ``g = 1``; ``stats`` ``(C, 3)`` or None.
    backward(z, targets, coef, lse, grad_rows): ``z`` becomes ``dL/dZ`` for ``grad_rows`` ``(C,)``.
    scale(grad, g): ``grad *= g`` in place for a 2-D ``grad`` and a 0-d device ``g``.
    """

    forward: Callable
    backward: Callable
    scale: Callable


def _triton_chunk_loss(options: LossOptions) -> _ChunkLoss:
    from .kernels.cross_entropy import launch, scale_in_place

    floats = options.kernel_floats

    def forward(z, targets, coef, write_grad, stats):
        # the kernel reads each element of a row before writing its gradient: in place is safe
        return launch(z, targets, coef, floats, grad=z if write_grad else None, stats=stats)

    def backward(z, targets, coef, lse, grad_rows):
        launch(z, targets, coef, floats, lse=lse, grad=z, grad_rows=grad_rows.float())

    return _ChunkLoss(forward=forward, backward=backward, scale=scale_in_place)


def _torch_chunk_loss(options: LossOptions) -> _ChunkLoss:
    def rows(z, targets, coef, grad_rows=None):
        """``(coef * l, coef * z_term)`` of a chunk; also ``dL/dZ`` into ``z`` if ``grad_rows``."""
        x = z.detach().to(coef.dtype).requires_grad_(grad_rows is not None)
        with torch.enable_grad():  # autograd through the reference on the upcast chunk
            loss, z_term = token_losses(x, targets, options, coef)
            loss, z_term = coef * loss, coef * z_term
            if grad_rows is not None:
                (grad,) = torch.autograd.grad(loss, x, grad_rows.to(loss.dtype))
                z.copy_(grad)
        return loss.detach(), z_term.detach()

    def forward(z, targets, coef, write_grad, stats):
        # before rows() may overwrite z with its gradient; a pass over the chunk: only when asked
        if options.return_token_stats:
            stats[:, :2] = token_stats_rows(z, targets, options)
        ones = torch.ones_like(coef) if write_grad else None
        # no lse: the backward below recomputes everything from the logits
        return (*rows(z, targets, coef, ones), None)

    def backward(z, targets, coef, lse, grad_rows):
        rows(z, targets, coef, grad_rows)

    def scale(grad, g):
        grad.mul_(g.to(grad.dtype))

    return _ChunkLoss(forward=forward, backward=backward, scale=scale)


# --- the chunk loop ---------------------------------------------------------------------------


@functools.cache
def _addmm_accumulates_in_fp32(device: torch.device) -> bool:
    """Whether this PyTorch's CUDA ``addmm`` adds a half-precision product into an fp32 tensor.

    ``out_dtype`` exists since PyTorch 2.8, and early versions required ``self`` to have the
    factors' dtype; the check raises on the host before any launch, so probing costs no sync.
    """
    acc = torch.zeros(2, 2, device=device)
    half = torch.zeros(2, 2, device=device, dtype=torch.bfloat16)
    try:
        torch.addmm(acc, half, half, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return True


def _matmul_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """``out = a @ b`` or ``out += a @ b``; ``out`` may be wider than ``a`` and ``b``.

    Args:
        out: ``(V, H)`` of ``a``'s dtype or float32 (a wider accumulator).
        a, b: ``(V, C)`` and ``(C, H)`` of one dtype.
    """
    beta = 1 if accumulate else 0  # beta=0: out's old contents are ignored, even NaN
    if out.dtype == a.dtype:
        out.addmm_(a, b, beta=beta)
    elif out.is_cuda and _addmm_accumulates_in_fp32(out.device):
        # the GEMM accumulates in fp32 anyway; this keeps its result in fp32 too
        torch.addmm(out, a, b, beta=beta, out_dtype=out.dtype, out=out)
    else:
        # CPU, or a PyTorch without out_dtype: upcast copies of the factors (slower, exact)
        out.addmm_(a.to(out.dtype), b.to(out.dtype), beta=beta)


@dataclass
class _Chunks:
    """The rows that go through the GEMMs, ``size`` at a time.

    Rows without a target (``coef == 0``) add nothing and may be left out of every GEMM.

    Attributes:
        n: N, the number of rows.
        size: C, rows per chunk.
        rows: ``(M,)`` int64 ascending indices of the rows taken, or None (M = N): chunks are
            then slices of the inputs (views, no copy) instead of gathered rows.
    """

    n: int
    size: int
    rows: torch.Tensor | None

    @property
    def count(self) -> int:
        """M, the number of rows taken."""
        return self.n if self.rows is None else self.rows.numel()

    def __iter__(self):
        """``(position, selection)`` per chunk: a slice of the M rows taken, and the same rows
        of the N inputs (that slice, or an index tensor).
        """
        for start in range(0, self.count, self.size):
            position = slice(start, min(start + self.size, self.count))
            yield position, position if self.rows is None else self.rows[position]

    def compact(self, tensor: torch.Tensor) -> torch.Tensor:
        """``(N, ...)`` -> ``(M, ...)``: the rows taken."""
        return tensor if self.rows is None else tensor[self.rows]

    def expand(self, values: torch.Tensor) -> torch.Tensor:
        """``(M,)`` -> ``(N,)``: zeros in the rows left out."""
        if self.rows is None:
            return values
        return values.new_zeros(self.n).index_copy_(0, self.rows, values)


def _take(tensor: torch.Tensor, selection) -> torch.Tensor:
    """The rows of a chunk: a view for a slice, a gathered copy (C rows) for an index tensor."""
    return tensor[selection] if isinstance(selection, slice) else tensor.index_select(0, selection)


@dataclass
class _Grads:
    """Gradient buffers filled chunk by chunk; None where no gradient is needed.

    Attributes:
        hidden: ``(N, H)`` of the hidden dtype, each chunk's rows written once.
        weight: ``(V, H)`` accumulator, the weight's dtype or float32.
        bias: ``(V,)`` accumulator, float32 (float64 for a float64 bias): only V numbers.
    """

    hidden: torch.Tensor | None
    weight: torch.Tensor | None
    bias: torch.Tensor | None

    @classmethod
    def allocate(cls, hidden, weight, bias, needs, accumulation_dtype, chunks: _Chunks) -> _Grads:
        vocab = weight.shape[0]
        # rows left out of the chunks keep a zero gradient
        make_hidden = torch.empty if chunks.rows is None else torch.zeros
        # the first chunk overwrites the accumulator (beta=0), so it needs no memset of V*H,
        # unless no chunk runs at all
        make_weight = torch.empty if chunks.count > 0 else torch.zeros
        return cls(
            hidden=make_hidden(hidden.shape, dtype=hidden.dtype, device=hidden.device)
            if needs[0]
            else None,
            weight=make_weight(weight.shape, dtype=accumulation_dtype, device=weight.device)
            if needs[1]
            else None,
            bias=torch.zeros(
                vocab, dtype=torch.promote_types(bias.dtype, torch.float32), device=bias.device
            )
            if needs[2] and bias is not None
            else None,
        )

    def add_chunk(self, grad_z, hidden_c, weight, selection, first: bool) -> None:
        """Adds the contribution of one chunk.

        Args:
            grad_z: ``(C, V)`` ``dL/dZ_c``, the hidden dtype. hidden_c: ``(C, H)``, its rows.
            weight: ``(V, H)``. selection: the chunk's rows of the N (slice or index tensor).
            first: the first chunk, which overwrites the dL/dW accumulator.
        """
        if self.hidden is not None:
            # dL/dX_c = G_c W: these rows depend on this chunk only, written once
            if isinstance(selection, slice):
                torch.mm(grad_z, weight, out=self.hidden[selection])
            else:
                self.hidden.index_copy_(0, selection, grad_z @ weight)
        if self.weight is not None:
            # dL/dW += G_c^T X_c
            _matmul_into(self.weight, grad_z.t(), hidden_c, accumulate=not first)
        if self.bias is not None:
            # dL/db += 1^T G_c, summed in fp32 (or fp64)
            self.bias += grad_z.sum(0, dtype=self.bias.dtype)

    def finish(self, weight, bias) -> tuple[torch.Tensor | None, ...]:
        """``(dL/dX, dL/dW, dL/db)`` in the dtypes of their inputs."""
        grad_weight = self.weight.to(weight.dtype) if self.weight is not None else None
        grad_bias = self.bias.to(bias.dtype) if self.bias is not None else None
        return self.hidden, grad_weight, grad_bias


def _linear_into(out, hidden_c, weight, bias) -> torch.Tensor:
    """``out = hidden_c @ weight.T (+ bias)``: F.linear's GEMM, in the input dtype.

    Args:
        out: ``(C, V)`` contiguous, the hidden dtype. hidden_c: ``(C, H)``.
        weight: ``(V, H)``. bias: ``(V,)`` or None.
    """
    if bias is None:
        return torch.mm(hidden_c, weight.t(), out=out)
    return torch.addmm(bias, hidden_c, weight.t(), out=out)


def _forward_chunks(hidden, weight, bias, targets, coef, chunks, chunk_loss, grads, stats=None):
    """Loss rows, z-term rows and lse; also fills ``grads`` (upstream gradient 1) if given.

    Args:
        hidden: ``(N, H)``; weight: ``(V, H)``; bias: ``(V,)`` or None; one float dtype.
        targets: ``(M,)`` int64 and coef: ``(M,)`` fp32 (fp64 for fp64 inputs) of the rows
            taken (:meth:`_Chunks.compact`).
        chunks: :class:`_Chunks`. grads: :class:`_Grads` or None.
        stats: ``(M, 3)`` fp32 buffer for each taken row's entropy and top-1 hit (columns 0-1),
            or None.

    Returns:
        ``(loss, z_term, lse)``: ``(M,)`` in coef's dtype; lse None on the torch backend.
    """
    buffer = hidden.new_empty(min(chunks.size, chunks.count), weight.shape[0])  # (C, V), reused
    loss_rows, z_rows, lse_rows = [coef.new_zeros(0)], [coef.new_zeros(0)], []
    for position, selection in chunks:
        hidden_c = _take(hidden, selection)
        z = _linear_into(buffer[: len(hidden_c)], hidden_c, weight, bias)
        loss, z_term, lse = chunk_loss.forward(
            z,
            targets[position],
            coef[position],
            grads is not None,
            stats[position] if stats is not None else None,
        )
        if grads is not None:
            grads.add_chunk(z, hidden_c, weight, selection, first=position.start == 0)
        loss_rows.append(loss)
        z_rows.append(z_term)
        lse_rows.append(lse)
    lse = torch.cat(lse_rows) if lse_rows and lse_rows[0] is not None else None  # None: torch
    return torch.cat(loss_rows), torch.cat(z_rows), lse


def _backward_chunks(
    hidden, weight, bias, targets, coef, lse, grad_rows, chunks, chunk_loss, grads
):
    """Fills ``grads`` for per-row upstream gradients, recomputing each chunk's logits.

    Args: as :func:`_forward_chunks`, plus lse ``(M,)`` fp32 from the forward (None on the torch
    backend) and grad_rows ``(M,)``, the upstream gradient of every row taken (any stride).
    """
    buffer = hidden.new_empty(min(chunks.size, chunks.count), weight.shape[0])
    for position, selection in chunks:
        hidden_c = _take(hidden, selection)
        z = _linear_into(buffer[: len(hidden_c)], hidden_c, weight, bias)
        chunk_loss.backward(
            z,
            targets[position],
            coef[position],
            lse[position] if lse is not None else None,
            grad_rows[position],
        )
        grads.add_chunk(z, hidden_c, weight, selection, first=position.start == 0)


# --- autograd -------------------------------------------------------------------------------


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for the chunked LM head + loss: gradients in the forward for "mean"/"sum",
    recomputation in the backward for "none" (see the module docstring).
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,  # (N, H) fp32/bf16/fp16 (fp64 on the torch backend)
        weight: torch.Tensor,  # (V, H) hidden's dtype
        bias: torch.Tensor | None,  # (V,) hidden's dtype
        targets: torch.Tensor,  # (N,) int64, from prepare_targets
        coef: torch.Tensor,  # (N,) fp32 (fp64 with fp64 inputs), from prepare_targets
        chunk_loss: _ChunkLoss,
        chunk_size: int,
        accumulation_dtype: torch.dtype,  # of the dL/dW accumulator
        drop_ignored_rows: bool,  # leave rows with coef == 0 out of the GEMMs (one host sync)
        reduce: bool,  # True: return the sum of the rows ("mean"/"sum"); False: the rows
        compute_grad: bool,  # grad mode is on (ctx.needs_input_grad ignores torch.no_grad)
        stats: torch.Tensor | None = None,  # (N, 3) fp32 zeros, filled in the taken rows
    ) -> tuple[torch.Tensor, torch.Tensor]:
        needs = tuple(compute_grad and flag for flag in ctx.needs_input_grad[:3])
        # nonzero waits for the device: the host needs M to size the GEMMs
        rows = torch.nonzero(coef).squeeze(1) if drop_ignored_rows else None
        if rows is not None and rows.numel() == hidden.shape[0]:
            rows = None  # every row has a target: slices of the inputs, no gathered copies
        chunks = _Chunks(n=hidden.shape[0], size=chunk_size, rows=rows)
        targets, coef = chunks.compact(targets), chunks.compact(coef)
        # fp16 recomputes in the backward, as "none" does: dL/dZ computed now for g = 1 would
        # flush its small entries to zero before the loss scale of fp16 training reaches it.
        ctx.fused = reduce and any(needs) and hidden.dtype != torch.float16
        ctx.backward_done = False
        ctx.chunk_loss, ctx.chunk_size = chunk_loss, chunk_size
        ctx.accumulation_dtype, ctx.needs = accumulation_dtype, needs
        grads = None
        if ctx.fused:
            grads = _Grads.allocate(hidden, weight, bias, needs, accumulation_dtype, chunks)
        # the stats of the taken rows, in one (M, 3) block when rows are left out
        taken_stats = stats if stats is None or rows is None else stats.new_zeros(rows.numel(), 3)
        loss, z_rows, lse = _forward_chunks(
            hidden, weight, bias, targets, coef, chunks, chunk_loss, grads, taken_stats
        )
        if taken_stats is not None:
            taken_stats[:, 2] = loss  # the rows' weighted losses, before they are summed
        if taken_stats is not None and rows is not None:
            stats.index_copy_(0, rows, taken_stats)
        if ctx.fused:
            ctx.save_for_backward(*grads.finish(weight, bias))
        elif any(needs):
            ctx.save_for_backward(hidden, weight, bias, targets, coef, lse, rows)
        if reduce:
            loss, z_rows = loss.sum(), z_rows.sum()
        else:
            loss, z_rows = chunks.expand(loss), chunks.expand(z_rows)
        ctx.mark_non_differentiable(z_rows)
        return loss, z_rows

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_z: torch.Tensor):
        check_first_order(
            "packed_ce.fused_linear_cross_entropy",
            "cross_entropy(F.linear(hidden, weight, bias), ..., backend='torch')",
        )
        if ctx.backward_done:
            # The fused gradients are scaled in place: a second backward would scale them twice.
            # The recompute path ("none", fp16) refuses too, so that every path behaves alike.
            raise RuntimeError(
                "packed_ce.fused_linear_cross_entropy supports one backward per forward; "
                "recompute the loss instead of retain_graph=True"
            )
        ctx.backward_done = True
        if ctx.fused:
            grads = ctx.saved_tensors
            # d(g L)/d. = g dL/d.: rescale the gradients computed for g = 1 (free when g == 1)
            for grad in grads:
                if grad is not None:
                    ctx.chunk_loss.scale(grad.view(-1, grad.shape[-1]), grad_loss)
            grad_hidden, grad_weight, grad_bias = grads
        else:
            hidden, weight, bias, targets, coef, lse, rows = ctx.saved_tensors
            chunks = _Chunks(n=hidden.shape[0], size=ctx.chunk_size, rows=rows)
            grads = _Grads.allocate(hidden, weight, bias, ctx.needs, ctx.accumulation_dtype, chunks)
            # a 0-d upstream gradient (fp16 reductions) is broadcast with stride 0
            grad_rows = grad_loss.expand(hidden.shape[0]) if grad_loss.dim() == 0 else grad_loss
            with torch.autocast(hidden.device.type, enabled=False):
                _backward_chunks(
                    hidden,
                    weight,
                    bias,
                    targets,
                    coef,
                    lse,
                    chunks.compact(grad_rows),
                    chunks,
                    ctx.chunk_loss,
                    grads,
                )
            grad_hidden, grad_weight, grad_bias = grads.finish(weight, bias)
        # One gradient per forward input: hidden, weight, bias, then targets, coef and the
        # six options (chunk_loss, chunk_size, accumulation_dtype, drop_ignored_rows, reduce,
        # compute_grad), and the stats buffer.
        return (
            grad_hidden,
            grad_weight,
            grad_bias,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


@torch.compiler.disable
def _fused_linear_rows(*args) -> tuple[torch.Tensor, torch.Tensor]:
    # Runs eagerly inside a compiled model (one graph break at the loss): a handful of GEMMs
    # and kernel launches per chunk, nothing for the compiler to fuse, and in-place gradients
    # that a functional graph could not hand back.
    return FusedLinearCrossEntropyFunction.apply(*args)


def chunked_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    prepared: Targets,
    *,
    backend: str,
    options: LossOptions,
    chunk_options: ChunkOptions,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss rows of ``hidden @ weight.T + bias`` computed chunk by chunk, with autograd.

    Args:
        hidden: ``(N, H)`` fp32/bf16/fp16 (fp64 on the torch backend), after autocast.
        weight: ``(V, H)`` and bias: ``(V,)`` or None, hidden's dtype and device.
        prepared: ``(N,)`` targets and coefficients (:func:`packed_ce.targets.prepare_targets`).
        backend: "triton" or "torch": which per-chunk cross entropy runs.
        options, chunk_options: the call's options.
        stats: ``(N, 3)`` fp32 zeros or None: receives each row's entropy, top-1 hit and
            ``coef_t * l_t``, from the chunks of logits the loss reads (rows without a target
            stay 0).

    Returns:
        ``(loss, z_loss)``: 0-d sums for "mean"/"sum", ``(N,)`` rows for "none"; z_loss detached.
    """
    chunk_loss = _triton_chunk_loss(options) if backend == "triton" else _torch_chunk_loss(options)
    drop = drops_rows(chunk_options.drop_ignored_rows, hidden, weight)
    chunk_size = chunk_options.chunk_size
    if chunk_size is None:
        # the torch backend also holds the chunk upcast to the compute dtype
        dtype = compute_dtype(hidden.dtype) if backend == "torch" else hidden.dtype
        chunk_size = default_chunk_size(weight.shape[0], dtype, 2 * hidden.shape[1] if drop else 0)
    accumulation_dtype = weight.dtype
    wider = chunk_options.grad_accumulation_dtype
    if wider is not None and wider.itemsize > weight.dtype.itemsize:
        accumulation_dtype = wider
    compute_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    with torch.autocast(hidden.device.type, enabled=False):
        return _fused_linear_rows(
            hidden,
            weight,
            bias,
            prepared.targets,
            prepared.coef,
            chunk_loss,
            chunk_size,
            accumulation_dtype,
            drop,
            options.reduction != "none",
            compute_grad,
            stats,
        )
