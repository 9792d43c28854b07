"""``return_seq_losses``: each sequence's share of the loss and of the weight, from the loss's
own pass.

Against the float64 loop (:func:`loss_utils.per_sequence_loss`, one sequence at a time): the
shares add up to the returned loss, and each sequence's ``loss / weight`` is its mean token loss
(with ``seq_weights``, its weight cancels). Both backends, on logits and fused with the LM head,
``cu_seqlens`` and ``position_ids`` boundaries, random packings with empty sequences and
sequences without a target.
"""

from __future__ import annotations

import pytest
import torch

import packed_ce
from loss_utils import BACKEND_DEVICES, OPTION_SETS, assert_close, per_sequence_loss, random_packing, seed_for_test

V = 37


@pytest.mark.parametrize("boundaries", ["cu_seqlens", "position_ids"])
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("backend", BACKEND_DEVICES)
def test_sequence_shares_against_the_loop(backend, weighted, fused, boundaries):
    backend, device = backend
    if weighted and boundaries == "position_ids":
        pytest.skip("seq_weights are aligned with cu_seqlens")
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=48, max_len=10, device=device)
    hidden = torch.randn(48, 16, generator=gen, dtype=torch.float64).to(device)
    head = torch.randn(V, 16, generator=gen, dtype=torch.float64).to(device) / 4
    dtype = torch.float64 if backend == "torch" else torch.float32
    hidden, head = hidden.to(dtype), head.to(dtype)
    logits = hidden @ head.T
    weights = torch.rand(len(packing.lengths), generator=gen).to(device) * 3 if weighted else None
    keywords = dict(is_packed=True, shift=True, backend=backend, return_seq_losses=True,
                    **OPTION_SETS["all"])
    if boundaries == "cu_seqlens":
        keywords.update(cu_seqlens=packing.cu_seqlens, seq_weights=weights)
    else:
        keywords.update(position_ids=packing.position_ids)
    if fused:
        loss, shares = packed_ce.fused_linear_cross_entropy(hidden, head, packing.labels, **keywords)
    else:
        loss, shares = packed_ce.cross_entropy(logits, packing.labels, **keywords)

    assert shares.loss.dtype == shares.weight.dtype == torch.float32
    assert not shares.loss.requires_grad
    assert_close(shares.loss.sum(), loss.detach(), torch.float32)
    # sequence i of the packing in slot i (position_ids: the empty ones have no slot)
    slices = [s for s in packing.slices if boundaries == "cu_seqlens" or s[1] > s[0]]
    options = {k: v for k, v in OPTION_SETS["all"].items()}
    for i, piece in enumerate(slices):
        mean = per_sequence_loss(logits, packing.labels, [piece], is_packed=True, shift=True, **options)
        has_target = bool((packing.labels.reshape(-1)[piece[0] + 1 : piece[1]] != -100).any())
        if not has_target or (weighted and float(weights[i]) == 0):
            assert shares.loss[i] == 0 and shares.weight[i] == 0
            continue
        assert_close(shares.loss[i] / shares.weight[i], mean, torch.float32)
    assert (shares.loss[len(slices):] == 0).all()


def test_shares_need_no_option_beyond_the_loss():
    """The loss itself is unchanged by asking for the shares (same value, same gradient)."""
    gen = torch.Generator().manual_seed(seed_for_test())
    packing = random_packing(gen, V, n_tokens=40)
    logits = torch.randn(40, V, generator=gen, requires_grad=True)
    plain = packed_ce.cross_entropy(logits, packing.labels, cu_seqlens=packing.cu_seqlens,
                                    is_packed=True, shift=True)
    (grad,) = torch.autograd.grad(plain, logits)
    loss, _ = packed_ce.cross_entropy(logits, packing.labels, cu_seqlens=packing.cu_seqlens,
                                      is_packed=True, shift=True, return_seq_losses=True)
    (grad_with,) = torch.autograd.grad(loss, logits)
    assert torch.equal(loss, plain) and torch.equal(grad_with, grad)
