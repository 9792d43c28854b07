"""Value checks on CUDA without a host sync: queued on the device, raised one call later.

With ``validate=True`` on CUDA the label range and ``cu_seqlens`` contents are checked by one
kernel whose record reaches the host through a non-blocking copy; a bad value makes that call's
loss and gradients NaN, and its ValueError is raised at the start of the next loss call or by
``packed_ce.check_pending()``. On CPU (CI) the same path runs through the Triton interpreter once
``pending.defers_checks`` is patched to defer CPU tensors too (the record is then complete at
once: no copy, no event); tests marked ``cuda`` run it as users do, and check that a validated
call never synchronises with the device.
"""

from __future__ import annotations

import os

import pytest
import torch

import packed_ce
from packed_ce import pending, records
from packed_ce.options import Boundaries

from loss_utils import HAS_CUDA, INTERPRETING

V = 11
H = 8
interpreted = pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
cuda_only = [
    pytest.mark.cuda,
    pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a CUDA GPU"),
]


@pytest.fixture(autouse=True)
def no_pending_checks():
    """Every test starts and ends with an empty queue: a left-over failure would raise in
    whichever loss call comes next, in another test."""
    pending.discard_pending()
    yield
    assert not pending.discard_pending(), "a test left value checks pending"


@pytest.fixture
def deferred(monkeypatch):
    """Defer the checks of CPU tensors too, as on CUDA."""
    monkeypatch.setattr(pending, "defers_checks", lambda device: True)


def _loss(kind, labels, *, device="cpu", **kwargs):
    """``(loss, input with .grad)`` of one validated call of ``kind`` on fixed inputs, after
    ``loss.sum().backward()``."""
    gen = torch.Generator().manual_seed(0)
    n = labels.numel()
    if kind == "fused":
        hidden = torch.randn(n, H, generator=gen).to(device).requires_grad_()
        weight = torch.randn(V, H, generator=gen).to(device)
        loss = packed_ce.fused_linear_cross_entropy(
            hidden, weight, labels, backend="triton", **kwargs
        )
        leaf = hidden
    else:
        leaf = torch.randn(n, V, generator=gen).to(device).requires_grad_()
        if kind == "module":
            per_call = ("cu_seqlens", "num_items_in_batch", "seq_targets", "seq_weights")
            tensors = {k: kwargs.pop(k) for k in per_call if k in kwargs}
            loss_fn = packed_ce.PackedCrossEntropyLoss(backend="triton", **kwargs)
            loss = loss_fn(leaf, labels, **tensors)
        else:
            loss = packed_ce.cross_entropy(leaf, labels, backend="triton", **kwargs)
    loss.sum().backward()
    return loss, leaf


def _bad_inputs(device="cpu"):
    """(case, labels, keywords) of one bad value each; N = 6 tokens in two sequences."""
    good = torch.tensor([1, 2, 3, -100, 4, 10], device=device)
    cu = lambda *c: torch.tensor(c, dtype=torch.int32, device=device)  # noqa: E731
    packed = dict(is_packed=True, shift=True)
    return [
        ("label_too_large", good.clone().index_fill_(0, torch.tensor([2], device=device), V), {}),
        ("label_negative", good.clone().index_fill_(0, torch.tensor([4], device=device), -5), {}),
        # the first label of a sequence is no target under shift: the loss would not see it
        ("label_not_a_target", good.clone().index_fill_(0, torch.tensor([3], device=device), V),
         dict(cu_seqlens=cu(0, 3, 6), **packed)),
        ("cu_not_from_zero", good, dict(cu_seqlens=cu(1, 3, 6), **packed)),
        ("cu_not_to_n", good, dict(cu_seqlens=cu(0, 3, 5), **packed)),
        ("cu_decreasing", good, dict(cu_seqlens=cu(0, 4, 2, 6), **packed)),
        ("count_negative", good, dict(num_items_in_batch=torch.tensor(-1.0, device=device))),
        ("count_nan", good, dict(num_items_in_batch=torch.tensor(float("nan"), device=device))),
        # the first sequence has 2 targets under shift, more than its conversation's 1
        ("seq_targets_below_own", good,
         dict(cu_seqlens=cu(0, 3, 6), seq_targets=cu(1, 5), **packed)),
        ("seq_weights_negative", good,
         dict(cu_seqlens=cu(0, 3, 6), seq_weights=torch.tensor([1.0, -1.0], device=device),
              **packed)),
        # each finite, their float64 sum (the mean's denominator) is not
        ("seq_weights_sum_overflows", good,
         dict(cu_seqlens=cu(0, 3, 6), seq_weights=torch.tensor([1e308, 1e308], dtype=torch.float64,
                                                                device=device), **packed)),
    ]


