"""The token stats of a patched model's own loss call (``packed_ce_token_stats=True``).

A packed batch of synthetic conversations runs through a tiny model patched by
:func:`apply_packed_loss`, on the logits and through the fused forward, with Gemma 2's final
softcap too. The expected sums come from each conversation run alone through an unpatched copy
of the model: ``torch.distributions.Categorical`` entropy and ``argmax`` of its own logits
against its next labels.
"""

from __future__ import annotations

import copy

import pytest
import torch

from collators import PackedCollator
from integration_utils import IGNORE, synthetic_conversations, tiny_model
from packed_ce.integrations import PackedCausalLMLoss, apply_packed_loss
from packed_ce.integrations.model.loss import TOKEN_STATS_KEY

VOCAB = 8  # small: random labels of a random model still hit the top-1 class often


def one_at_a_time(model, conversations) -> torch.Tensor:
    """``[entropy sum, top-1 hits, targets]`` in float64 over every conversation alone."""
    totals = torch.zeros(3, dtype=torch.float64)
    with torch.no_grad():
        for conversation in conversations:
            logits = model(input_ids=torch.tensor([conversation["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(conversation["labels"][1:])
            keep = labels != IGNORE
            if not keep.any():  # Categorical refuses zero rows
                continue
            rows = logits[keep].double()
            totals[0] += torch.distributions.Categorical(logits=rows).entropy().sum()
            totals[1] += (rows.argmax(-1) == labels[keep]).sum()
            totals[2] += keep.sum()
    return totals


@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: a final logit softcap
@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused"])
def test_model_call_keeps_its_loss_stats(arch, fused_linear):
    conversations = synthetic_conversations([13, 1, 21, 8, 17], VOCAB, seed=3)
    model = tiny_model(arch, VOCAB, attn="eager")  # Gemma 2 has no sdpa path
    truth = one_at_a_time(copy.deepcopy(model).eval(), conversations)
    assert 0 < truth[1] < truth[2]  # some hits, some misses
    apply_packed_loss(model, is_packed=True, fused_linear=fused_linear)
    loss_fn = model.loss_function
    assert isinstance(loss_fn, PackedCausalLMLoss)
    batch = PackedCollator()(conversations)

    outputs = model(**batch, use_cache=False)  # not asked: nothing kept
    assert loss_fn.take_token_stats() is None
    outputs = model(**batch, use_cache=False, **{TOKEN_STATS_KEY: True})
    assert (outputs.logits is None) == fused_linear
    stats = loss_fn.take_token_stats()
    assert all(value.shape == () and not value.requires_grad for value in stats)
    torch.testing.assert_close(torch.stack(stats).double(), truth, rtol=1e-5, atol=1e-4)
    assert loss_fn.take_token_stats() is None  # taken once

    # evaluation runs the model's own forward: the loss on its logits keeps them too
    model.eval()
    model(**batch, use_cache=False, **{TOKEN_STATS_KEY: True})
    torch.testing.assert_close(
        torch.stack(loss_fn.take_token_stats()).double(), truth, rtol=1e-5, atol=1e-4
    )
