"""packed_ce.cross_entropy: the Triton kernel and the reference against the per-sequence loop.

On CPU (CI) the kernel runs through the Triton interpreter (``TRITON_INTERPRET=1``); on a GPU
(``make test-gpu``, tests marked ``cuda``) it runs compiled, in fp32 and bf16. Sizes are small
because the interpreter runs each program in numpy, but every vocabulary below spans several
kernel blocks (1024 columns under the interpreter) with a masked tail.
"""

from __future__ import annotations

import itertools

import pytest
import torch

import packed_ce
import packed_ce.kernels.cross_entropy as ce_kernels
from packed_ce.options import ChunkOptions, LossOptions
from packed_ce.targets import count_normaliser, prepare_targets

from loss_utils import (
    BACKEND_DEVICES as BACKENDS,
    KERNEL_DEVICES,
    assert_close,
    OPTION_SETS,
    seed_for_test,
    random_packing,
    relative_error,
)

V_UNALIGNED = 1531  # two full interpreter blocks and a masked tail


def _boundaries(packing, kind: str) -> dict:
    return {"cu_seqlens": packing.cu_seqlens} if kind == "cu" else {"position_ids": packing.position_ids}


def _logits(gen, shape, vocab, dtype, device, scale=3.0):
    x = torch.randn(*shape, vocab, generator=gen, dtype=torch.float64) * scale
    return x.to(device=device, dtype=dtype).requires_grad_()


def _loss_and_grad(fn, logits, upstream=None):
    """Loss and d(loss * upstream)/d(logits), on a clone so that inputs stay untouched."""
    x = logits.detach().clone().requires_grad_()
    loss = fn(x)
    if upstream is None:
        upstream = torch.ones_like(loss)
    (grad,) = torch.autograd.grad(loss, x, upstream.to(loss.dtype))
    return loss.detach(), grad


# --- the reference against the per-sequence loop (float64, every option) --------------------


@pytest.mark.parametrize("boundary", ["cu", "pos"])
@pytest.mark.parametrize("batched", [False, True], ids=["(N,V)", "(B,T,V)"])
@pytest.mark.parametrize("is_packed", [True, False])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
def test_reference_matches_per_sequence_loop(boundary, batched, is_packed, shift, reduction, options, per_sequence_loss):
    gen = torch.Generator().manual_seed(seed_for_test())
    vocab = 37
    packing = random_packing(gen, vocab, rows=3 if batched else None, row_len=24, n_tokens=60)
    logits = _logits(gen, packing.labels.shape, vocab, torch.float64, "cpu")
    kwargs = dict(is_packed=is_packed, shift=shift, **options)

    def ours(x):
        loss = packed_ce.cross_entropy(
            x, packing.labels, **_boundaries(packing, boundary), reduction=reduction,
            backend="torch", **kwargs,
        )
        # "none" must sum to "sum"; the loop gives the sum
        return loss.sum() if reduction == "none" else loss

    def loop(x):
        return per_sequence_loss(
            x, packing.labels, packing.slices, reduction="sum" if reduction == "none" else reduction,
            **kwargs,
        )

    loss, grad = _loss_and_grad(ours, logits)
    expected_loss, expected_grad = _loss_and_grad(loop, logits)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


# --- the kernel against the reference and the loop ------------------------------------------


# The four layouts, (N, V) or (B, T, V) logits with cu_seqlens or position_ids, paired with the
# grid in turn (each is an explicit part of the test id) instead of multiplying it by four.
LAYOUTS = [("(N,V)", "cu"), ("(B,T,V)", "pos"), ("(N,V)", "pos"), ("(B,T,V)", "cu")]
KERNEL_GRID = [
    pytest.param(*case, layout, options, id=f"{'-'.join(map(str, case))}-{name}-{layout[0]}-{layout[1]}")
    for i, (case, (name, options)) in enumerate(
        itertools.product(
            itertools.product(["mean", "sum", "none"], [True, False], [True, False]), OPTION_SETS.items()
        )
    )
    for layout in [LAYOUTS[i % len(LAYOUTS)]]
]


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("reduction,is_packed,shift,layout,options", KERNEL_GRID)
def test_kernel_matches_reference_and_loop(device, reduction, is_packed, shift, layout, options, per_sequence_loss):
    gen = torch.Generator().manual_seed(seed_for_test())
    batched, boundary = layout[0] == "(B,T,V)", layout[1]
    packing = random_packing(gen, V_UNALIGNED, rows=2 if batched else None, row_len=20, n_tokens=40, device=device)
    logits = _logits(gen, packing.labels.shape, V_UNALIGNED, torch.float32, device)
    kwargs = dict(
        **_boundaries(packing, boundary), is_packed=is_packed, shift=shift, reduction=reduction, **options
    )
    # an arbitrary upstream gradient: per token for "none", a loss scale for the reductions
    upstream = (
        torch.randn(packing.labels.shape, generator=gen)
        if reduction == "none"
        else torch.tensor(2.5)
    ).to(device)

    def run(backend):
        return lambda x: packed_ce.cross_entropy(x, packing.labels, backend=backend, **kwargs)

    loss, grad = _loss_and_grad(run("triton"), logits, upstream)
    ref_loss, ref_grad = _loss_and_grad(run("torch"), logits.double(), upstream)
    assert loss.dtype == torch.float32 and grad.dtype == logits.dtype
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)

    loop_kwargs = {k: v for k, v in kwargs.items() if k not in ("cu_seqlens", "position_ids", "reduction")}
    loop_reduction = "sum" if reduction == "none" else reduction
    loop_loss, loop_grad = _loss_and_grad(
        lambda x: per_sequence_loss(x, packing.labels, packing.slices, reduction=loop_reduction, **loop_kwargs),
        logits.double(),
        upstream.sum() if reduction == "none" else upstream,
    )
    assert_close(loss.sum(), loop_loss)
    if reduction != "none":  # with a per-token upstream the loop's single scalar is not comparable
        assert_close(grad, loop_grad)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("is_packed", [True, False])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_preparation_kernel_matches_pytorch(device, is_packed, shift, reduction):
    """The one-launch targets/weights of the Triton path against the PyTorch path."""
    gen = torch.Generator().manual_seed(seed_for_test())
    # long sequences: several preparation blocks per sequence under the interpreter
    packing = random_packing(gen, 50, n_tokens=300, max_len=150, device=device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=is_packed, shift=shift, reduction=reduction)
    ours = prepare_targets(packing.labels, use_kernel=True, **kwargs)
    expected = prepare_targets(packing.labels, **kwargs)
    torch.testing.assert_close(ours.targets, expected.targets, rtol=0, atol=0)
    torch.testing.assert_close(ours.coef, expected.coef, rtol=1e-6, atol=0)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("boundaries", ["cu_seqlens", "none"])
