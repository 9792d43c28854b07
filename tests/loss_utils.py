"""Test helpers of the loss tests: the ground truth, tolerances, random packings, the devices
the kernel runs on, seeds.

The ground truth is :func:`per_sequence_loss` (also the ``per_sequence_loss`` fixture): it never
looks at ``cu_seqlens`` or ``position_ids``, takes the sequences as Python slices, runs
``F.cross_entropy`` on each one as if it were unpacked, and averages, which is what the packed
loss must equal. It does not use ``packed_ce``, so a mistake there cannot hide in the reference.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()

def per_sequence_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    slices: list[tuple[int, int]],
    *,
    is_packed: bool,
    shift: bool,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch=None,
    seq_targets: list[int] | None = None,
    seq_weights: list[float] | None = None,
) -> torch.Tensor:
    """The loss computed one sequence at a time with ``F.cross_entropy``, in float64.

    For ``is_packed=True``: each sequence's mean token loss, summed ("sum") or averaged over the
    sequences that have a target ("mean"). For ``is_packed=False``: the token sum or mean.
    "none" is not handled here (it is checked through its sum).

    ``seq_targets`` / ``seq_weights`` (one per slice): sequence ``i``'s token sum weighs
    ``seq_weights[i] / seq_targets[i]`` (packed) or ``seq_weights[i]`` instead, and "mean"
    divides by the weighted count of targets, ``sum_i seq_weights[i] * count_i / seq_targets[i]``
    (packed) or ``sum_i seq_weights[i] * count_i``.
    """
    x_all = logits.reshape(-1, logits.shape[-1]).double()
    y_all = labels.reshape(-1)
    if softcap is not None:
        x_all = softcap * torch.tanh(x_all / softcap)
    seq_sums, seq_counts, seq_scales = [], [], []
    for i, (start, end) in enumerate(slices):
        x, y = x_all[start:end], y_all[start:end]
        if shift:
            x, y = x[:-1], y[1:]
        count = int((y != ignore_index).sum())
        if count == 0:
            continue
        total = F.cross_entropy(
            x, y, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
        )
        lse = torch.logsumexp(x[y != ignore_index], dim=-1)
        total = total + z_loss_scale * lse.square().sum()
        seq_sums.append(total)
        seq_counts.append(count)
        weight = 1.0 if seq_weights is None else float(seq_weights[i])
        whole = count if seq_targets is None else int(seq_targets[i])
        seq_scales.append(weight / whole if is_packed else weight)
    # keeps the graph alive when nothing is a target (-inf logits, masked entries, add 0 too)
    zero = x_all.nan_to_num(neginf=0.0).sum() * 0.0
    if not seq_sums:
        return zero
    if seq_targets is not None or seq_weights is not None:
        total = sum(a * s for a, s in zip(seq_scales, seq_sums))
        items = sum(a * c for a, c in zip(seq_scales, seq_counts))
    elif is_packed:
        per_seq = torch.stack([s / c for s, c in zip(seq_sums, seq_counts)])
        total, items = per_seq.sum(), len(per_seq)
    else:
        total, items = torch.stack(seq_sums).sum(), sum(seq_counts)
    if reduction == "sum":
        return total + zero
    denominator = items if num_items_in_batch is None else float(num_items_in_batch)
    return total / denominator + zero if denominator > 0 else zero


# One (rtol, atol) per dtype of the result under test, elementwise against a float64 ground truth:
# float32 arithmetic gives a few ulps per term (the kernel's exp and log included); bf16 and fp16
# results are rounded once, at the end, to 8 and 11 significant bits.
TOLERANCES = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (2e-5, 1e-6),
    torch.bfloat16: (2e-2, 1e-5),
    torch.float16: (5e-3, 1e-6),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, **kwargs):
    """``torch.testing.assert_close`` elementwise in float64 with the (rtol, atol) of ``dtype``
    (default: ``actual``'s); a failure prints the worst element and how many are off."""
    rtol, atol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(
        actual.detach().cpu().double(), expected.detach().cpu().double(), rtol=rtol, atol=atol, **kwargs
    )


# Where the Triton kernel can run in this session: CPU tensors through the interpreter (CI),
# CUDA tensors compiled (GPU machine, TRITON_INTERPRET unset).
KERNEL_DEVICES = [
    pytest.param(
        "cpu", marks=pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(not HAS_CUDA or INTERPRETING, reason="needs a CUDA GPU"),
        ],
    ),
]
# (backend, device) pairs: the torch backend on the CPU, the Triton kernel where it runs.
BACKEND_DEVICES = [
    pytest.param(("torch", "cpu"), id="torch"),
    *(pytest.param(("triton", p.values[0]), marks=p.marks, id=f"triton-{p.values[0]}") for p in KERNEL_DEVICES),
]
# Both backends on CPU tensors (the kernel through the interpreter).
CPU_BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")),
]

