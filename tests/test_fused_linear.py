"""fused_linear_cross_entropy against cross_entropy on the explicit F.linear logits.

Loss and all three gradients (hidden, weight, bias) for every option. On CPU (CI) the Triton
kernel runs through the interpreter in float32, and the torch backend runs the same chunked
algorithm in float64 at round-off tolerance; tests marked ``cuda`` run the compiled kernel in
bf16 and at a size whose ``N * V`` passes 2**31. Chunks are a few rows long, so that every case
runs several chunks and a partial last one (the chunk loop is what this file tests; the
kernel's own block loop is tested in test_cross_entropy.py, so most vocabularies here fit one
interpreter block and keep the interpreter quick).
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import pytest
import torch
import torch.nn.functional as F

import packed_ce
from packed_ce import chunks
from packed_ce.fused_linear import FusedLinearPackedCrossEntropyLoss, fused_linear_cross_entropy
from packed_ce.targets import prepare_targets

from loss_utils import (
    HAS_CUDA,
    INTERPRETING,
    KERNEL_DEVICES,
    OPTION_SETS,
    seed_for_test,
    random_packing,
    relative_error,
)

V = 211  # unaligned: one interpreter block with a masked tail
V_MULTI_BLOCK = 1531  # two full interpreter blocks and a masked tail
H = 24
CHUNK = 7  # rows per chunk: 20 tokens run 2 full chunks and a partial one
# relative error of loss and gradients of the kernel in float32 against a float64 reference
FP32_TOL = 2e-5


def _inputs(gen, prefix, vocab, dtype, device, bias=True, hidden_size=H):
    """``hidden`` ``(*prefix, H)``, ``weight`` ``(V, H)``, ``bias`` ``(V,)``: logits of std ~3."""
    hidden = torch.randn(*prefix, hidden_size, generator=gen, dtype=torch.float64)
    weight = (
        torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64)
        * 3
        / math.sqrt(hidden_size)
    )
    b = torch.randn(vocab, generator=gen, dtype=torch.float64) if bias else None
    return tuple(
        t.to(device=device, dtype=dtype) if t is not None else None for t in (hidden, weight, b)
    )


def _loss_and_grads(fn, inputs, upstream=None):
    """Loss and the gradients of ``(loss * upstream).sum()`` for every input that is not None."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in inputs]
    loss = fn(*leaves)
    if upstream is None:
        upstream = torch.ones_like(loss)
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None], upstream.to(loss.dtype))
    return loss.detach(), grads


def _explicit(labels, **kwargs):
    """The unfused definition: cross_entropy on materialised logits."""
    return lambda h, w, b: packed_ce.cross_entropy(F.linear(h, w, b), labels, **kwargs)


def _fused(labels, **kwargs):
    return lambda h, w, b: fused_linear_cross_entropy(h, w, labels, bias=b, **kwargs)


def _assert_close(actual, expected, tol):
    (loss, grads), (ref_loss, ref_grads) = actual, expected
    assert loss.shape == ref_loss.shape
    assert relative_error(loss, ref_loss) < tol, "loss"
    for name, grad, ref in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert grad.dtype == ref.dtype or ref.dtype == torch.float64, name
        assert relative_error(grad, ref) < tol, f"grad of {name}"


def _count_gemm_rows(monkeypatch) -> list[int]:
    """A list that receives the row count of every logits GEMM the chunk loop runs from now on."""
    gemm_rows = []
    linear_into = chunks._linear_into

    def counting_linear_into(out, hidden_c, *args):
        gemm_rows.append(len(hidden_c))
        return linear_into(out, hidden_c, *args)

    monkeypatch.setattr(chunks, "_linear_into", counting_linear_into)
    return gemm_rows


def _boundaries(packing, kind):
    return (
        {"cu_seqlens": packing.cu_seqlens}
        if kind == "cu"
        else {"position_ids": packing.position_ids}
    )


# --- every option against the explicit logits ---------------------------------------------


GRID = list(itertools.product(["mean", "sum", "none"], [True, False], [True, False]))


class Layout(NamedTuple):
    """How a grid case's inputs are laid out: (N, H) or (B, T, H) hidden states, cu_seqlens or
    position_ids, with or without a bias, rows without a target dropped from the GEMMs or not."""

    batched: bool
    boundary: str
    bias: bool
    drop: bool

    def __str__(self):
        return "-".join(
            ["(B,T,H)" if self.batched else "(N,H)", self.boundary,
             "bias" if self.bias else "no-bias", "drop" if self.drop else "keep"]
        )


# Every layout, paired with the grid's cases in turn (an explicit part of each test id) instead
# of multiplying the grid by sixteen.
LAYOUTS = [Layout(*case) for case in itertools.product([False, True], ["cu", "pos"], [True, False], [True, False])]


def _with_layouts(cases):
    """``cases`` (tuples of parameters) with a layout appended to each, in turn."""
    return [
        pytest.param(*case, LAYOUTS[i % len(LAYOUTS)], id="-".join(map(str, (*case, LAYOUTS[i % len(LAYOUTS)]))))
        for i, case in enumerate(cases)
    ]


def _grid_case(seed, device, dtype, n_tokens, layout):
    """Random packing and inputs laid out as ``layout``.

    Returns:
        ``(generator, packing, inputs, boundaries, fused_options)``.
    """
    gen = torch.Generator().manual_seed(seed)
    packing = random_packing(
        gen, V, rows=2 if layout.batched else None, row_len=n_tokens // 2, n_tokens=n_tokens, device=device
    )
    inputs = _inputs(gen, packing.labels.shape, V, dtype, device, bias=layout.bias)
    return gen, packing, inputs, _boundaries(packing, layout.boundary), {"drop_ignored_rows": layout.drop}


