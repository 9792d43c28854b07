"""``return_token_stats``: entropy and top-1 sums over the targets, from the loss's own pass.

The reference is independent of ``packed_ce``: ``torch.distributions.Categorical(...).entropy()``
and ``argmax`` on float64 logits, over the rows whose label is a target, written out per
sequence under ``shift``. Every case checks both backends, the loss on logits and the fused loss
(in several chunks, with and without rows left out of the GEMMs), every reduction and packing on
and off (the stats do not depend on the weights), and that asking for them leaves the loss and
its gradient as they are.
"""

from __future__ import annotations

import pytest
import torch

import packed_ce
from packed_ce import TokenStats
from loss_utils import KERNEL_DEVICES

N, H, V = 37, 16, 50  # N not a multiple of the chunk size: the last chunk is partial
CHUNK = 8  # 5 chunks
IGNORE = -100
CU_SEQLENS = [0, 9, 9, 20, 31, 37]  # an empty sequence; the 4th gets no target below

# backend x device: the reference everywhere, the kernel where it can run
BACKENDS = [pytest.param("torch", "cpu", id="torch")] + [
    pytest.param("triton", device.values[0], id=f"triton-{device.values[0]}", marks=device.marks)
    for device in KERNEL_DEVICES
]


def case(masked: bool, seed: int = 0):
    """hidden ``(N, H)``, weight ``(V, H)``, bias ``(V,)``, labels ``(N,)``, cu_seqlens.

    About half of the targets are made the most likely class, so the accuracy is neither 0 nor
    1; ``masked`` puts ``-inf`` in one vocabulary entry of the bias (a masked token).
    """
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    bias = torch.randn(V, generator=gen)
    if masked:
        bias[3] = float("-inf")
    logits = hidden @ weight.T + bias
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[3 == labels] = 4  # never the masked class as a target
    labels = torch.where(torch.rand(N, generator=gen) < 0.5, logits.argmax(-1), labels)
    labels[::5] = IGNORE
    labels[20:31] = IGNORE  # a sequence without a target
    return hidden, weight, bias, labels, torch.tensor(CU_SEQLENS, dtype=torch.int32)


def expected(logits: torch.Tensor, labels: torch.Tensor, softcap=None) -> torch.Tensor:
    """``[entropy sum, top-1 hits, targets]`` in float64, rows whose label is a target."""
    keep = labels != IGNORE
    rows = logits[keep].double()
    if softcap is not None:
        rows = softcap * torch.tanh(rows / softcap)
    entropy = torch.distributions.Categorical(logits=rows).entropy().sum()
    hits = (rows.argmax(-1) == labels[keep]).sum()
    return torch.stack([entropy, hits.double(), keep.sum().double()])


def run(fused: bool, hidden, weight, bias, labels, device, **options):
    """Loss (and whatever it returns) of the fused or the unfused call, on ``device``."""
    hidden, weight, bias, labels = (t.to(device) for t in (hidden, weight, bias, labels))
    if fused:
        return packed_ce.fused_linear_cross_entropy(
            hidden, weight, labels, bias=bias, chunk_size=CHUNK, **options
        )
    return packed_ce.cross_entropy(hidden @ weight.T + bias, labels, **options)


