"""token_statistics: trl's entropy and top-1 accuracy sums, from logits and from hidden states.

Checked against ``torch.distributions.Categorical`` and ``argmax`` on float64 logits, with about
half of the targets made the most likely class (so that the accuracy is neither 0 nor 1), a
bias, a softcap, rows without a target, a ``-inf`` logit, and more rows than one block.
"""

from __future__ import annotations

import pytest
import torch

from packed_ce.integrations import token_statistics
from packed_ce.integrations import token_stats

N, H, V = 37, 16, 50
IGNORE = -100


def case(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen)
    bias = torch.randn(V, generator=gen)
    logits = hidden @ weight.T + bias
    targets = torch.randint(0, V, (N,), generator=gen)
    hits = torch.rand(N, generator=gen) < 0.5
    targets = torch.where(hits, logits.argmax(-1), targets)
    targets[::5] = IGNORE  # rows without a target
    return hidden, weight, bias, targets


def expected(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    keep = targets != IGNORE
    rows = logits[keep].double()
    entropy = torch.distributions.Categorical(logits=rows).entropy().sum()
    hits = (rows.argmax(-1) == targets[keep]).sum()
    return torch.stack([entropy, hits.double(), keep.sum().double()]).float()


@pytest.mark.parametrize("softcap", [None, 3.0])
@pytest.mark.parametrize("block_rows", [4096, 7])  # one block, several blocks
def test_token_statistics_from_logits_and_hidden(softcap, block_rows, monkeypatch):
    monkeypatch.setattr(token_stats, "CHUNK_ROWS", block_rows)
    hidden, weight, bias, targets = case()
    logits = hidden @ weight.T + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    truth = expected(logits, targets)
    assert 0 < truth[1] < truth[2]  # some hits, some misses
    from_logits = token_statistics(targets, logits=logits.reshape(1, N, V))
    from_hidden = token_statistics(
        targets, hidden=hidden, weight=weight, bias=bias, softcap=softcap
    )
    torch.testing.assert_close(from_logits, truth, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(from_hidden, truth, rtol=1e-5, atol=1e-5)


def test_token_statistics_masked_vocabulary_entry_is_finite():
    hidden, weight, bias, targets = case(1)
    logits = hidden @ weight.T + bias
    logits[:, 3] = float("-inf")  # a masked vocabulary entry: 0 log 0 = 0, not NaN
    stats = token_statistics(targets, logits=logits)
    assert torch.isfinite(stats).all()
    torch.testing.assert_close(stats, expected(logits, targets), rtol=1e-5, atol=1e-5)


def test_token_statistics_needs_one_source():
    with pytest.raises(ValueError, match="either logits, or hidden and weight"):
        token_statistics(torch.zeros(3, dtype=torch.long))