@pytest.mark.parametrize(
    "count",
    [None, 7, 2**25 + 1, 0, -1.0, 0.3, float("nan"), float("inf"), 1e-40, 2**40 + 12345],
    ids=lambda c: "default" if c is None else repr(c),
)
def test_normaliser_kernel_matches_pytorch(device, boundaries, count):
    """The one-launch division of the weights by D against the PyTorch path: D > 0, D == 0
    (coefficients 0), and the unchecked values a tensor D may hold (negative, NaN, infinite: NaN
    coefficients), in int64, float64 and float32 (read as float32 on both). To the bit where both
    paths start from the same weights; with cu_seqlens the weights come from the targets kernel,
    whose 1 / n_s on a GPU is not rounded to nearest (within 1e-6, as in the test above)."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, 50, n_tokens=150, max_len=60, device=device)
    kwargs = dict(is_packed=boundaries == "cu_seqlens", shift=True, validate=False)
    if boundaries == "cu_seqlens":
        kwargs["cu_seqlens"] = packing.cu_seqlens
    counts = [None] if count is None else [
        torch.tensor(count, device=device),  # int64 or float32
        torch.tensor(count, dtype=torch.float64, device=device),
    ]
    if isinstance(count, int) and count >= 0:
        counts.append(count)  # a Python int, as the arguments' check lets through
    for d in counts:
        ours = prepare_targets(packing.labels, use_kernel=True, num_items_in_batch=d, **kwargs)
        expected = prepare_targets(packing.labels, use_kernel=False, num_items_in_batch=d, **kwargs)
        assert torch.equal(ours.coef.isnan(), expected.coef.isnan())
        if boundaries == "none":
            assert torch.equal(ours.coef.nan_to_num(), expected.coef.nan_to_num()), d
        else:
            torch.testing.assert_close(ours.coef, expected.coef, rtol=1e-6, atol=0, equal_nan=True)
    assert (ours.coef != 0).any() or count == 0 or count == float("inf")


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("num_items", [7, "tensor"])
def test_num_items_in_batch(device, num_items):
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=40, device=device)
    logits = _logits(gen, packing.labels.shape, V_UNALIGNED, torch.float32, device)
    if num_items == "tensor":
        num_items = torch.tensor(11, device=device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, num_items_in_batch=num_items)
    loss, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, backend="triton", **kwargs), logits)
    summed, summed_grad = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(
            x, packing.labels, backend="triton", cu_seqlens=packing.cu_seqlens, is_packed=True,
            shift=True, reduction="sum",
        ),
        logits,
    )
    d = float(num_items)
    torch.testing.assert_close(loss, summed / d, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, summed_grad / d, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("layout", ["strided_rows", "permuted_batch", "strided_columns"])
def test_non_contiguous_inputs(device, layout):
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, rows=2, row_len=16, device=device)
    base = torch.randn(2, 16, 2 * V_UNALIGNED, generator=gen).to(device)
    if layout == "strided_rows":  # row stride 2V, unit column stride: used as is
        logits = base[..., :V_UNALIGNED]
    elif layout == "permuted_batch":  # (T, B, V) memory seen as (B, T, V)
        logits = base[..., :V_UNALIGNED].transpose(0, 1).contiguous().transpose(0, 1)
    else:  # column stride 2: copied before the kernel
        logits = base[..., ::2][..., :V_UNALIGNED]
    labels = packing.labels.t().contiguous().t()  # non-contiguous labels too
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True)
    loss, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels, backend="triton", **kwargs), logits)
    ref_loss, ref_grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels, backend="torch", **kwargs), logits.double())
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


# --- inplace_backward -----------------------------------------------------------------------


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("inplace", [False, True])
def test_inplace_backward(device, reduction, inplace):
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=30, device=device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, reduction=reduction)
    logits = torch.randn(30, V_UNALIGNED, generator=gen).to(device)
    original = logits.clone()  # read only this copy after the kernel has run
    ref_loss, ref_grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, backend="torch", **kwargs), original)

    leaf = original.clone().requires_grad_()
    x = leaf * 1.0  # a non-leaf, as the output of an lm_head is
    loss = packed_ce.cross_entropy(x, packing.labels, backend="triton", inplace_backward=inplace, **kwargs)
    loss.backward(torch.ones_like(loss))
    assert_close(leaf.grad, ref_grad)
    assert_close(loss.detach(), ref_loss)
    if inplace:
        # documented: the storage of logits now holds their gradient
        torch.testing.assert_close(x.detach(), leaf.grad)
    else:
        torch.testing.assert_close(x.detach(), original, rtol=0, atol=0)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_float16_gradient_sees_the_loss_scale(device):
    """fp16 gradients are formed with the upstream (loss-scaled) gradient, not rescaled after.

    A mean over many targets gives entries ~coef * p_j far below fp16's smallest subnormal
    (6e-8); computed for an upstream gradient of 1 and scaled later they would be lost.
    """
    gen = torch.Generator().manual_seed(seed_for_test())
    n = 64
    labels = torch.randint(0, V_UNALIGNED, (n,), generator=gen).to(device)
    logits = (torch.randn(n, V_UNALIGNED, generator=gen) * 4).to(device, torch.float16)
    scale = torch.tensor(2.0**16, device=device)
    kwargs = dict(reduction="mean", num_items_in_batch=10_000)
    _, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels, backend="triton", **kwargs), logits, scale)
    _, ref_grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels, backend="torch", **kwargs), logits.float(), scale)
    assert grad.dtype == torch.float16
    assert_close(grad, ref_grad)
    # entries the scaled gradient makes representable must not have been flushed
    representable = ref_grad.abs() > 2**-24
    assert (grad[representable] != 0).float().mean() > 0.99


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_second_backward_is_refused(device):
    logits = torch.randn(4, 50, device=device, requires_grad=True)
    loss = packed_ce.cross_entropy(logits * 1.0, torch.tensor([1, 2, 3, 4], device=device), backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


# --- properties -----------------------------------------------------------------------------


# (backend, device): the reference on CPU, and the kernel wherever it can run


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_uniform_logits_give_log_vocab(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=40, device=device)
    logits = torch.full((40, V_UNALIGNED), 0.25, device=device)
    if not (packing.labels != -100).any():
        packing.labels[0] = 0
    loss = packed_ce.cross_entropy(logits, packing.labels, cu_seqlens=packing.cu_seqlens, is_packed=True, backend=backend)
    torch.testing.assert_close(loss, torch.tensor(float(torch.log(torch.tensor(float(V_UNALIGNED)))), device=device))


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_row_constant_and_sequence_permutation_invariance(backend_device):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=48, device=device)
    logits = torch.randn(48, V_UNALIGNED, generator=gen).to(device)
    kwargs = dict(is_packed=True, shift=True, backend=backend)
    loss, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, cu_seqlens=packing.cu_seqlens, **kwargs), logits)

    # adding a constant to each row changes neither loss nor gradient
    shifted = logits + torch.randn(48, 1, generator=gen).to(device) * 10
    loss2, grad2 = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, cu_seqlens=packing.cu_seqlens, **kwargs), shifted)
    torch.testing.assert_close(loss2, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad2, grad, rtol=1e-4, atol=1e-6)

    # permuting whole sequences inside the pack leaves the loss unchanged; gradients move along
    order = torch.randperm(len(packing.lengths), generator=gen).tolist()
    slices = packing.slices
    index = torch.cat([torch.arange(*slices[s]) for s in order]).to(device)
    lengths = torch.tensor([0] + [packing.lengths[s] for s in order]).cumsum(0).to(torch.int32).to(device)
    loss3, grad3 = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(x, packing.labels[index], cu_seqlens=lengths, **kwargs), logits[index]
    )
    torch.testing.assert_close(loss3, loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad3, grad[index], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("boundary", ["cu", "pos"])
def test_appending_a_sequence_without_targets_changes_nothing(backend_device, boundary):
    backend, device = backend_device
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=30, device=device)
    logits = torch.randn(30, V_UNALIGNED, generator=gen).to(device)
    extra = 9
    labels2 = torch.cat([packing.labels, torch.full((extra,), -100, device=device)])
    logits2 = torch.cat([logits, torch.randn(extra, V_UNALIGNED, generator=gen).to(device)])
    cu2 = torch.cat([packing.cu_seqlens, packing.cu_seqlens[-1:] + extra])
    pos2 = torch.cat([packing.position_ids, torch.arange(extra, device=device)])
    b1 = {"cu_seqlens": packing.cu_seqlens} if boundary == "cu" else {"position_ids": packing.position_ids}
    b2 = {"cu_seqlens": cu2} if boundary == "cu" else {"position_ids": pos2}
    kwargs = dict(is_packed=True, shift=True, backend=backend)
    loss, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, **b1, **kwargs), logits)
    loss2, grad2 = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels2, **b2, **kwargs), logits2)
    torch.testing.assert_close(loss2, loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad2[:30], grad, rtol=1e-6, atol=1e-9)
    assert not grad2[30:].any()


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", ["empty", "all_ignored", "zero_num_items"])
def test_nothing_to_learn_gives_zero_not_nan(backend_device, reduction, case):
    backend, device = backend_device
    n = 0 if case == "empty" else 12
    logits = torch.randn(n, V_UNALIGNED, device=device)
    labels = torch.full((n,), -100, device=device) if case != "zero_num_items" else torch.randint(0, V_UNALIGNED, (n,), device=device)
    cu = torch.tensor([0, n // 2, n], dtype=torch.int32, device=device)
    extra = {"num_items_in_batch": 0} if case == "zero_num_items" else {}
    if case == "zero_num_items" and reduction != "mean":
        pytest.skip("num_items_in_batch only divides the mean")
    loss, grad = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(x, labels, cu_seqlens=cu, is_packed=True, shift=True, reduction=reduction, backend=backend, **extra),
        logits,
    )
    assert torch.isfinite(loss).all() and not loss.any()
    assert torch.isfinite(grad).all() and not grad.any()


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_logits_near_float32s_limit_without_z_loss(backend_device, per_sequence_loss):
    """Logits of ~3e19 square to inf in float32: with ``z_loss_scale=0`` the unused z-term must
    not turn the finite loss into ``0 * inf = NaN`` (the kernel never forms it)."""
    backend, device = backend_device
    gen = torch.Generator().manual_seed(seed_for_test())
    labels = torch.randint(0, 64, (12,), generator=gen)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    logits = (torch.randn(12, 64, generator=gen, dtype=torch.float64) * 3e19).float()
    loss, grad = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(
            x, labels.to(device), cu_seqlens=cu.to(device), is_packed=True, backend=backend
        ),
        logits.to(device),
    )
    expected, expected_grad = _loss_and_grad(
        lambda x: per_sequence_loss(x, labels, [(0, 5), (5, 12)], is_packed=True, shift=False),
        logits.double(),
    )
    assert expected.abs() > 1e18  # the case: a loss of the logits' scale, far from float32's limit
    assert_close(loss, expected, torch.float32)
    assert_close(grad, expected_grad, torch.float32)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_nan_logits_of_a_sequence_weighing_zero_stay_out(backend_device, per_sequence_loss):
    """A sequence with ``seq_weights`` 0 is never read (the kernel skips its rows): NaN logits
    there give the other sequences' loss and gradients, and zero gradients in its rows."""
    backend, device = backend_device
    gen = torch.Generator().manual_seed(seed_for_test())
    labels = torch.randint(0, 64, (15,), generator=gen)
    slices, weights = [(0, 5), (5, 9), (9, 15)], [1.5, 0.0, 2.0]
    cu = torch.tensor([0, 5, 9, 15], dtype=torch.int32)
    logits = torch.randn(15, 64, generator=gen)
    poisoned = logits.clone()
    poisoned[5:9] = float("nan")
    loss, grad = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(
            x, labels.to(device), cu_seqlens=cu.to(device), is_packed=True, shift=True,
            seq_weights=torch.tensor(weights, device=device), backend=backend,
        ),
        poisoned.to(device),
    )
    # the reference on finite logits: the weightless sequence's values do not matter
    expected, expected_grad = _loss_and_grad(
        lambda x: per_sequence_loss(x, labels, slices, is_packed=True, shift=True, seq_weights=weights),
        logits.double(),
    )
    assert_close(loss, expected, torch.float32)
    assert_close(grad, expected_grad, torch.float32)
    assert not grad[5:9].any()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_none_with_long_ignored_runs_keeps_gradients(device):
    """A long ignored run must not zero the gradients of the targets after it."""
    gen = torch.Generator().manual_seed(seed_for_test())
    n = 64
    labels = torch.randint(0, V_UNALIGNED, (n,), generator=gen)
    labels[4:52] = -100
    labels, logits = labels.to(device), torch.randn(n, V_UNALIGNED, generator=gen).to(device)
    upstream = torch.rand(n, generator=gen).to(device) + 0.5
    _, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels, reduction="none", backend="triton"), logits, upstream)
    _, ref_grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, labels, reduction="none", backend="torch"), logits, upstream)
    targets = labels != -100
    assert grad[targets].abs().sum(-1).min() > 0
    assert not grad[~targets].any()
    assert_close(grad, ref_grad)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_return_z_loss(device):
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=40, device=device)
    logits = torch.randn(40, V_UNALIGNED, generator=gen).to(device)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, return_z_loss=True)
    loss, z = packed_ce.cross_entropy(logits, packing.labels, z_loss_scale=1e-2, backend="triton", **kwargs)
    ref_loss, ref_z = packed_ce.cross_entropy(logits, packing.labels, z_loss_scale=1e-2, backend="torch", **kwargs)
    plain, zero_z = packed_ce.cross_entropy(logits, packing.labels, backend="triton", **kwargs)
    assert not z.requires_grad
    assert_close(z, ref_z)
    assert float(z) > 0
    assert float(zero_z) == 0.0
    # the z-term is part of the loss, reduced with the same weights
    torch.testing.assert_close(loss, plain + z, rtol=1e-5, atol=1e-6)
    assert_close(loss, ref_loss)