EXPLICIT_GRID = _with_layouts([(*case, name) for case in GRID for name in OPTION_SETS])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("reduction,is_packed,shift,options,layout", EXPLICIT_GRID)
def test_kernel_matches_explicit_logits(device, reduction, is_packed, shift, options, layout):
    options = OPTION_SETS[options]
    gen, packing, inputs, boundaries, fused = _grid_case(
        seed_for_test(), device, torch.float32, n_tokens=20, layout=layout
    )
    kwargs = dict(boundaries, is_packed=is_packed, shift=shift, reduction=reduction, **options)
    # an arbitrary upstream gradient per token for "none"; other scalars than 1 for the
    # reductions are in test_scalar_upstream_gradient (the interpreter rescales slowly)
    upstream = (
        torch.randn(packing.labels.shape, generator=gen).to(device) if reduction == "none" else None
    )
    ours = _loss_and_grads(
        _fused(packing.labels, backend="triton", chunk_size=CHUNK, **fused, **kwargs),
        inputs,
        upstream,
    )
    inputs64 = [t.double() if t is not None else None for t in inputs]
    reference = _loss_and_grads(
        _explicit(packing.labels, backend="torch", **kwargs), inputs64, upstream
    )
    assert ours[0].dtype == torch.float32
    _assert_close(ours, reference, FP32_TOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("is_packed", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("options", [OPTION_SETS["plain"], OPTION_SETS["all"]], ids=["plain", "all"])
def test_kernel_matches_the_per_sequence_loop(device, is_packed, reduction, options, per_sequence_loss):
    """Against the ground truth that never sees cu_seqlens: F.cross_entropy per sequence."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=24, device=device)
    inputs = _inputs(gen, packing.labels.shape, V, torch.float32, device)
    kwargs = dict(is_packed=is_packed, shift=True, reduction=reduction, **options)
    ours = _loss_and_grads(
        _fused(packing.labels, backend="triton", chunk_size=CHUNK, cu_seqlens=packing.cu_seqlens, **kwargs),
        inputs,
    )
    loop = _loss_and_grads(
        lambda h, w, b: per_sequence_loss(F.linear(h, w, b), packing.labels, packing.slices, **kwargs),
        [t.double() for t in inputs],
    )
    _assert_close(ours, loop, FP32_TOL)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("reduction,layout", _with_layouts([("mean",), ("none",)] * 8))  # every layout
def test_kernel_matches_the_unfused_kernel(device, reduction, layout):
    """Against cross_entropy's own kernel on the explicit float32 logits: the same arithmetic."""
    gen, packing, inputs, boundaries, fused = _grid_case(
        seed_for_test(), device, torch.float32, n_tokens=24, layout=layout
    )
    kwargs = dict(boundaries, is_packed=True, shift=True, reduction=reduction, **OPTION_SETS["all"])
    upstream = (
        torch.rand(packing.labels.shape, generator=gen)
        if reduction == "none"
        else torch.tensor(2.5)
    ).to(device)
    ours = _loss_and_grads(
        _fused(packing.labels, backend="triton", chunk_size=CHUNK, **fused, **kwargs),
        inputs,
        upstream,
    )
    explicit = _loss_and_grads(
        _explicit(packing.labels, backend="triton", **kwargs), inputs, upstream
    )
    _assert_close(ours, explicit, 1e-5)


@pytest.mark.parametrize("reduction,is_packed,shift,options,layout", EXPLICIT_GRID)
def test_torch_backend_float64_matches_explicit_logits(reduction, is_packed, shift, options, layout):
    """The chunk loop in float64: equal to the unfused reference up to round-off."""
    options = OPTION_SETS[options]
    gen, packing, inputs, boundaries, fused = _grid_case(
        seed_for_test(), "cpu", torch.float64, n_tokens=40, layout=layout
    )
    kwargs = dict(boundaries, is_packed=is_packed, shift=shift, reduction=reduction, **options)
    upstream = (
        torch.randn(packing.labels.shape, generator=gen)
        if reduction == "none"
        else torch.tensor(-1.5)
    )
    ours = _loss_and_grads(
        _fused(packing.labels, backend="torch", chunk_size=CHUNK, **fused, **kwargs),
        inputs,
        upstream,
    )
    reference = _loss_and_grads(
        _explicit(packing.labels, backend="torch", **kwargs), inputs, upstream
    )
    assert ours[0].dtype == torch.float64
    _assert_close(ours, reference, 1e-12)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_multi_block_vocabulary(device):
    """A vocabulary spanning several kernel blocks, in chunks, with bias and packing."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_MULTI_BLOCK, n_tokens=24, device=device)
    inputs = _inputs(gen, (24,), V_MULTI_BLOCK, torch.float32, device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, label_smoothing=0.1)
    ours = _loss_and_grads(
        _fused(packing.labels, backend="triton", chunk_size=10, **kwargs), inputs
    )
    reference = _loss_and_grads(
        _explicit(packing.labels, backend="torch", **kwargs), [t.double() for t in inputs]
    )
    _assert_close(ours, reference, FP32_TOL)


# --- chunking, upstream gradients, what needs a gradient ------------------------------------


# (backend, device, dtype, tolerance): the chunk loop in float64 on the torch backend, and the
# kernel in float32 wherever it can run
BACKENDS = [
    pytest.param(("torch", "cpu", torch.float64, 1e-12), id="torch-fp64"),
    *(
        pytest.param(
            ("triton", p.values[0], torch.float32, FP32_TOL),
            marks=p.marks,
            id=f"triton-{p.values[0]}",
        )
        for p in KERNEL_DEVICES
    ),
]


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_chunk_size_does_not_change_the_result(backend_case, reduction):
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    n = 17
    packing = random_packing(gen, V, n_tokens=n, device=device)
    inputs = _inputs(gen, (n,), V, dtype, device)
    kwargs = dict(
        cu_seqlens=packing.cu_seqlens,
        is_packed=True,
        shift=True,
        reduction=reduction,
        backend=backend,
    )
    upstream = torch.rand(n, generator=gen).to(device) if reduction == "none" else None
    # one row per chunk, several with a partial last one, one chunk exactly, one larger than N,
    # and the default (one chunk at these sizes)
    sizes = (1, 4, n, 5 * n, None) if backend == "torch" else (1, 4, None)
    results = [
        _loss_and_grads(_fused(packing.labels, chunk_size=size, **kwargs), inputs, upstream)
        for size in sizes
    ]
    for result in results[1:]:
        _assert_close(result, results[0], tol)


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_rows_without_a_target_skip_the_gemms(backend_case, reduction, monkeypatch):
    """drop_ignored_rows changes the work, not the result. Its default (None) drops the rows on
    CPU, and on a GPU only from DROP_MIN_WORK on (far above these 30 rows: no host sync)."""
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=30, device=device)
    inputs = _inputs(gen, (30,), V, dtype, device)
    kwargs = dict(
        cu_seqlens=packing.cu_seqlens,
        is_packed=True,
        shift=True,
        reduction=reduction,
        backend=backend,
        chunk_size=CHUNK,
    )
    upstream = torch.rand(30, generator=gen).to(device) if reduction == "none" else None
    prepared = prepare_targets(packing.labels, cu_seqlens=packing.cu_seqlens, shift=True)
    with_targets = int((prepared.coef != 0).sum())

    gemm_rows = _count_gemm_rows(monkeypatch)
    results = {}
    for drop, validate in ((None, True), (False, True), (False, False), (True, False), (True, True)):
        gemm_rows.clear()
        results[drop, validate] = _loss_and_grads(
            _fused(packing.labels, drop_ignored_rows=drop, validate=validate, **kwargs),
            inputs,
            upstream,
        )
        dropped = drop or (drop is None and device == "cpu")
        passes = 2 if reduction == "none" else 1  # "none" recomputes the logits in the backward
        assert sum(gemm_rows) == passes * (with_targets if dropped else 30)
    for result in results.values():
        _assert_close(result, results[False, True], tol)


def test_when_rows_without_a_target_are_dropped(monkeypatch):
    """drop_ignored_rows: None drops on CPU and never on another device it cannot judge, True
    and False are obeyed, and nothing drops while tracing (a data-dependent row count)."""
    hidden, weight = torch.zeros(4, 3), torch.zeros(5, 3)
    assert chunks.drops_rows(None, hidden, weight)
    assert chunks.drops_rows(True, hidden, weight)
    assert not chunks.drops_rows(False, hidden, weight)
    assert not chunks.drops_rows(None, hidden.to("meta"), weight.to("meta"))
    monkeypatch.setattr(chunks, "is_tracing", lambda: True)
    assert not chunks.drops_rows(None, hidden, weight)
    assert not chunks.drops_rows(True, hidden, weight)


def test_default_chunk_counts_the_gathered_rows(monkeypatch):
    """The default chunk keeps its working set within CHUNK_BYTES: when rows are dropped, their
    gathered (C, H) rows and (C, H) gradient count beside the (C, V) logits."""
    vocab, hidden_size = 300, 100
    # float64 on the torch backend: 8 bytes; 256 rows of V + 2H columns, 384 rows of V alone
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 256 * (vocab + 2 * hidden_size) * 8)
    gen = torch.Generator().manual_seed(seed_for_test())
    labels = torch.randint(0, vocab, (600,), generator=gen)
    labels[torch.rand(600, generator=gen) < 0.2] = -100
    inputs = _inputs(gen, (600,), vocab, torch.float64, "cpu", hidden_size=hidden_size)
    gemm_rows = _count_gemm_rows(monkeypatch)
    reference = _loss_and_grads(_explicit(labels, backend="torch"), inputs)
    for drop, chunk in ((True, 256), (False, 384)):
        gemm_rows.clear()
        ours = _loss_and_grads(_fused(labels, drop_ignored_rows=drop, backend="torch"), inputs)
        assert max(gemm_rows) == chunk
        _assert_close(ours, reference, 1e-12)


def test_every_row_with_a_target_runs_on_slices(monkeypatch):
    """Nothing to drop: the chunks stay views of the inputs, no row is gathered or scattered."""
    gen = torch.Generator().manual_seed(seed_for_test())
    labels = torch.randint(0, V, (20,), generator=gen)
    inputs = _inputs(gen, (20,), V, torch.float64, "cpu")
    selections = []
    take = chunks._take

    def recording_take(tensor, selection):
        selections.append(selection)
        return take(tensor, selection)

    monkeypatch.setattr(chunks, "_take", recording_take)
    ours = _loss_and_grads(
        _fused(labels, drop_ignored_rows=True, backend="torch", chunk_size=CHUNK), inputs
    )
    assert selections and all(isinstance(s, slice) for s in selections)
    _assert_close(ours, _loss_and_grads(_explicit(labels, backend="torch"), inputs), 1e-12)


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("upstream", [1.0, 0.0, -3.0], ids=["one", "zero", "negative"])
def test_scalar_upstream_gradient(backend_case, upstream):
    """Backward rescales the gradients computed in the forward: on the device, by any value."""
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20, device=device)
    inputs = _inputs(gen, (20,), V, dtype, device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, label_smoothing=0.1)
    scale = torch.tensor(upstream, device=device)
    ours = _loss_and_grads(
        _fused(packing.labels, backend=backend, chunk_size=CHUNK, **kwargs), inputs, scale
    )
    reference = _loss_and_grads(
        _explicit(packing.labels, backend="torch", **kwargs), [t.double() for t in inputs], scale
    )
    if upstream == 0.0:
        assert all(not grad.any() for grad in ours[1])
    else:
        _assert_close(ours, reference, tol)


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("trainable", ["hidden", "weight", "bias", "weight+bias"])
def test_only_the_requested_gradients(backend_case, reduction, trainable):
    """A frozen lm_head (LoRA), frozen hidden states, or only a bias: the others stay None."""
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20, device=device)
    inputs = _inputs(gen, (20,), V, dtype, device)
    leaves = [
        t.clone().requires_grad_(name in trainable)
        for name, t in zip(("hidden", "weight", "bias"), inputs)
    ]
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, reduction=reduction)
    loss = fused_linear_cross_entropy(
        *leaves[:2], packing.labels, bias=leaves[2], backend=backend, chunk_size=CHUNK, **kwargs
    )
    loss.sum().backward()
    reference = _loss_and_grads(
        _explicit(packing.labels, backend="torch", **kwargs), [t.double() for t in inputs]
    )
    for leaf, ref_grad in zip(leaves, reference[1]):
        if leaf.requires_grad:
            assert relative_error(leaf.grad, ref_grad) < tol
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("backend_case", BACKENDS)
def test_no_gradient_work_without_grad_mode(backend_case, monkeypatch):
    """Evaluation (torch.no_grad, parameters that require grad) computes the loss only."""
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20, device=device)
    hidden, weight, bias = _inputs(gen, (20,), V, dtype, device)
    weight.requires_grad_()
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True)
    expected = packed_ce.cross_entropy(
        F.linear(hidden, weight, bias).detach().double(), packing.labels, backend="torch", **kwargs
    )

    def fail(*args, **kwargs):
        raise AssertionError("a gradient was computed under torch.no_grad")

    monkeypatch.setattr(chunks._Grads, "add_chunk", fail)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(
            hidden, weight, packing.labels, bias=bias, backend=backend, chunk_size=CHUNK, **kwargs
        )
    assert not loss.requires_grad
    assert relative_error(loss, expected) < tol


# (backend, device): every path of the chunk loop, the reference's and the kernel's
AUTOGRAD_BACKENDS = [
    pytest.param(("torch", "cpu"), id="torch"),
    *(pytest.param(("triton", p.values[0]), marks=p.marks, id=f"triton-{p.values[0]}") for p in KERNEL_DEVICES),
]


@pytest.mark.parametrize("backend_device", AUTOGRAD_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"], ids=["fused-grad", "recompute"])
def test_second_backward_is_refused(backend_device, reduction):
    """One backward per forward on every path (the gradients of "mean" are scaled in place)."""
    backend, device = backend_device
    hidden = torch.randn(6, H, device=device, requires_grad=True)
    weight = torch.randn(V, H, device=device)
    loss = fused_linear_cross_entropy(
        hidden, weight, torch.arange(6, device=device), backend=backend, chunk_size=4, reduction=reduction
    ).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


@pytest.mark.parametrize("backend_device", AUTOGRAD_BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"], ids=["fused-grad", "recompute"])
def test_higher_order_gradients_are_refused(backend_device, reduction):
    """create_graph=True: the chunked gradients have no graph, so the call is refused."""
    backend, device = backend_device
    hidden = torch.randn(6, H, device=device, requires_grad=True)
    weight = torch.randn(V, H, device=device, requires_grad=True)
    loss = fused_linear_cross_entropy(
        hidden, weight, torch.arange(6, device=device), backend=backend, reduction=reduction
    ).sum()
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss, (hidden, weight), create_graph=True)


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_minus_inf_bias_masks_a_class(backend_case, options):
    """A -inf bias entry (a masked class): the unfused float64 loss and gradients, whose entries
    for that class are 0 (+inf loss under label smoothing, as the unfused definition)."""
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    n = 17
    packing = random_packing(gen, V, n_tokens=n, device=device)
    labels = torch.where(packing.labels == 5, 0, packing.labels)  # no target is masked
    inputs = list(_inputs(gen, (n,), V, torch.float64, "cpu"))
    inputs[2][5] = float("-inf")
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, chunk_size=CHUNK, **options)
    loss, grads = _loss_and_grads(
        _fused(labels, backend=backend, **kwargs), [t.to(device, dtype) for t in inputs]
    )
    kwargs.pop("chunk_size")
    ref_loss, ref_grads = _loss_and_grads(
        _explicit(labels.cpu(), backend="torch", **{**kwargs, "cu_seqlens": packing.cu_seqlens.cpu()}), inputs
    )
    torch.testing.assert_close(loss.cpu().double(), ref_loss, rtol=tol, atol=0)
    for grad, ref in zip(grads, ref_grads):
        assert torch.isfinite(grad).all()
        assert relative_error(grad.cpu(), ref) < tol
    if not options.get("label_smoothing"):
        assert (grads[1][5] == 0).all() and grads[2][5] == 0


# --- the weight-gradient accumulator ------------------------------------------------------


@pytest.mark.parametrize("backend_case", BACKENDS)
def test_accumulation_dtype_is_never_narrower_than_the_weight(backend_case):
    """float32 or the weight's dtype: identical for a float32 (or float64) weight."""
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20, device=device)
    inputs = _inputs(gen, (20,), V, dtype, device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, backend=backend, chunk_size=CHUNK)
    default = _loss_and_grads(_fused(packing.labels, **kwargs), inputs)
    fp32 = _loss_and_grads(
        _fused(packing.labels, grad_accumulation_dtype=torch.float32, **kwargs), inputs
    )
    for grad, ref in zip(fp32[1], default[1]):
        assert grad.dtype == dtype
        torch.testing.assert_close(grad, ref, rtol=0, atol=0)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_float32_accumulator_rounds_once(device):
    """bf16 against the unfused bf16 path, which rounds dL/dW = G^T X once.

    With an fp32 accumulator only the summation order differs; summed in bf16, the 12 chunks
    round 12 times (up to 2**-9 relative each). Everything else is the same arithmetic (on the
    GPU up to how cuBLAS splits the small GEMMs, hence the margins).
    """
    gen = torch.Generator().manual_seed(seed_for_test())
    n = 48
    packing = random_packing(gen, V, n_tokens=n, device=device)
    inputs = _inputs(gen, (n,), V, torch.bfloat16, device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, backend="triton")
    unfused = _loss_and_grads(_explicit(packing.labels, **kwargs), inputs)
    weight_errors = {}
    for accumulation in (None, torch.float32):
        loss, grads = _loss_and_grads(
            _fused(
                packing.labels,
                grad_accumulation_dtype=accumulation,
                chunk_size=4,
                drop_ignored_rows=False,  # 48 rows: 12 chunks
                **kwargs,
            ),
            inputs,
        )
        assert all(grad.dtype == torch.bfloat16 for grad in grads)
        assert relative_error(loss, unfused[0]) < 1e-4
        assert relative_error(grads[0], unfused[1][0]) < 5e-3  # hidden
        assert relative_error(grads[2], unfused[1][2]) < 5e-3  # bias
        weight_errors[accumulation] = relative_error(grads[1], unfused[1][1])
    assert weight_errors[torch.float32] < 1e-3
    assert weight_errors[torch.float32] < weight_errors[None] < 2e-2


# --- options that change the shape or the normaliser ----------------------------------------


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("num_items", [7, "tensor"])
def test_num_items_in_batch(backend_case, num_items):
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20, device=device)
    inputs = _inputs(gen, (20,), V, dtype, device)
    if num_items == "tensor":
        num_items = torch.tensor(11, device=device)
    kwargs = dict(
        cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, backend=backend, chunk_size=CHUNK
    )
    loss, grads = _loss_and_grads(
        _fused(packing.labels, num_items_in_batch=num_items, **kwargs), inputs
    )
    summed, summed_grads = _loss_and_grads(
        _fused(packing.labels, reduction="sum", **kwargs), inputs
    )
    d = float(num_items)
    assert relative_error(loss, summed / d) < tol
    for grad, ref in zip(grads, summed_grads):
        assert relative_error(grad, ref / d) < tol


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_return_z_loss(backend_case, reduction):
    backend, device, dtype, tol = backend_case
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, rows=2, row_len=10, device=device)
    hidden, weight, bias = _inputs(gen, (2, 10), V, dtype, device)
    kwargs = dict(
        position_ids=packing.position_ids,
        is_packed=True,
        shift=True,
        reduction=reduction,
        return_z_loss=True,
    )
    loss, z = fused_linear_cross_entropy(
        hidden,
        weight.requires_grad_(),
        packing.labels,
        bias=bias,
        z_loss_scale=1e-2,
        backend=backend,
        chunk_size=CHUNK,
        **kwargs,
    )
    logits = F.linear(hidden, weight, bias).detach().double()
    ref_loss, ref_z = packed_ce.cross_entropy(
        logits, packing.labels, z_loss_scale=1e-2, backend="torch", **kwargs
    )
    plain, zero_z = fused_linear_cross_entropy(
        hidden, weight, packing.labels, bias=bias, backend=backend, chunk_size=CHUNK, **kwargs
    )
    assert loss.shape == z.shape == packing.labels.shape if reduction == "none" else loss.dim() == 0
    assert loss.requires_grad and not z.requires_grad
    assert relative_error(z, ref_z) < tol
    assert float(z.sum()) > 0 or not ref_z.any()  # a random packing may have no target
    assert relative_error(loss.detach(), ref_loss) < tol
    assert not zero_z.any()
    # the z-term is part of the loss, reduced with the same weights
    torch.testing.assert_close(loss.detach(), (plain + z).detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["empty", "all_ignored", "zero_num_items"])
