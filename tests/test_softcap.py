"""The kernel's softcap ``c * tanh(x / c)`` agrees with ``torch.tanh`` to fp32 rounding.

Triton has no tanh, and the kernel's first formula ``1 - 2 / (exp(2u) + 1)`` cancelled for small
``u = x / c``. The grid walks ``|x / c|`` from 1e-6 to saturation, across the kernel's switch
between its series and its exp form at ``|u| = 0.4``, with Gemma's cap (30) and small caps; the
tolerance is the one of a peer's fp32 cross-entropy tests (rtol 1e-6 on the loss).
"""

import math

import pytest
import torch

import packed_ce
from packed_ce.runtime import TRITON_AVAILABLE, interpreting

INTERPRETING = TRITON_AVAILABLE and interpreting()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETING, reason="needs TRITON_INTERPRET=1")),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(
                INTERPRETING or not torch.cuda.is_available(), reason="needs a CUDA GPU"
            ),
        ],
    ),
]


def float64_loss(logits: torch.Tensor, labels: torch.Tensor, softcap: float) -> torch.Tensor:
    """Token mean of ``F.cross_entropy`` on ``softcap * tanh(logits / softcap)``, in float64."""
    x = logits.double()
    return torch.nn.functional.cross_entropy(softcap * torch.tanh(x / softcap), labels)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("softcap", [30.0, 5.0, 1.0])  # Gemma 2's final cap, then small caps
@pytest.mark.parametrize("scale", [1e-5, 1e-2, 0.4, 3.0, 100.0])  # |x / c| from ~1e-6 to saturated
def test_softcap_matches_tanh(device: str, softcap: float, scale: float) -> None:
    generator = torch.Generator().manual_seed(int(1000 * softcap + math.log10(scale) * 7))
    logits = (torch.randn(6, 300, generator=generator) * scale * softcap).to(device)
    labels = torch.randint(0, 300, (6,), generator=generator).to(device)
    logits.requires_grad_(True)
    loss = packed_ce.cross_entropy(logits, labels, softcap=softcap, backend="triton")
    loss.backward()

    reference_logits = logits.detach().double().requires_grad_(True)
    reference = float64_loss(reference_logits, labels, softcap)
    reference.backward()
    torch.testing.assert_close(loss.double(), reference, rtol=1e-6, atol=1e-9)
    # Each gradient entry is p_j * (1 - tanh(u_j)^2) / N with p_j = exp(x_j - lse): the fp32
    # rounding of a capped logit x_j (half an ulp of |x| <= max |x|) moves p_j by that much,
    # relative, which is the budget (x4 for the ulps of lse and of the slope), nothing more.
    capped = softcap * torch.tanh(reference_logits.detach() / softcap)
    rtol = 1e-6 + 4 * 2.0**-24 * capped.abs().max().item()
    torch.testing.assert_close(logits.grad.double(), reference_logits.grad, rtol=rtol, atol=1e-10)
