"""Rotary embeddings whose frequencies depend on the call: each packed conversation gets its own.

transformers chooses ``"longrope"`` and ``"dynamic"`` frequencies from ``max(position_ids) + 1``:
packed, a short conversation beside a long one (past ``original_max_position_embeddings``) got the
long one's frequencies. With ``apply_packed_loss`` the packed row's loss and every gradient must be
every conversation alone, each in a model as fresh as the packed one (``"dynamic"`` caches the
longest length it saw); the leak without the fix is measured too, so the test cannot pass on a row
that leaks nothing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from collators import PackedCollator, PaddedCollator
from packed_ce.integrations import apply_packed_loss, remove_packed_loss, tiny_causal_lm

from integration_utils import (
    assert_gradients_close,
    assert_loss_close,
    loss_and_gradients,
    one_at_a_time,
    synthetic_conversations,
)

VOCAB = 96
HEAD = 16
LENGTHS = [30, 9, 21, 6]  # two past the trained length of 16, two within it
ROPE = {
    # Phi-3/3.5/4-mini: the long factors past original_max_position_embeddings
    "longrope": ("phi3", dict(original_max_position_embeddings=16, max_position_embeddings=64, pad_token_id=0, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * (HEAD // 2),
        "long_factor": [1.0 + i for i in range(HEAD // 2)], "original_max_position_embeddings": 16})),
    # NTK scaling past max_position_embeddings, grown to each call's longest position
    "dynamic": ("llama", dict(max_position_embeddings=16, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})),
}


def model_of(rope: str):
    model_type, fields = ROPE[rope]
    return tiny_causal_lm(VOCAB, model_type=model_type, head_dim=HEAD, **fields)


def alone(model, conversations):
    """Every conversation alone, each through its own copy of ``model`` as it is now (a
    ``"dynamic"`` embedding's cache then holds no earlier call's length); gradients summed."""
    losses, grads = [], None
    for conversation in conversations:
        twin = copy.deepcopy(model)
        loss, twin_grads = loss_and_gradients(twin, lambda m: one_at_a_time(m, [conversation]))
        losses.append(loss)
        grads = twin_grads if grads is None else {n: grads[n] + g for n, g in twin_grads.items()}
    count = len(conversations)
    return torch.stack(losses).mean(), {n: g / count for n, g in grads.items()}


@pytest.mark.parametrize("layout", ["packed", "padded"])
@pytest.mark.parametrize("rope", sorted(ROPE))
def test_each_conversation_gets_its_own_frequencies(rope, layout):
    """Packed (a row's conversations) and padded (a batch's rows: transformers gives every row the
    positions of the longest) alike."""
    conversations = synthetic_conversations(LENGTHS, VOCAB, seed=4)
    batch = (PackedCollator() if layout == "packed" else PaddedCollator())(conversations)
    model = model_of(rope)
    expected_loss, expected_grads = alone(model, conversations)

    leaky = copy.deepcopy(model)  # the family's own packed call: the row's frequencies for all
    logits = leaky(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
    own = [leaky(input_ids=torch.tensor([c["input_ids"]]), use_cache=False).logits[0] for c in conversations]
    if layout == "packed":
        leak = (logits[0] - torch.cat(own)).abs().max()
    else:
        leak = max((logits[i, : len(o)] - o).abs().max() for i, o in enumerate(own))
    assert leak > 1e-4  # the batch leaks without the fix (float32: ~1e-7)

    apply_packed_loss(model, backend="torch")
    actual_loss, actual_grads = loss_and_gradients(copy.deepcopy(model), lambda m: m(**batch).loss)
    assert_loss_close(actual_loss, expected_loss)
    assert_gradients_close(actual_grads, expected_grads, rtol=1e-5)

    remove_packed_loss(model)
    assert not any(module._forward_hooks for module in model.modules())


def test_context_parallelism_refuses_a_batch_dependent_rotary_embedding(one_rank_group):
    """Each rank would choose frequencies from its own shard's positions: refused by name."""
    from packed_ce.integrations import enable_context_parallel

    model = apply_packed_loss(model_of("longrope"))
    with pytest.raises(ValueError, match="rope_type='longrope'.* chooses its frequencies"):
        enable_context_parallel(model)


def test_a_second_call_whose_conversations_share_one_length_gets_their_own_frequencies():
    """A first call leaves its longest conversation's frequencies on the module ("dynamic" keeps
    the longest length it saw; "longrope" chooses again at every call); a second call whose
    conversations all have one length must still get that length's frequencies, as each
    conversation alone in a fresh model."""
    rope = "dynamic"
    first = synthetic_conversations([30, 9], VOCAB, seed=1)
    second = synthetic_conversations([20, 20], VOCAB, seed=2)
    model = model_of(rope)
    expected_loss, expected_grads = alone(model, second)
    apply_packed_loss(model, backend="torch")
    with torch.no_grad():
        model(**PackedCollator()(first))
    actual_loss, actual_grads = loss_and_gradients(model, lambda m: m(**PackedCollator()(second)).loss)
    assert_loss_close(actual_loss, expected_loss)
    assert_gradients_close(actual_grads, expected_grads, rtol=1e-5)