def test_nothing_to_learn_gives_zero_not_nan(backend_case, reduction, case):
    backend, device, dtype, tol = backend_case
    if case == "zero_num_items" and reduction != "mean":
        pytest.skip("num_items_in_batch only divides the mean")
    n = 0 if case == "empty" else 12
    labels = torch.full((n,), -100, device=device)
    extra = {}
    if case == "zero_num_items":
        labels, extra = torch.randint(0, V, (n,), device=device), {"num_items_in_batch": 0}
    cu = torch.tensor([0, n // 2, n], dtype=torch.int32, device=device)
    inputs = _inputs(torch.Generator().manual_seed(0), (n,), V, dtype, device)
    loss, grads = _loss_and_grads(
        _fused(
            labels,
            cu_seqlens=cu,
            is_packed=True,
            shift=True,
            reduction=reduction,
            backend=backend,
            chunk_size=5,
            **extra,
        ),
        inputs,
    )
    assert torch.isfinite(loss).all() and not loss.any()
    for grad, tensor in zip(grads, inputs):
        assert grad.shape == tensor.shape
        assert torch.isfinite(grad).all() and not grad.any()


@pytest.mark.parametrize("backend_case", BACKENDS)
def test_zero_hidden_gives_log_vocab(backend_case):
    backend, device, dtype, tol = backend_case
    labels = torch.tensor([0, V - 1, 5, -100, 7], device=device)  # first and last class too
    weight = torch.randn(V, H, dtype=dtype, device=device)
    loss = fused_linear_cross_entropy(
        torch.zeros(5, H, dtype=dtype, device=device), weight, labels, backend=backend, chunk_size=2
    )
    torch.testing.assert_close(loss, torch.tensor(math.log(V), dtype=loss.dtype, device=device))


def test_autocast_casts_like_linear():
    """Under torch.autocast, float32 inputs are cast to the autocast dtype, as F.linear's are."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20)
    inputs = _inputs(gen, (20,), V, torch.float32, "cpu")
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, backend="torch", chunk_size=CHUNK)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = _loss_and_grads(_fused(packing.labels, **kwargs), inputs)
    cast = [t.bfloat16() for t in inputs]
    expected, expected_grads = _loss_and_grads(_fused(packing.labels, **kwargs), cast)
    torch.testing.assert_close(loss, expected)
    for grad, ref in zip(grads, expected_grads):
        assert grad.dtype == torch.float32  # back through the cast to the float32 leaf
        torch.testing.assert_close(grad, ref.float())


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compiled_caller(device):
    """Inside torch.compile the loss runs eagerly (one graph break) with the same result."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20, device=device)
    inputs = _inputs(gen, (20,), V, torch.float32, device)

    def step(h, w, b):
        return fused_linear_cross_entropy(
            torch.tanh(h),
            w,
            packing.labels,
            bias=b,
            cu_seqlens=packing.cu_seqlens,
            is_packed=True,
            shift=True,
            backend="triton",
            chunk_size=CHUNK,
        )

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="inductor" if device == "cuda" else "aot_eager")
    _assert_close(_loss_and_grads(compiled, inputs), _loss_and_grads(step, inputs), 1e-6)


# --- module and input checks ----------------------------------------------------------------


def test_module_holds_options():
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=20)
    hidden, weight, bias = _inputs(gen, (20,), V, torch.float64, "cpu")
    options = dict(is_packed=True, shift=True, label_smoothing=0.1, chunk_size=CHUNK)
    module = FusedLinearPackedCrossEntropyLoss(**options)
    expected = fused_linear_cross_entropy(
        hidden,
        weight,
        packing.labels,
        bias=bias,
        cu_seqlens=packing.cu_seqlens,
        num_items_in_batch=3,
        **options,
    )
    # the contract's positional order: tensors, then cu_seqlens, position_ids, num_items_in_batch
    actual = module(hidden, weight, packing.labels, packing.cu_seqlens, None, 3, bias=bias)
    torch.testing.assert_close(actual, expected)
    assert "is_packed=True" in repr(module)
    for name in ("bias", "cu_seqlens", "position_ids"):
        with pytest.raises(TypeError, match=name):
            FusedLinearPackedCrossEntropyLoss(**{name: packing.cu_seqlens})