def as_tensor(stats: TokenStats) -> torch.Tensor:
    assert isinstance(stats, TokenStats)
    for value in stats:
        assert value.shape == () and value.dtype == torch.float32 and not value.requires_grad
    return torch.stack(stats).cpu().double()


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize(
    "fused, drop", [(False, False), (True, False), (True, True)], ids=["logits", "fused", "fused-drop"]
)
# each reduction once, packing on and off: the stats depend on neither (only on the targets)
@pytest.mark.parametrize("reduction, is_packed", [("mean", True), ("sum", False), ("none", True)])
@pytest.mark.parametrize("masked, softcap", [(False, 3.0), (True, None)], ids=["softcap", "-inf"])
def test_stats_match_categorical(backend, device, fused, drop, reduction, is_packed, masked, softcap):
    hidden, weight, bias, labels, cu_seqlens = case(masked)
    options = dict(
        backend=backend, reduction=reduction, is_packed=is_packed, softcap=softcap,
        cu_seqlens=cu_seqlens.to(device),
    )
    if fused:
        options["drop_ignored_rows"] = drop
    weight.requires_grad_()
    loss, stats = run(fused, hidden, weight, bias, labels, device, return_token_stats=True, **options)
    truth = expected(hidden @ weight.detach().T + bias, labels, softcap)
    assert 0 < truth[1] < truth[2]  # some hits, some misses
    torch.testing.assert_close(as_tensor(stats), truth, rtol=1e-5, atol=1e-4)
    # the stats change nothing else: the same loss and the same gradient as without them
    (grad,) = torch.autograd.grad(loss.sum(), weight)
    plain = run(fused, hidden, weight, bias, labels, device, **options)
    (plain_grad,) = torch.autograd.grad(plain.sum(), weight)
    # Up to one fp32 ulp (2**-23 relative, 3e-7 with margin): the kernel compiled with the
    # stats switch may contract a multiply-add of the loss differently (seen once on an H100).
    torch.testing.assert_close(loss, plain, rtol=3e-7, atol=0, equal_nan=True)
    torch.testing.assert_close(grad, plain_grad, rtol=3e-7, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_stats_follow_shifted_targets_with_z_loss(backend, device, fused):
    """Under ``shift`` (boundaries from position_ids) the row of token t is scored against
    ``labels[t + 1]`` of its sequence; the stats come last, after ``z_loss``."""
    hidden, weight, bias, labels, cu_seqlens = case(masked=False, seed=1)
    bounds = cu_seqlens.tolist()
    position_ids = torch.cat([torch.arange(b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    logits = hidden @ weight.T + bias
    rows, targets = [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        rows.append(logits[a : b - 1] if b > a else logits[a:a])
        targets.append(labels[a + 1 : b])
    truth = expected(torch.cat(rows), torch.cat(targets))
    outputs = run(
        fused, hidden, weight, bias, labels, device, backend=backend, shift=True, is_packed=True,
        position_ids=position_ids.to(device), return_z_loss=True, return_token_stats=True,
        z_loss_scale=1e-3,
    )
    assert len(outputs) == 3 and outputs[1].shape == ()
    torch.testing.assert_close(as_tensor(outputs[2]), truth, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stats_of_half_precision_logits(backend, device, dtype):
    """The kernel upcasts each element as it reads it: the stats are those of the rounded
    logits, in float32."""
    hidden, weight, bias, labels, _ = case(masked=False, seed=2)
    logits = (hidden @ weight.T + bias).to(dtype)
    _, stats = packed_ce.cross_entropy(
        logits.to(device), labels.to(device), backend=backend, return_token_stats=True
    )
    torch.testing.assert_close(as_tensor(stats), expected(logits, labels), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend, device", BACKENDS)
def test_uniform_logits_and_ties(backend, device):
    """Uniform rows: entropy log V, and every target ties for the top: all correct."""
    labels = torch.tensor([0, V - 1, IGNORE, 7], device=device)
    _, stats = packed_ce.cross_entropy(
        torch.zeros(4, V, device=device), labels, backend=backend, return_token_stats=True,
        reduction="none",
    )
    truth = torch.tensor([3 * torch.log(torch.tensor(float(V))), 3.0, 3.0], dtype=torch.float64)
    torch.testing.assert_close(as_tensor(stats), truth)


@pytest.mark.parametrize("backend, device", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_nothing_to_count(backend, device, fused):
    """No target, or ``num_items_in_batch=0`` (every weight 0): zero sums, never NaN."""
    hidden, weight, bias, labels, _ = case(masked=False)
    for labels, items in ((torch.full_like(labels, IGNORE), None), (labels, 0)):
        _, stats = run(
            fused, hidden, weight, bias, labels, device, backend=backend,
            num_items_in_batch=items, return_token_stats=True,
        )
        assert as_tensor(stats).tolist() == [0.0, 0.0, 0.0]


def test_option_is_checked():
    with pytest.raises(TypeError, match="return_token_stats must be True or False"):
        packed_ce.LossOptions(return_token_stats=1)