BAD_CASES = [case for case, _, _ in _bad_inputs()]


def _same_error(deferred: str, immediate: str) -> bool:
    """The deferred message starts with the one the call raises itself: one record, one set of
    messages."""
    return deferred.startswith(immediate)


def _immediate_message(labels, keywords):
    """The ValueError the call raises when values are checked inside it (CPU tensors)."""
    with pytest.raises(ValueError) as error:
        packed_ce.cross_entropy(torch.zeros(labels.numel(), V), labels, backend="torch", **keywords)
    return str(error.value)


# --- the device kernel against the PyTorch predicates ------------------------------------------


def _combined(rows):
    """The kernel's per-program rows as one record, as records.message reads them."""
    F = records.Field
    first = next((row for row in rows if row[F.BAD_LABELS]), [0, -1, 0])
    return [sum(row[F.BAD_LABELS] for row in rows), first[F.BAD_LABEL_AT],
            first[F.BAD_LABEL_VALUE], *rows[0][F.CU_FIRST:]]


@interpreted
@pytest.mark.parametrize(
    "dtype",
    [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8],
    ids=["int64", "int32", "int16", "int8", "uint8"],
)
@pytest.mark.parametrize(
    "n", [0, 1, 64, 65, 300], ids=["empty", "one", "one-block", "block+1", "five-blocks"]
)
def test_record_kernel_matches_pytorch(dtype, n):
    """Every field of the kernel's record equals the PyTorch one, for clean and bad labels and
    every kind of malformed cu_seqlens; a failed check makes the coefficients NaN exactly in the
    blocks that saw it (all of them for cu_seqlens), and leaves them alone otherwise."""
    from packed_ce.kernels.checks import launch_value_checks

    gen = torch.Generator().manual_seed(n)
    low = 0 if dtype == torch.uint8 else -3  # uint8 cannot hold ignore_index=-100
    ignore = 7 if dtype == torch.uint8 else -100
    clean = torch.randint(0, V, (n,), generator=gen)
    last_bad = clean.clone()
    last_bad[-1:] = V  # one bad label, in the last block only
    noisy = torch.randint(low, V + 3, (n,), generator=gen)
    cases = [
        None,
        torch.tensor([0, n // 2, n]),  # well formed
        torch.tensor([0, n // 2 + 3, n // 2, n], dtype=torch.int32),  # decreasing
        torch.tensor([1, n]),  # not from 0
        torch.tensor([0, n + 1]),  # not to N
        torch.tensor([2]),  # one entry, wrong
    ]
    for labels in (clean, last_bad, noisy):
        labels = labels.to(dtype)
        labels[labels == 5] = ignore
        for cu in cases:
            coef = torch.rand(n, generator=gen)
            before = coef.clone()
            rows = launch_value_checks(
                labels, cu, coef, None, vocab_size=V, ignore_index=ignore
            ).tolist()
            expected = records.encode(labels, V, ignore, cu).tolist()
            assert _combined(rows) == expected, (labels.tolist(), cu)
            F = records.Field
            malformed = expected[F.CU_FIRST] != 0 or expected[F.CU_LAST] != n or expected[F.DECREASE_AT] >= 0
            for p, row in enumerate(rows):
                part = slice(p * 64, (p + 1) * 64)  # the interpreter's block of labels
                if malformed or row[F.BAD_LABELS]:
                    assert coef[part].isnan().all()
                else:
                    assert torch.equal(coef[part], before[part])


@interpreted
def test_record_of_strided_and_batched_labels(deferred):
    """Labels and cu_seqlens that are views with strides read as their values; a bad label of
    ``(B, T)`` labels is named by its row and column."""
    from packed_ce.kernels.checks import launch_value_checks

    base = torch.tensor([1, 99, 2, 99, V, 99, 3, 99, -100, 99, 4, 99])
    labels = base[::2]  # [1, 2, V, 3, -100, 4]
    cu = torch.tensor([0, 9, 3, 9, 6, 9])[::2]  # [0, 3, 6]
    rows = launch_value_checks(labels, cu, torch.ones(6), None, vocab_size=V, ignore_index=-100)
    expected = records.encode(labels, V, -100, cu).tolist()
    assert _combined(rows.tolist()) == expected
    assert expected[:3] == [1, 2, V]
    _loss("cross_entropy", labels)
    with pytest.raises(ValueError, match=r"the first labels\[2\] = 11"):
        packed_ce.check_pending()
    logits = torch.zeros(2, 3, V)
    packed_ce.cross_entropy(logits, labels.reshape(2, 3), backend="triton")
    with pytest.raises(ValueError, match=r"the first labels\[0, 2\] = 11"):
        packed_ce.check_pending()


def test_message_names_the_position_and_value():
    good = records.encode(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8]), V, -100, None).tolist()
    F = records.Field
    bad = list(good)  # the second block: labels 5 and 6 are 11
    bad[F.BAD_LABELS], bad[F.BAD_LABEL_AT], bad[F.BAD_LABEL_VALUE] = 2, 5, 11
    rows = [good, bad]
    message = records.message(rows, labels_shape=(2, 4), vocab_size=V, ignore_index=-100)
    assert message == (
        "labels must be in [0, 11) or equal ignore_index=-100; found 2 bad values, "
        "the first labels[1, 1] = 11"
    )
    assert records.message([good], labels_shape=(8,), vocab_size=V, ignore_index=-100) is None
    bad_count = list(good)
    bad_count[F.BAD_COUNT] = 1
    message = records.message([bad_count], labels_shape=(8,), vocab_size=V, ignore_index=-100)
    assert message.startswith("num_items_in_batch must be finite and >= 0")


# --- the deferred path, through the interpreter ------------------------------------------------


@interpreted
@pytest.mark.parametrize("kind", ["cross_entropy", "module", "fused"])
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_value_gives_nan_then_raises_at_the_next_call(deferred, kind, case):
    """Call 1 returns without raising, its loss and gradient are NaN; call 2 (good) raises the
    message the call itself raises on the CPU; call 3 runs; nothing stays pending."""
    _, labels, keywords = next(c for c in _bad_inputs() if c[0] == case)
    expected = _immediate_message(labels, keywords)
    loss, leaf = _loss(kind, labels, **keywords)
    assert loss.isnan().all() and leaf.grad.isnan().any()
    assert pending.pending_count() == 1
    good = torch.tensor([1, 2, 3, -100, 4, 10])
    with pytest.raises(ValueError) as error:
        _loss(kind, good)
    assert _same_error(str(error.value), expected)
    assert "earlier loss call" in str(error.value)
    assert pending.pending_count() == 0
    loss, leaf = _loss(kind, good)
    packed_ce.check_pending()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()


@interpreted
@pytest.mark.parametrize("case", BAD_CASES)
def test_check_pending_raises_once(deferred, case):
    _, labels, keywords = next(c for c in _bad_inputs() if c[0] == case)
    expected = _immediate_message(labels, keywords)
    _loss("cross_entropy", labels, **keywords)
    with pytest.raises(ValueError) as error:
        packed_ce.check_pending()
    assert _same_error(str(error.value), expected)
    packed_ce.check_pending()  # consumed


@interpreted
@pytest.mark.parametrize("kind", ["cross_entropy", "fused"])
def test_good_calls_equal_unvalidated_and_queue_one_check(deferred, kind):
    """A deferred check changes nothing in a good call's results, and each call consumes the
    previous call's check: the queue never holds more than one."""
    labels = torch.tensor([1, 2, 3, -100, 4, 10])
    cu_seqlens = torch.tensor([0, 3, 6], dtype=torch.int32)
    keywords = dict(cu_seqlens=cu_seqlens, is_packed=True, shift=True)
    reference, reference_leaf = _loss(kind, labels, validate=False, **keywords)
    assert pending.pending_count() == 0
    for _ in range(3):
        loss, leaf = _loss(kind, labels, **keywords)
        assert pending.pending_count() == 1
        torch.testing.assert_close(loss, reference, rtol=0, atol=0)
        torch.testing.assert_close(leaf.grad, reference_leaf.grad, rtol=0, atol=0)
    packed_ce.check_pending()


@interpreted
def test_several_failures_report_the_first(deferred):
    labels = torch.tensor([1, 2, 3, -100, 4, 10])
    coef = torch.ones(6)
    options = packed_ce.LossOptions()
    for bad, cu_seqlens in ((labels.clone().fill_(V), None), (labels, torch.tensor([0, 7])),
                            (labels, torch.tensor([1, 6]))):
        boundaries = Boundaries(cu_seqlens=cu_seqlens)
        pending.check_values(bad, V, boundaries, options, coef)
    with pytest.raises(ValueError, match=r"found 6 bad values.*2 later calls failed too"):
        packed_ce.check_pending()


@interpreted
def test_pending_failure_at_exit_is_a_warning(deferred):
    _loss("cross_entropy", torch.tensor([1, 2, V, -100, 4, 10]))
    with pytest.warns(RuntimeWarning, match="at interpreter exit: labels must be in"):
        pending._report_pending_at_exit()
    assert pending.pending_count() == 0


@interpreted
def test_compiled_calls_neither_check_nor_read_the_queue(deferred):
    """Under torch.compile nothing is queued and the queue is not read: a check pending from an
    eager call neither breaks the graph nor recompiles it, and stays for check_pending()."""
    labels = torch.tensor([1, 2, 3, -100, 4, 10])
    cu_seqlens = torch.tensor([0, 3, 6], dtype=torch.int32)
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0))

    def step(x, y):
        return packed_ce.cross_entropy(x, y, cu_seqlens=cu_seqlens, is_packed=True, backend="triton")

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    expected = compiled(logits, labels)
    assert pending.pending_count() == 0
    _loss("cross_entropy", torch.tensor([1, 2, V, -100, 4, 10]))  # eager, bad: queued
    with torch._dynamo.config.patch(error_on_recompile=True):
        torch.testing.assert_close(compiled(logits, labels), expected)
    with pytest.raises(ValueError, match="labels"):
        packed_ce.check_pending()