def test_public_names():
    assert packed_ce.fused_linear_cross_entropy is fused_linear_cross_entropy
    assert packed_ce.FusedLinearPackedCrossEntropyLoss is FusedLinearPackedCrossEntropyLoss


def _bad_cases(device):
    n, v = 6, 11
    h = torch.randn(n, H, device=device)
    w = torch.randn(v, H, device=device)
    y = torch.randint(0, v, (n,), device=device)
    cu = lambda *c: torch.tensor(c, dtype=torch.int32, device=device)  # noqa: E731
    return [
        ("hidden_1d", dict(hidden=h[0]), ValueError, "hidden"),
        ("hidden_int", dict(hidden=h.long()), TypeError, "hidden"),
        ("hidden_not_tensor", dict(hidden=h.tolist()), TypeError, "hidden"),
        ("weight_wrong_h", dict(weight=w[:, :-1]), ValueError, "weight"),
        ("weight_1d", dict(weight=w[0]), ValueError, "weight"),
        ("weight_dtype", dict(weight=w.double()), TypeError, "weight"),
        ("bias_wrong_v", dict(bias=torch.zeros(v + 1, device=device)), ValueError, "bias"),
        (
            "bias_dtype",
            dict(bias=torch.zeros(v, device=device, dtype=torch.float64)),
            TypeError,
            "bias",
        ),
        ("chunk_zero", dict(chunk_size=0), ValueError, "chunk_size"),
        ("chunk_float", dict(chunk_size=2.0), ValueError, "chunk_size"),
        (
            "accumulation_int",
            dict(grad_accumulation_dtype=torch.int64),
            TypeError,
            "grad_accumulation_dtype",
        ),
        (
            "accumulation_str",
            dict(grad_accumulation_dtype="float32"),
            TypeError,
            "grad_accumulation_dtype",
        ),
        ("labels_shape", dict(labels=y[:-1]), ValueError, "labels"),
        (
            "label_too_large",
            dict(labels=y.clone().index_fill_(0, torch.tensor([2], device=device), v)),
            ValueError,
            "labels",
        ),
        ("cu_not_to_n", dict(cu_seqlens=cu(0, 3, 5), is_packed=True), ValueError, "cu_seqlens"),
        ("packed_without_boundaries", dict(is_packed=True), ValueError, "is_packed"),
        ("unknown_reduction", dict(reduction="average"), ValueError, "reduction"),
        ("unknown_backend", dict(backend="cuda"), ValueError, "backend"),
    ]