def test_module_holds_options():
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, 50, n_tokens=20)
    logits = torch.randn(20, 50, generator=gen)
    module = packed_ce.PackedCrossEntropyLoss(is_packed=True, shift=True, label_smoothing=0.1)
    expected = packed_ce.cross_entropy(
        logits, packing.labels, cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, label_smoothing=0.1, num_items_in_batch=3
    )
    # the contract's positional order: tensors, then cu_seqlens, position_ids, num_items_in_batch
    torch.testing.assert_close(module(logits, packing.labels, packing.cu_seqlens, None, 3), expected)
    assert "is_packed=True" in repr(module)
    with pytest.raises(TypeError, match="cu_seqlens"):
        packed_ce.PackedCrossEntropyLoss(cu_seqlens=packing.cu_seqlens)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_compile_fullgraph(device):
    """torch.compile traces a function that calls the kernel without graph breaks."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V_UNALIGNED, n_tokens=32, device=device)
    logits = torch.randn(32, V_UNALIGNED, generator=gen).to(device)

    def step(x, labels, cu_seqlens):
        return packed_ce.cross_entropy(
            x * 2.0, labels, cu_seqlens=cu_seqlens, is_packed=True, shift=True, backend="triton",
            label_smoothing=0.1,
        )

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    loss, grad = _loss_and_grad(lambda x: compiled(x, packing.labels, packing.cu_seqlens), logits)
    ref_loss, ref_grad = _loss_and_grad(lambda x: step(x, packing.labels, packing.cu_seqlens), logits)
    assert_close(loss, ref_loss)
    assert_close(grad, ref_grad)


# --- options and the normaliser ---------------------------------------------------------------


@pytest.mark.parametrize(
    "field,value,error",
    [
        ("label_smoothing", float("nan"), ValueError),  # NaN passes every range comparison
        ("z_loss_scale", float("inf"), ValueError),
        ("z_loss_scale", -1e-3, ValueError),
        ("softcap", float("nan"), ValueError),
        ("softcap", 0.0, ValueError),
        ("softcap", "3", TypeError),
        ("label_smoothing", True, TypeError),
        ("is_packed", "yes", TypeError),
        ("shift", 1, TypeError),
        ("ignore_index", -100.0, TypeError),
        ("reduction", "avg", ValueError),
        ("backend", "cuda", ValueError),
        ("validate", None, TypeError),
    ],
)
def test_options_are_checked_once_naming_the_field(field, value, error):
    with pytest.raises(error, match=field):
        LossOptions(**{field: value})
    # the same through every entry point that builds them
    with pytest.raises(error, match=field):
        packed_ce.cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), **{field: value})
    with pytest.raises(error, match=field):
        packed_ce.PackedCrossEntropyLoss(**{field: value})


def test_chunk_options_and_unknown_keywords():
    with pytest.raises(ValueError, match="chunk_size"):
        ChunkOptions(chunk_size=0)
    with pytest.raises(TypeError, match="grad_accumulation_dtype"):
        ChunkOptions(grad_accumulation_dtype=torch.int32)
    with pytest.raises(TypeError, match="drop_ignored_rows"):
        ChunkOptions(drop_ignored_rows="no")
    with pytest.raises(TypeError, match="label_smothing"):  # a typo is an error, not ignored
        packed_ce.cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), label_smothing=0.1)
    with pytest.raises(TypeError, match="chunk_size"):  # a fused-only option on the plain loss
        packed_ce.PackedCrossEntropyLoss(chunk_size=8)
    with pytest.raises(TypeError, match="num_items_in_batch"):
        packed_ce.PackedCrossEntropyLoss(num_items_in_batch=3)


def test_options_object_equals_keywords():
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, 50, n_tokens=40)
    logits = torch.randn(40, 50, generator=gen)
    keywords = dict(is_packed=True, shift=True, label_smoothing=0.1, z_loss_scale=1e-3, softcap=4.0)
    expected = packed_ce.cross_entropy(logits, packing.labels, cu_seqlens=packing.cu_seqlens, **keywords)
    options = LossOptions(**keywords)
    torch.testing.assert_close(
        packed_ce.cross_entropy(logits, packing.labels, cu_seqlens=packing.cu_seqlens, options=options), expected
    )
    # keywords override the object's fields
    loss_sum = packed_ce.cross_entropy(
        logits, packing.labels, cu_seqlens=packing.cu_seqlens, options=options, reduction="sum"
    )
    torch.testing.assert_close(
        loss_sum, packed_ce.cross_entropy(logits, packing.labels, cu_seqlens=packing.cu_seqlens, reduction="sum", **keywords)
    )
    module = packed_ce.PackedCrossEntropyLoss(**keywords)
    assert module.options == options
    assert repr(module) == (
        "PackedCrossEntropyLoss(is_packed=True, shift=True, label_smoothing=0.1, z_loss_scale=0.001, softcap=4.0)"
    )


@pytest.mark.parametrize("boundary", ["cu", "pos"])
@pytest.mark.parametrize("is_packed", [True, False])
@pytest.mark.parametrize("shift", [True, False])
def test_count_normaliser_is_what_mean_divides_by(boundary, is_packed, shift):
    """mean * D == sum, D counted independently: sequences with a target, or targets."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, 30, n_tokens=80)
    boundaries = _boundaries(packing, boundary)
    options = LossOptions(is_packed=is_packed, shift=shift)
    count = count_normaliser(packing.labels, options=options, **boundaries)
    expected = 0
    for start, end in packing.slices:
        targets = packing.labels[start + 1 : end] if shift else packing.labels[start:end]
        n_s = int((targets != -100).sum())
        expected += (n_s > 0) if is_packed else n_s
    assert count.dtype == torch.int64 and count.dim() == 0 and int(count) == expected
    logits = torch.randn(80, 30, generator=gen, dtype=torch.float64)
    mean = packed_ce.cross_entropy(logits, packing.labels, options=options, **boundaries)
    total = packed_ce.cross_entropy(logits, packing.labels, options=options, reduction="sum", **boundaries)
    torch.testing.assert_close(mean * max(expected, 1), total)