def test_cpu_values_raise_inside_the_call():
    """Without deferral (CPU tensors) nothing is queued: the call itself raises."""
    labels = torch.tensor([1, 2, V, -100, 4, 10])
    with pytest.raises(ValueError, match="labels"):
        packed_ce.cross_entropy(torch.zeros(6, V), labels)
    assert pending.pending_count() == 0


@interpreted
def test_discarded_checks_never_raise(deferred):
    """``discard_pending`` empties the queue and says how many checks it dropped; a dropped bad
    call's error never comes (tests use it to keep one test's error out of the next)."""
    _loss("cross_entropy", torch.tensor([1, 2, V, -100, 4, 10]))  # bad: queued
    assert pending.pending_count() == 1
    assert pending.discard_pending() == 1
    assert pending.pending_count() == 0 and pending.discard_pending() == 0
    loss, _ = _loss("cross_entropy", torch.tensor([1, 2, 3, -100, 4, 10]))  # would raise the bad one's
    packed_ce.check_pending()
    assert torch.isfinite(loss)


def test_public_name():
    assert packed_ce.check_pending is pending.check_pending
    assert "check_pending" in packed_ce.__all__


# --- CUDA: as users run it ---------------------------------------------------------------------


def _cuda(test):
    for mark in cuda_only:
        test = mark(test)
    return test