@pytest.mark.parametrize("backend_case", BACKENDS)
def test_bad_input_raises_naming_the_argument(backend_case):
    backend, device, dtype, tol = backend_case
    h = torch.randn(6, H, device=device)
    w = torch.randn(11, H, device=device)
    y = torch.randint(0, 11, (6,), device=device)
    for name, change, error, word in _bad_cases(device):
        args = dict(hidden=h, weight=w, labels=y, backend=backend)
        args.update(change)
        with pytest.raises(error, match=word):  # bad values on CUDA: at check_pending()
            fused_linear_cross_entropy(
                args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args
            )
            packed_ce.check_pending()
    if backend == "triton":  # float64 only on the torch backend
        with pytest.raises(TypeError, match="hidden"):
            fused_linear_cross_entropy(h.double(), w.double(), y, backend="triton")


# --- GPU only: half precision at LLM shapes, N * V past 2**31, no host sync -----------------

cuda_only = pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a CUDA GPU")

# (dtype, max relative norm error of the loss and of each gradient) against float32 math on
# the same half-precision inputs: the fused path rounds the logits to the input dtype (as the
# unfused model does; bf16: 2**-9 relative, fp16: 2**-12) and dL/dZ once more before the GEMMs.
GPU_TOLERANCES = [(torch.bfloat16, 3e-3, 2e-2), (torch.float16, 5e-4, 5e-3)]
# (vocab, chunk_size): Llama-2 in chunks of 1000 rows (a partial last chunk), Llama-3 and Qwen2
# with the default chunk (1024 and 768 rows in bf16); N = 4096 tokens, H = 1024
GPU_VOCABS = [(32000, 1000), (128256, None), (151936, None)]