# --- edges: masked logits, narrow label dtypes, unchecked inputs, autograd's limits ---------

# (backend, device, dtype, rtol against float64 math): the reference in float64 (exact up to
# summation order), the kernel in float32 (its arithmetic: a few float32 ulps per term)
EXACT_BACKENDS = [
    pytest.param(("torch", "cpu", torch.float64, 1e-12), id="torch-fp64"),
    *(
        pytest.param(("triton", p.values[0], torch.float32, 2e-5), marks=p.marks, id=f"triton-{p.values[0]}")
        for p in KERNEL_DEVICES
    ),
]


@pytest.mark.parametrize("options", OPTION_SETS.values(), ids=OPTION_SETS.keys())
@pytest.mark.parametrize("backend_dtype", EXACT_BACKENDS)
def test_minus_inf_logits_are_masked_entries(backend_dtype, options, per_sequence_loss):
    """-inf logits (a masked vocabulary entry): F.cross_entropy's loss, gradient 0 there.

    With label smoothing the exact loss is +inf (the smoothing term averages every logit), and
    both backends give +inf with F.cross_entropy's finite gradient; softcap maps -inf to
    -softcap, so everything is finite.
    """
    backend, device, dtype, rtol = backend_dtype
    gen = torch.Generator().manual_seed(seed_for_test())
    vocab, masked = 50, [3, 49]
    packing = random_packing(gen, vocab, n_tokens=24, max_len=8, device=device)
    labels = packing.labels.clone()
    labels[(labels == 3) | (labels == 49)] = 0  # a target is never a masked entry
    logits = torch.randn(24, vocab, generator=gen, dtype=torch.float64) * 3
    logits[:, masked] = float("-inf")
    logits[5, 10:20] = float("-inf")  # and a row with more of them
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, **options)
    loss, grad = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(x, labels, backend=backend, **kwargs), logits.to(device, dtype)
    )
    ref_loss, ref_grad = _loss_and_grad(
        lambda x: per_sequence_loss(x, labels.cpu(), packing.slices, is_packed=True, shift=False, **options), logits
    )
    assert bool(torch.isfinite(ref_loss)) == (options.get("label_smoothing", 0) == 0 or "softcap" in options)
    torch.testing.assert_close(loss.cpu().double(), ref_loss, rtol=rtol, atol=0)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.cpu().double(), ref_grad, rtol=rtol, atol=rtol * ref_grad.abs().max())
    if not options.get("label_smoothing"):
        assert (grad[:, masked] == 0).all()


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize(
    "dtype,vocab,ignore_index",
    [
        (torch.uint8, 300, -100),  # 250 is a valid label; -100 cannot occur
        (torch.uint8, 200, 255),  # ignore_index 255 in the labels' own range
        (torch.int8, 300, -100),
        (torch.int16, 40000, -100),  # V past int16's range
    ],
    ids=["uint8-V300", "uint8-ignore255", "int8-V300", "int16-V40000"],
)
def test_narrow_label_dtypes_are_checked_as_integers(backend_device, dtype, vocab, ignore_index):
    """Labels are range-checked as integers, not in their own dtype (where V and ignore_index
    wrap: uint8 reads V=300 as 44 and -100 as 156)."""
    backend, device = backend_device
    top = min(torch.iinfo(dtype).max, vocab - 1)
    # the dtype's largest value, and ignore_index where the dtype can hold it
    third = ignore_index if torch.iinfo(dtype).min <= ignore_index <= torch.iinfo(dtype).max else 0
    labels = torch.tensor([top, 5, third, top], dtype=torch.int64)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0)).to(device)
    expected = packed_ce.cross_entropy(logits, labels.to(device), ignore_index=ignore_index, backend="torch")
    narrow = labels.to(device, dtype)
    actual = packed_ce.cross_entropy(logits, narrow, ignore_index=ignore_index, backend=backend)
    torch.testing.assert_close(actual, expected, rtol=2e-5, atol=0)
    if vocab <= torch.iinfo(dtype).max:
        bad = narrow.clone()
        bad[1] = vocab  # out of range, representable in the dtype
        with pytest.raises(ValueError, match="labels"):
            packed_ce.cross_entropy(logits, bad, ignore_index=ignore_index, backend=backend)
            packed_ce.check_pending()  # on CUDA the values are checked on the device
    if dtype != torch.uint8:
        bad = narrow.clone()
        bad[1] = -1
        with pytest.raises(ValueError, match="labels"):
            packed_ce.cross_entropy(logits, bad, ignore_index=ignore_index, backend=backend)
            packed_ce.check_pending()  # on CUDA the values are checked on the device


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize(
    "cu_seqlens",
    [[2, 4, 6], [0, 3, 5], [0, 4, 2, 6], [0, -3, 3, 9], [0, 99, -99, 6]],
    ids=["from-2", "to-5", "decreasing", "out-of-range", "far-out"],
)
def test_malformed_cu_seqlens_refused_or_memory_safe(backend_device, cu_seqlens):
    """A malformed cu_seqlens raises when validated; with validate=False the call only has to
    stay memory-safe (its value is unspecified): a loss and a gradient of the right shapes."""
    backend, device = backend_device
    logits = torch.randn(6, 13, generator=torch.Generator().manual_seed(0)).to(device)
    labels = torch.tensor([1, 2, -100, 4, 5, 6], device=device)
    kwargs = dict(is_packed=True, shift=True, backend=backend)
    cu = torch.tensor(cu_seqlens, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_ce.cross_entropy(logits, labels, cu_seqlens=cu, **kwargs)
        packed_ce.check_pending()  # on CUDA the values are checked on the device
    loss, grad = _loss_and_grad(
        lambda x: packed_ce.cross_entropy(x, labels, cu_seqlens=cu, validate=False, **kwargs), logits
    )
    assert loss.shape == () and grad.shape == logits.shape


@pytest.mark.parametrize("device", KERNEL_DEVICES)
def test_malformed_inputs_under_compile_are_not_checked(device):
    """Under torch.compile the value checks are skipped (no host sync is possible): a malformed
    cu_seqlens and a NaN count run through, memory-safe, their values unspecified."""
    logits = torch.randn(6, 13, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([1, 2, -100, 4, 5, 6], device=device)
    cu = torch.tensor([0, 4, 2, 6], dtype=torch.int32, device=device)
    for backend in ("torch", "triton"):

        def step(x, count):
            loss = packed_ce.cross_entropy(x, labels, cu_seqlens=cu, is_packed=True, shift=True, backend=backend)
            nan = packed_ce.cross_entropy(x, labels, num_items_in_batch=count, backend=backend)
            return loss, nan

        torch._dynamo.reset()
        compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
        loss, nan = compiled(logits.to(device), torch.tensor(float("nan"), device=device))
        assert loss.shape == () and nan.shape == ()
        packed_ce.check_pending()  # nothing was queued


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("value", [-3.0, float("nan"), float("inf")], ids=["negative", "nan", "inf"])
def test_bad_tensor_num_items(backend_device, value):
    """A negative or non-finite tensor num_items_in_batch: an error when validated; unvalidated,
    memory-safe (the value is unspecified)."""
    backend, device = backend_device
    logits = torch.randn(4, 9, device=device, requires_grad=True)
    labels = torch.tensor([1, 2, 3, 4], device=device)
    count = torch.tensor(value, device=device)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        packed_ce.cross_entropy(logits, labels, num_items_in_batch=count, backend=backend)
        packed_ce.check_pending()  # on CUDA the values are checked on the device
    loss = packed_ce.cross_entropy(logits, labels, num_items_in_batch=count, backend=backend, validate=False)
    loss.backward()
    assert loss.shape == () and logits.grad.shape == logits.shape


@pytest.mark.parametrize("value,error", [(-1, ValueError), (float("nan"), TypeError), (float("inf"), TypeError), (True, TypeError), (2.0, TypeError)])
def test_bad_python_num_items_refused_even_unvalidated(value, error):
    with pytest.raises(error, match="num_items_in_batch"):
        packed_ce.cross_entropy(torch.randn(2, 5), torch.tensor([1, 2]), num_items_in_batch=value, validate=False)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("layout", ["expanded", "transposed"])
def test_inplace_backward_refuses_storage_it_cannot_own(backend_device, layout):
    """inplace_backward=True writes the gradient where the logits live: an expanded (stride 0)
    view would get the rows' gradients on top of each other, a strided one would be copied."""
    backend, device = backend_device
    base = torch.randn(1, 7, device=device) if layout == "expanded" else torch.randn(7, 4, device=device)
    logits = base.expand(4, 7) if layout == "expanded" else base.t()
    labels = torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(ValueError, match="inplace_backward.*contiguous"):
        packed_ce.cross_entropy(logits, labels, backend=backend, inplace_backward=True)
    # without it the same input is fine, and its gradient exact
    x = base.clone().requires_grad_()
    view = x.expand(4, 7) if layout == "expanded" else x.t()
    packed_ce.cross_entropy(view, labels, backend=backend).backward()
    y = base.clone().double().requires_grad_()
    view = y.expand(4, 7) if layout == "expanded" else y.t()
    torch.nn.functional.cross_entropy(view, labels).backward()
    torch.testing.assert_close(x.grad.double(), y.grad, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("path", ["fused", "none", "fp16"])
def test_inplace_backward_invalidates_other_readers(device, path):
    """Another node that saved the logits for its backward raises PyTorch's in-place error
    instead of reading the gradient the kernel wrote over them."""
    dtype = torch.float16 if path == "fp16" else torch.float32
    leaf = torch.randn(4, 9, device=device, dtype=dtype, requires_grad=True)
    logits = leaf * 1.0
    other = logits.sin()  # sin saves its input for the backward
    reduction = "none" if path == "none" else "mean"
    loss = packed_ce.cross_entropy(logits, torch.tensor([0, 1, 2, 3], device=device), backend="triton", inplace_backward=True, reduction=reduction)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss.sum() + other.sum()).backward()


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_higher_order_gradients_refused_on_the_kernel(device, reduction):
    """create_graph=True: the kernel's gradient has no graph, so the call is refused."""
    logits = torch.randn(4, 9, device=device, requires_grad=True)
    loss = packed_ce.cross_entropy(logits, torch.tensor([0, 1, 2, 3], device=device), backend="triton", reduction=reduction)
    with pytest.raises(RuntimeError, match="create_graph"):
        torch.autograd.grad(loss.sum(), logits, create_graph=True)


def test_higher_order_gradients_on_the_reference():
    """The torch backend is plain autograd: the Hessian-vector product matches F.cross_entropy's."""
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    labels = torch.tensor([0, 1, 2, 3])
    hvps = []
    for fn in (lambda x: packed_ce.cross_entropy(x, labels, backend="torch"), lambda x: torch.nn.functional.cross_entropy(x, labels)):
        (grad,) = torch.autograd.grad(fn(logits), logits, create_graph=True)
        hvps.append(torch.autograd.grad(grad.square().sum(), logits)[0])
    torch.testing.assert_close(hvps[0], hvps[1])


@pytest.mark.parametrize("device", KERNEL_DEVICES)
@pytest.mark.parametrize("path", ["fused", "none", "fp16"])
def test_second_backward_refused_on_every_kernel_path(device, path):
    dtype = torch.float16 if path == "fp16" else torch.float32
    logits = torch.randn(4, 50, device=device, dtype=dtype, requires_grad=True)
    reduction = "none" if path == "none" else "mean"
    loss = packed_ce.cross_entropy(logits * 1.0, torch.tensor([1, 2, 3, 4], device=device), backend="triton", reduction=reduction).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward"):
        loss.backward()


# --- bad input ------------------------------------------------------------------------------


def _bad_cases(device):
    n, v = 6, 11
    x = torch.randn(n, v, device=device)
    y = torch.randint(0, v, (n,), device=device)
    cu = lambda *c: torch.tensor(c, dtype=torch.int32, device=device)  # noqa: E731
    return [
        ("label_too_large", dict(labels=y.clone().index_fill_(0, torch.tensor([2], device=device), v)), ValueError, "labels"),
        ("label_negative", dict(labels=y.clone().index_fill_(0, torch.tensor([1], device=device), -5)), ValueError, "labels"),
        ("cu_not_from_zero", dict(cu_seqlens=cu(1, 3, 6), is_packed=True), ValueError, "cu_seqlens"),
        ("cu_decreasing", dict(cu_seqlens=cu(0, 4, 2, 6), is_packed=True), ValueError, "cu_seqlens"),
        ("cu_not_to_n", dict(cu_seqlens=cu(0, 3, 5), is_packed=True), ValueError, "cu_seqlens"),
        ("cu_float", dict(cu_seqlens=torch.tensor([0.0, 6.0], device=device), is_packed=True), TypeError, "cu_seqlens"),
        ("cu_2d", dict(cu_seqlens=cu(0, 6)[None], is_packed=True), ValueError, "cu_seqlens"),
        ("shape_mismatch", dict(labels=y[:-1]), ValueError, "labels"),
        ("float_labels", dict(labels=y.float()), TypeError, "labels"),
        ("logits_1d", dict(logits=x[0]), ValueError, "logits"),
        ("unknown_reduction", dict(reduction="average"), ValueError, "reduction"),
        ("packed_without_boundaries", dict(is_packed=True), ValueError, "is_packed"),
        ("both_boundaries", dict(cu_seqlens=cu(0, 6), position_ids=torch.arange(n, device=device)), ValueError, "cu_seqlens"),
        ("position_ids_wrong_size", dict(position_ids=torch.arange(n + 1, device=device), is_packed=True), ValueError, "position_ids"),
        ("smoothing_out_of_range", dict(label_smoothing=1.5), ValueError, "label_smoothing"),
        ("negative_softcap", dict(softcap=-1.0), ValueError, "softcap"),
        ("num_items_float", dict(num_items_in_batch=2.5), TypeError, "num_items_in_batch"),
        ("num_items_negative", dict(num_items_in_batch=-1), ValueError, "num_items_in_batch"),
        ("unknown_backend", dict(backend="cuda"), ValueError, "backend"),
        ("int_logits", dict(logits=torch.ones(n, v, dtype=torch.int64, device=device)), TypeError, "logits"),
    ], x, y


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_bad_input_raises_naming_the_argument(backend_device):
    """Inside the call, except for bad values on CUDA: their check runs on the device and
    raises at the next call or check_pending() (tests/test_deferred_checks.py)."""
    backend, device = backend_device
    cases, x, y = _bad_cases(device)
    for name, change, error, word in cases:
        args = dict(logits=x, labels=y, backend=backend)
        args.update(change)
        with pytest.raises(error, match=word):
            packed_ce.cross_entropy(args.pop("logits"), args.pop("labels"), **args)
            packed_ce.check_pending()


# --- GPU only: bf16 and LLM-sized shapes ----------------------------------------------------

cuda_only = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# (dtype, rtol of the loss, max relative norm error of the gradient) against an fp32 reference
# on the same (upcast) logits: the kernel does fp32 math, so the loss only sees summation
# order; the gradient is rounded once to the logits' dtype (bf16: 8 bits, ~2**-9 relative;
# fp16: 11 bits, but the softmax tail of the gradient falls into fp16's subnormals even with
# loss scaling, where the relative precision is lower).
GPU_TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1e-5, 8e-3), (torch.float16, 1e-5, 5e-3)]