# The option combinations every loss is checked under: each term of l_t alone, then all at once.
OPTION_SETS = {
    "plain": dict(),
    "smoothing": dict(label_smoothing=0.1),
    "zloss": dict(z_loss_scale=1e-2),
    "softcap": dict(softcap=3.0),
    "all": dict(label_smoothing=0.2, z_loss_scale=1e-3, softcap=5.0),
}


def seed_for_test() -> int:
    """The seed of the calling test's random inputs, printed so that a failure can be replayed.

    Fixed by default (CI and every plain run draw the same inputs): a checksum of the test's
    id, so that tests differ from each other but not from run to run. The environment variable
    ``PACKED_CE_TEST_SEED`` asks for others: a number (replay that seed in every test), or
    ``random`` (a fresh seed per test, for fuzzing).
    """
    requested = os.environ.get("PACKED_CE_TEST_SEED", "")
    if requested == "random":
        seed = random.randrange(2**31)
    elif requested:
        seed = int(requested)
    else:
        test_id = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        seed = zlib.crc32(test_id.encode())
    print(f"seed={seed}  (replay with PACKED_CE_TEST_SEED={seed})")
    return seed


@dataclass
class Packing:
    """A random pack: ``labels`` ``(N,)`` or ``(B, T)`` and its boundaries."""

    labels: torch.Tensor
    lengths: list[int]  # sequence lengths in order, zeros allowed (empty sequences)
    cu_seqlens: torch.Tensor  # (S+1,) int32
    position_ids: torch.Tensor  # labels-shaped int64, restarting at 0 per sequence

    @property
    def slices(self) -> list[tuple[int, int]]:
        bounds = self.cu_seqlens.tolist()
        return list(zip(bounds[:-1], bounds[1:]))


def random_lengths(gen: torch.Generator, total: int, max_len: int) -> list[int]:
    """Lengths summing to ``total``: random in [0, max_len], empty sequences included."""
    lengths = []
    while sum(lengths) < total:
        lengths.append(min(int(torch.randint(0, max_len + 1, (1,), generator=gen)), total - sum(lengths)))
    return lengths


def random_packing(
    gen: torch.Generator,
    vocab: int,
    *,
    rows: int | None = None,
    row_len: int = 32,
    n_tokens: int = 64,
    max_len: int = 12,
    ignore_index: int = -100,
    device: str = "cpu",
) -> Packing:
    """Labels with random packing: empty sequences, sequences with no target, ignored runs.

    With ``rows`` the labels are ``(rows, row_len)`` and every row starts a new sequence (as in
    a padded or row-packed batch); else ``(n_tokens,)``.
    """
    shape = (rows, row_len) if rows else (n_tokens,)
    per_row = [random_lengths(gen, row_len, max_len) for _ in range(rows)] if rows else None
    lengths = sum(per_row, []) if rows else random_lengths(gen, n_tokens, max_len)
    n = sum(lengths)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    # the first and last class indices must work
    labels[torch.randint(0, n, (2,), generator=gen)] = torch.tensor([0, vocab - 1])
    # scattered ignored tokens, one long ignored run, and whole sequences without targets
    labels[torch.rand(n, generator=gen) < 0.2] = ignore_index
    start = int(torch.randint(0, max(n - n // 4, 1), (1,), generator=gen))
    labels[start : start + n // 4] = ignore_index
    bounds = torch.tensor([0] + lengths).cumsum(0)
    for s in range(len(lengths)):
        if torch.rand((), generator=gen) < 0.15:
            labels[bounds[s] : bounds[s + 1]] = ignore_index
    position_ids = torch.cat([torch.arange(length) for length in lengths] or [torch.zeros(0)])
    return Packing(
        labels=labels.reshape(shape).to(device),
        lengths=lengths,
        cu_seqlens=bounds.to(torch.int32).to(device),
        position_ids=position_ids.to(torch.int64).reshape(shape).to(device),
    )


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are 0)."""
    actual, expected = actual.double(), expected.double()
    denominator = expected.norm()
    if denominator == 0:
        return float(actual.norm())
    return float((actual - expected).norm() / denominator)