def _gpu_cases():
    """bf16 across vocabularies, options, reductions and accumulators; fp16 at the Llama-3 vocab."""
    for (dtype, loss_tol, grad_tol), (
        vocab,
        chunk_size,
    ), reduction, options, accumulation in itertools.product(
        GPU_TOLERANCES, GPU_VOCABS, ["mean", "none"], ["plain", "all"], [None, torch.float32]
    ):
        if dtype == torch.float16 and (vocab != 128256 or accumulation is not None):
            continue
        accumulator = "fp32" if accumulation else "weight"
        case_id = f"{str(dtype)[6:]}-V{vocab}-{reduction}-{options}-acc-{accumulator}"
        yield pytest.param(
            dtype,
            loss_tol,
            grad_tol,
            vocab,
            chunk_size,
            reduction,
            OPTION_SETS[options],
            accumulation,
            id=case_id,
        )


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize(
    "dtype,loss_tol,grad_tol,vocab,chunk_size,reduction,options,accumulation", list(_gpu_cases())
)
def test_gpu_half_precision(
    dtype, loss_tol, grad_tol, vocab, chunk_size, reduction, options, accumulation
):
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, vocab, rows=2, row_len=2048, max_len=600, device="cuda")
    inputs = _inputs(gen, (2, 2048), vocab, dtype, "cuda", hidden_size=1024)
    kwargs = dict(
        cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, reduction=reduction, **options
    )
    # fp16 trains with loss scaling: without it the mean's gradients fall into fp16's
    # subnormals and lose their relative precision (bf16 has fp32's exponent range)
    scale = 2.0**12 if dtype == torch.float16 else 1.0
    upstream = (
        torch.rand(packing.labels.shape, generator=gen) * scale
        if reduction == "none"
        else torch.tensor(scale)
    ).to("cuda")
    ours = _loss_and_grads(
        _fused(
            packing.labels,
            backend="triton",
            chunk_size=chunk_size,
            grad_accumulation_dtype=accumulation,
            **kwargs,
        ),
        inputs,
        upstream,
    )
    loss, grads = ours
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all()
    assert all(grad.dtype == dtype and torch.isfinite(grad).all() for grad in grads)
    # the unfused path in the same dtype: the same roundings, up to the GEMMs' split of the rows
    unfused = _loss_and_grads(
        _explicit(packing.labels, backend="triton", **kwargs), inputs, upstream
    )
    assert relative_error(loss, unfused[0]) < 1e-4
    # float32 math on the same inputs
    reference = _loss_and_grads(
        _explicit(packing.labels, backend="torch", **kwargs), [t.float() for t in inputs], upstream
    )
    assert relative_error(loss, reference[0]) < loss_tol
    bias_tol = _bias_tolerance(dtype, grad_tol, chunk_size, packing, inputs, upstream, kwargs)
    tolerances = (grad_tol, grad_tol, bias_tol)
    for name, grad, unfused_grad, ref, tol in zip(
        ("hidden", "weight", "bias"), grads, unfused[1], reference[1], tolerances
    ):
        assert relative_error(grad, ref) < tol, name
        assert relative_error(grad, unfused_grad) < tol, name