@pytest.mark.parametrize("dtype,loss_rtol,grad_tol", GPU_TOLERANCES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("vocab", [32000, 128256, 151936], ids=["llama2-vocab", "llama3-vocab", "qwen2-vocab"])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("options", [OPTION_SETS["plain"], OPTION_SETS["all"]], ids=["plain", "all"])
def test_gpu_dtypes_against_fp32_reference(dtype, loss_rtol, grad_tol, vocab, reduction, options):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, vocab, rows=2, row_len=1024, max_len=300, device="cuda")
    logits = (torch.randn(2, 1024, vocab, generator=torch.Generator().manual_seed(1)) * 3).to("cuda", dtype)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, reduction=reduction, **options)
    # fp16 trains with loss scaling: without it the mean's gradients (~1e-6) fall into fp16's
    # subnormals and lose their relative precision; bf16 has fp32's exponent range
    scale = 2.0**12 if dtype == torch.float16 else 1.0
    upstream = torch.rand(packing.labels.shape, device="cuda") if reduction == "none" else torch.tensor(scale, device="cuda")
    loss, grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, backend="triton", **kwargs), logits, upstream)
    ref_loss, ref_grad = _loss_and_grad(lambda x: packed_ce.cross_entropy(x, packing.labels, backend="torch", **kwargs), logits.float(), upstream)
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, ref_loss, rtol=loss_rtol, atol=1e-6)
    assert relative_error(grad, ref_grad) < grad_tol


