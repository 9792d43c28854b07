"""Test helpers of the loss tests: random packings, the devices the kernel runs on, seeds.

The ground truth they are compared with is the ``per_sequence_loss`` fixture of ``conftest.py``.
"""

from __future__ import annotations

import os
import random
import zlib
from dataclasses import dataclass

import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()

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