def _bias_tolerance(dtype, grad_tol, chunk_size, packing, inputs, upstream, kwargs) -> float:
    """The relative error a half-precision bias gradient may have, from its roundings.

    ``dL/db = sum_t G_t`` over the N rows of ``G = dL/dZ``, and these terms cancel (each row's
    softmax mass against its target's -1), so ``||sum_t G_t||`` can be far below the size of
    the terms; a relative tolerance that ignores this passes or fails with the seed. Two
    roundings, ``u`` = 2**-11 (fp16) or 2**-8 (bf16) relative:

    - each term: ``G`` stored in the input dtype, and the softmax of logits rounded to it
      (``|dz| <= u |z|``, so ``p`` is off by about ``u |z|`` relative; the logits have std ~3
      here): about ``4 u`` per term, independent across rows, adding up in quadrature to
      ``4 u ||sqrt(sum_t G_t^2)||``;
    - the running sum over chunks, kept in the weight's dtype: one rounding of ``u`` times the
      running sum after each chunk, ``u sum_c ||R_c||``.

    Twice their sum (a 2x margin, which also covers comparing two such results with each other),
    relative to ``||sum_t G_t||``, never below ``grad_tol``. The figures come from the float32
    reference's ``G``, never from the run under test. (A float32 simulation of both roundings at
    N=4096, V=32000 with this test's packing gave 3.4e-4, about 0.4 u ||sqrt(sum G^2)||.)
    """
    unit = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}[dtype]
    logits = F.linear(*[t.float() for t in inputs]).requires_grad_()
    loss = packed_ce.cross_entropy(logits, packing.labels, backend="torch", **kwargs)
    (grad,) = torch.autograd.grad(loss, logits, upstream.to(loss.dtype))
    grad = grad.reshape(-1, grad.shape[-1]).double()
    exact = grad.sum(0).norm()
    per_term = 4 * unit * grad.square().sum(0).sqrt().norm()
    size = chunk_size or chunks.default_chunk_size(grad.shape[-1], dtype)
    running = torch.cumsum(torch.stack([c.sum(0) for c in grad.split(size)]), 0)
    per_chunk = unit * running.norm(dim=1).sum()
    return max(grad_tol, float(2 * (per_term + per_chunk) / exact))