for _mark in cuda_only:
    test_gpu_dtypes_against_fp32_reference = _mark(test_gpu_dtypes_against_fp32_reference)


@pytest.mark.parametrize(
    "vocab,config",
    [(8000, None), (16000, None), (32000, (32768, 32)), (32000, (4096, 8))],
    ids=["8000-as-launched", "16000-as-launched", "32000-row-on-chip", "32000-two-passes"],
)
@pytest.mark.parametrize("options", [OPTION_SETS["plain"], OPTION_SETS["all"]], ids=["plain", "all"])
@pytest.mark.parametrize("inplace", [False, True], ids=["grad-buffer", "in-place"])
def test_gpu_both_kernel_routes_against_fp32_reference(monkeypatch, vocab, config, options, inplace):
    """The row held in registers (one read) and the two-pass loop, whichever this GPU launches
    by default, forced both ways at V=32000: loss, gradient and token stats in bf16."""
    if config is not None:
        monkeypatch.setattr(ce_kernels, "_launch_config", lambda vocab_size, device: config)
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, vocab, rows=2, row_len=1024, max_len=300, device="cuda")
    logits = (torch.randn(2, 1024, vocab, generator=gen) * 3).to("cuda", torch.bfloat16)
    kwargs = dict(cu_seqlens=packing.cu_seqlens, is_packed=True, shift=True, return_token_stats=True, **options)

    def run(backend, x, **extra):
        x = x.detach().clone().requires_grad_()
        loss, stats = packed_ce.cross_entropy(x, packing.labels, backend=backend, **kwargs, **extra)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad, stats

    loss, grad, stats = run("triton", logits, inplace_backward=inplace)
    ref_loss, ref_grad, ref_stats = run("torch", logits.float())
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grad.dtype == torch.bfloat16 and relative_error(grad, ref_grad) < 8e-3
    torch.testing.assert_close(stats.entropy_sum, ref_stats.entropy_sum, rtol=1e-4, atol=1e-3)
    assert torch.equal(stats.correct, ref_stats.correct) and torch.equal(stats.targets, ref_stats.targets)