@_cuda
@pytest.mark.parametrize("kind", ["cross_entropy", "fused"])
@pytest.mark.parametrize("case", BAD_CASES)
def test_gpu_bad_value_gives_nan_then_raises(kind, case):
    """Bad value in call 1: NaN loss and gradient, no error; ValueError at call 2 and, for a
    bad call just before it, at check_pending()."""
    _, labels, keywords = next(c for c in _bad_inputs("cuda") if c[0] == case)
    on_cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in keywords.items()}
    expected = _immediate_message(labels.cpu(), on_cpu)
    good = torch.tensor([1, 2, 3, -100, 4, 10], device="cuda")
    loss, leaf = _loss(kind, labels, device="cuda", **keywords)
    assert loss.isnan().all() and leaf.grad.isnan().any()
    with pytest.raises(ValueError) as error:
        _loss(kind, good, device="cuda")
    assert _same_error(str(error.value), expected)
    _loss(kind, labels, device="cuda", **keywords)
    with pytest.raises(ValueError) as error:
        packed_ce.check_pending()
    assert _same_error(str(error.value), expected)
    loss, leaf = _loss(kind, good, device="cuda")
    packed_ce.check_pending()
    assert torch.isfinite(loss) and torch.isfinite(leaf.grad).all()


@_cuda
@pytest.mark.parametrize("kind", ["cross_entropy", "fused"])
def test_gpu_validated_calls_never_synchronise(kind):
    """Forward and backward with validate=True (the default), twice (the second call reads the
    first call's check), make no stream or device synchronisation."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    labels = torch.randint(0, V, (600,), device="cuda", generator=gen)
    cu_seqlens = torch.tensor([0, 3, 300, 600], dtype=torch.int32, device="cuda")
    logits = torch.randn(600, V, device="cuda", generator=gen, requires_grad=True)
    hidden = torch.randn(600, H, device="cuda", generator=gen, requires_grad=True)
    weight = torch.randn(V, H, device="cuda", generator=gen, requires_grad=True)

    def step():
        keywords = dict(cu_seqlens=cu_seqlens, is_packed=True, shift=True)
        if kind == "fused":
            loss = packed_ce.fused_linear_cross_entropy(hidden, weight, labels, **keywords)
        else:
            loss = packed_ce.cross_entropy(logits, labels, **keywords)
        loss.backward()

    step()  # compiles the kernels
    packed_ce.check_pending()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    packed_ce.check_pending()


@_cuda
def test_gpu_validated_call_does_not_wait_for_the_device():
    """A validated call returns while the device is still busy with earlier work: it queued its
    checks instead of reading them."""
    labels = torch.tensor([1, 2, 3, -100, 4, 10], device="cuda")
    logits = torch.randn(6, V, device="cuda")
    packed_ce.cross_entropy(logits, labels)  # compiles the kernels
    packed_ce.check_pending()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of device time
    packed_ce.cross_entropy(logits, labels)
    assert not torch.cuda.current_stream().query()
    packed_ce.check_pending()  # waits for the sleep, then reads the check
    torch.cuda.synchronize()


@interpreted
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_forgets_the_parents_checks(deferred):
    """A DataLoader worker forked while a check is pending must not wait on the parent's
    device work, nor report its errors."""
    _loss("cross_entropy", torch.tensor([1, 2, V, -100, 4, 10]))
    pid = os.fork()
    if pid == 0:
        os._exit(0 if pending.pending_count() == 0 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    with pytest.raises(ValueError, match="labels"):  # the parent still has it
        packed_ce.check_pending()