@pytest.mark.cuda
@cuda_only
def test_gpu_rows_times_vocab_past_2_pow_31():
    """N * V > 2**31 logits, never materialised; a float32 reference computed chunk by chunk."""
    n, vocab, hidden_size = 16_500, 131_072, 256
    assert n * vocab > 2**31
    gen = torch.Generator().manual_seed(seed_for_test())
    hidden, weight, _ = _inputs(
        gen, (n,), vocab, torch.bfloat16, "cuda", bias=False, hidden_size=hidden_size
    )
    labels = torch.randint(0, vocab, (n,), generator=gen).cuda()
    labels[::7] = -100
    labels[-1] = vocab - 1  # the last row and the last class

    loss, (grad_hidden, grad_weight) = _loss_and_grads(
        lambda h, w: fused_linear_cross_entropy(h, w, labels, reduction="sum", backend="triton"),
        (hidden, weight),
    )

    weight32 = weight.float().requires_grad_()
    ref_loss, ref_grad_hidden = 0.0, torch.empty(n, hidden_size, device="cuda")
    for start in range(0, n, 2048):
        rows = slice(start, start + 2048)
        hidden32 = hidden[rows].float().requires_grad_()
        chunk = F.cross_entropy(hidden32 @ weight32.t(), labels[rows], reduction="sum")
        chunk.backward()  # accumulates weight32.grad in float32
        ref_loss += chunk.detach()
        ref_grad_hidden[rows] = hidden32.grad

    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-2)
    assert relative_error(grad_hidden, ref_grad_hidden) < 2e-2
    assert relative_error(grad_hidden[-64:], ref_grad_hidden[-64:]) < 2e-2  # the last rows
    assert relative_error(grad_weight, weight32.grad) < 2e-2


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize(
    "accumulation", [None, torch.float32], ids=["acc-weight-dtype", "acc-fp32"]
)
def test_gpu_no_host_sync(reduction, accumulation):
    """Forward and backward with validate=False make no host synchronisation at all."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, 32000, rows=2, row_len=1024, max_len=300, device="cuda")
    hidden, weight, bias = (
        t.requires_grad_()
        for t in _inputs(gen, (2, 1024), 32000, torch.bfloat16, "cuda", hidden_size=256)
    )
    upstream = (
        torch.rand(packing.labels.shape, device="cuda")
        if reduction == "none"
        else torch.tensor(2.0, device="cuda")
    )
    kwargs = dict(
        bias=bias,
        cu_seqlens=packing.cu_seqlens,
        is_packed=True,
        shift=True,
        reduction=reduction,
        num_items_in_batch=torch.tensor(7, device="cuda"),
        validate=False,
        chunk_size=500,
        grad_accumulation_dtype=accumulation,
        backend="triton",
    )
    fused_linear_cross_entropy(hidden, weight, packing.labels, **kwargs).backward(
        upstream
    )  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = fused_linear_cross_entropy(hidden, weight, packing.labels, **kwargs)
        loss.backward(upstream)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@cuda_only
def test_gpu_default_drops_rows_where_it_pays(monkeypatch):
    """By default rows without a target skip the GEMMs from N*H*V = DROP_MIN_WORK on (one host
    sync), with the result of keeping them; below it, or under torch.cuda.set_sync_debug_mode,
    every row goes through and the call makes no host sync."""
    vocab, hidden_size = 131072, 2048
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, vocab, rows=2, row_len=2048, max_len=300, device="cuda")
    assert 4096 * hidden_size * vocab == chunks.DROP_MIN_WORK
    inputs = _inputs(gen, (2, 2048), vocab, torch.bfloat16, "cuda", hidden_size=hidden_size)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, validate=False)
    with_targets = int(
        (prepare_targets(packing.labels, cu_seqlens=packing.cu_seqlens, shift=True).coef != 0).sum()
    )
    assert with_targets < 4096
    gemm_rows = _count_gemm_rows(monkeypatch)

    def rows_through_the_gemms(fn, inputs):
        gemm_rows.clear()
        result = _loss_and_grads(fn, inputs)
        return sum(gemm_rows), result

    rows, dropped = rows_through_the_gemms(_fused(packing.labels, **kwargs), inputs)
    assert rows == with_targets
    rows, kept = rows_through_the_gemms(
        _fused(packing.labels, drop_ignored_rows=False, **kwargs), inputs
    )
    assert rows == 4096
    _assert_close(dropped, kept, 1e-2)  # bf16 GEMMs of other shapes: other roundings
    smaller = (inputs[0][..., : hidden_size // 2], inputs[1][:, : hidden_size // 2], inputs[2])
    assert rows_through_the_gemms(_fused(packing.labels, **kwargs), smaller)[0] == 4096
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rows, quiet = rows_through_the_gemms(_fused(packing.labels, **kwargs), inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert rows == 4096
    _assert_close(quiet, kept, 1e-5)