for _mark in cuda_only:
    test_gpu_both_kernel_routes_against_fp32_reference = _mark(test_gpu_both_kernel_routes_against_fp32_reference)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("inplace", [True, False])
def test_gpu_offsets_past_2_pow_31(inplace):
    """N * V > 2**31: row offsets must be 64-bit, or the last rows read and write wrong memory."""
    n, vocab = 16_500, 131_072  # 2.16e9 logits, 4.3 GB in bf16
    assert n * vocab > 2**31
    gen = torch.Generator(device="cuda").manual_seed(seed_for_test())
    logits = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16, generator=gen)
    labels = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    labels[::7] = -100
    tail = slice(n - 64, n)  # rows whose offsets pass 2**31
    ref_tail = logits[tail].float().requires_grad_()
    ref_tail_loss = packed_ce.cross_entropy(ref_tail, labels[tail], reduction="sum", backend="torch")
    ref_tail_loss.backward()
    with torch.no_grad():  # full reference loss, chunked to bound memory
        ref_loss = sum(
            packed_ce.cross_entropy(logits[i : i + 2048].float(), labels[i : i + 2048], reduction="sum", backend="torch")
            for i in range(0, n, 2048)
        )
    x = logits.clone().requires_grad_() if not inplace else logits
    leaf = x if not inplace else None
    if inplace:
        leaf = logits.requires_grad_()
        x = leaf * 1  # non-leaf: the kernel may overwrite it
    loss = packed_ce.cross_entropy(x, labels, reduction="sum", backend="triton", inplace_backward=inplace)
    loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    assert relative_error(leaf.grad[tail], ref_tail.grad) < 8e-3
