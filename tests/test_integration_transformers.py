"""The packed loss inside transformers models, end to end, on CPU in float32.

A packed batch with ``is_packed=True`` must give the loss and every parameter gradient of the
same conversations trained unpacked with per-sequence averaging, whether unpacked means padded
(``PaddedCollator``) or one conversation per forward pass; ``is_packed=False`` must be
transformers' own loss. The grid is two model families that route their loss through
``self.loss_function`` (Llama, Qwen2) times the two attention implementations that build the
packed mask on CPU (sdpa, eager); Gemma 2 covers ``final_logit_softcapping``.
"""

from __future__ import annotations

import copy
import inspect
import io
import math
import os
import pickle

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

from collators import PackedCollator, PaddedCollator
from packed_ce.integrations import (
    PackedCausalLMLoss,
    apply_packed_loss,
    count_num_items,
    packed_loss_of,
    remove_packed_loss,
)

from integration_utils import (
    assert_gradients_close,
    assert_loss_close,
    corpus_conversations,
    has_target,
    loss_and_gradients,
    one_at_a_time,
    relative_error,
    synthetic_conversations,
    tiny_model,
)

MODELS = [
    pytest.param("llama", "sdpa", id="llama-sdpa"),
    pytest.param("llama", "eager", id="llama-eager"),
    pytest.param("qwen2", "sdpa", id="qwen2-sdpa"),
    pytest.param("qwen2", "eager", id="qwen2-eager"),
]


@pytest.fixture(scope="module")
def corpus():
    """Ten real conversations of the default corpus, short to long, multi-turn labels."""
    return corpus_conversations(10)


def model_loss(batch):
    return lambda model: model(**batch, use_cache=False).loss


@pytest.mark.parametrize("arch, attn", MODELS)
def test_packed_equals_padded_equals_one_at_a_time(corpus, arch, attn):
    vocab_size, conversations = corpus
    model = apply_packed_loss(tiny_model(arch, vocab_size, attn=attn), is_packed=True)

    packed_loss, packed_grads = loss_and_gradients(
        model, model_loss(PackedCollator()(conversations))
    )
    padded_loss, padded_grads = loss_and_gradients(
        model, model_loss(PaddedCollator()(conversations))
    )
    truth_loss, truth_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations))

    errors = {
        "packed loss": assert_loss_close(packed_loss, truth_loss),
        "padded loss": assert_loss_close(padded_loss, truth_loss),
        "packed grads": assert_gradients_close(packed_grads, truth_grads),
        "padded grads": assert_gradients_close(padded_grads, truth_grads),
    }
    print(f"{arch}/{attn}: loss {float(truth_loss):.6f}; worst relative errors {errors}")


def test_naive_token_mean_differs(corpus):
    """transformers' token mean over a packed row is a different loss, with other gradients."""
    vocab_size, conversations = corpus
    # a wider initialisation gives token losses that differ between conversations, as a model
    # in training has: at the usual 0.02 every token's loss is close to log V and any average
    # of them is nearly the same number
    model = tiny_model("llama", vocab_size, initializer_range=0.5)
    batch = PackedCollator()(conversations)
    naive_loss, naive_grads = loss_and_gradients(model, model_loss(batch))
    truth_loss, truth_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations))

    loss_error = relative_error(naive_loss, truth_loss)
    grad_errors = {
        name: relative_error(naive_grads[name], truth_grads[name]) for name in truth_grads
    }
    lengths = [sum(label != -100 for label in c["labels"]) for c in conversations if has_target(c)]
    print(
        f"targets per conversation {lengths}: the naive mean weighs them {max(lengths) / min(lengths):.0f}x "
        f"apart; loss {float(naive_loss):.4f} vs {float(truth_loss):.4f} (relative {loss_error:.2%}), "
        f"gradients off by {min(grad_errors.values()):.1%} to {max(grad_errors.values()):.1%}"
    )
    assert loss_error > 100 * 1e-5
    assert min(grad_errors.values()) > 100 * 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_unpacked_mode_is_transformers_loss(corpus, arch):
    """is_packed=False: transformers' ForCausalLMLoss in value, logits gradient and training."""
    vocab_size, conversations = corpus
    batch = PackedCollator()(conversations)
    theirs = tiny_model(arch, vocab_size)
    ours = apply_packed_loss(tiny_model(arch, vocab_size), is_packed=False)

    def logits_and_loss(model, **extra):
        out = model(**batch, **extra, use_cache=False)
        out.logits.retain_grad()
        out.loss.backward()
        return out

    for extra in ({}, {"num_items_in_batch": torch.tensor(500)}):  # the Trainer passes a count
        theirs.zero_grad(), ours.zero_grad()
        expected, actual = logits_and_loss(theirs, **extra), logits_and_loss(ours, **extra)
        assert_loss_close(actual.loss, expected.loss)
        assert relative_error(actual.logits.grad, expected.logits.grad) <= 1e-5

    # a few optimiser steps give the same parameters: compared through the updates (final minus
    # initial), which carry the gradients of every step, rather than through logits that an
    # in-place backward may have overwritten. Plain SGD passes gradient differences on as they
    # are; Adam's division by the running RMS would magnify round-off on tiny gradients.
    initial = {name: p.detach().clone() for name, p in theirs.named_parameters()}
    updates = []
    for model in (theirs, ours):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        for start in range(0, 8, 2):
            optimizer.zero_grad()
            model(
                **PackedCollator()(conversations[start : start + 3]), use_cache=False
            ).loss.backward()
            optimizer.step()
        updates.append({name: p.detach() - initial[name] for name, p in model.named_parameters()})
    assert_gradients_close(updates[1], updates[0])


def test_softcap_is_applied_once():
    """Gemma 2 caps its logits before the loss; the hook must not cap them again."""
    vocab_size = 96
    conversations = synthetic_conversations([12, 30, 7, 19], vocab_size)
    batch = PackedCollator()(conversations)
    theirs = tiny_model("gemma2", vocab_size, attn="eager")
    ours = apply_packed_loss(tiny_model("gemma2", vocab_size, attn="eager"), is_packed=False)
    assert_loss_close(ours(**batch).loss, theirs(**batch, use_cache=False).loss)

    apply_packed_loss(ours, is_packed=True)
    packed_loss, packed_grads = loss_and_gradients(ours, model_loss(batch))
    truth_loss, truth_grads = loss_and_gradients(ours, lambda m: one_at_a_time(m, conversations))
    assert_loss_close(packed_loss, truth_loss)
    assert_gradients_close(packed_grads, truth_grads)


@pytest.mark.parametrize(
    "arch, attn",
    [
        ("llama", "sdpa"),
        ("qwen2", "sdpa"),
        ("gemma2", "eager"),
    ],  # gemma2: softcap in the fused path
)
def test_fused_linear_forward(arch, attn):
    vocab_size = 96
    conversations = synthetic_conversations([12, 30, 7, 19, 1, 25], vocab_size)
    batch = PackedCollator()(conversations)
    model = apply_packed_loss(tiny_model(arch, vocab_size, attn=attn), is_packed=True)
    expected_loss, expected_grads = loss_and_gradients(model, model_loss(batch))
    signature = inspect.signature(model.forward)

    apply_packed_loss(model, is_packed=True, fused_linear=True)
    out = model(**batch, use_cache=False)
    assert out.logits is None  # the (N, V) logits never existed
    actual_loss, actual_grads = loss_and_gradients(model, model_loss(batch))
    assert_loss_close(actual_loss, expected_loss)
    assert_gradients_close(actual_grads, expected_grads, rtol=1e-5)
    # the Trainer reads the signature to keep data set columns and pass loss keywords
    assert inspect.signature(model.forward) == signature

    # a copy trains its own weights (the fused forward looks its modules up at call time)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.get_output_embeddings().weight.zero_()  # uniform logits: every token loss is log V
    assert_loss_close(twin(**batch, use_cache=False).loss, torch.tensor(math.log(vocab_size)))
    assert_loss_close(model(**batch, use_cache=False).loss, expected_loss)

    model.eval()  # evaluation keeps the model's own forward: logits and the packed loss
    with torch.no_grad():
        out = model(**batch, use_cache=False)
    assert out.logits.shape == (1, batch["input_ids"].shape[1], vocab_size)
    assert_loss_close(out.loss, expected_loss)


def test_fused_head_given_as_a_dtensor(one_rank_group):
    """The head's weight as FSDP2 may hand it over: a replicated ``DTensor`` gives the loss and
    every gradient of the plain weight (its gradient a ``DTensor`` too, for FSDP to reduce); a
    frozen sharded one the same loss; a trainable sharded one is refused, naming the fix."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    batch = PackedCollator()(synthetic_conversations([12, 30, 7, 19], 96))
    model = apply_packed_loss(tiny_model("llama", 96), fused_linear=True)
    expected_loss, expected_grads = loss_and_gradients(model, model_loss(batch))
    head = model.get_output_embeddings()
    plain = head.weight.detach().clone()

    head.weight = torch.nn.Parameter(distribute_tensor(plain, one_rank_group, [Replicate()]))
    actual_loss, actual_grads = loss_and_gradients(model, model_loss(batch))
    assert_loss_close(actual_loss, expected_loss)
    actual_grads["lm_head.weight"] = actual_grads["lm_head.weight"].to_local()
    assert_gradients_close(actual_grads, expected_grads, rtol=1e-6)

    sharded = distribute_tensor(plain, one_rank_group, [Shard(0)])
    head.weight = torch.nn.Parameter(sharded, requires_grad=False)
    assert_loss_close(model(**batch, use_cache=False).loss, expected_loss)
    head.weight = torch.nn.Parameter(sharded)
    with pytest.raises(ValueError, match="still sharded .* fused_linear=False"):
        model(**batch, use_cache=False)


def test_remove_restores_the_model_exactly():
    model = tiny_model("llama", 64)
    cls_forward, hooks = type(model).forward, dict(model._forward_pre_hooks)
    for fused in (False, True):
        apply_packed_loss(model, fused_linear=fused, label_smoothing=0.1)
        apply_packed_loss(model, fused_linear=fused)  # a second call replaces the first
        assert isinstance(model.loss_function, PackedCausalLMLoss)
        assert packed_loss_of(model).options.label_smoothing == 0.0
        # the installed forward checks every call, fused or not
        assert ("forward" in model.__dict__) and (model._packed_ce.fused_options is not None) == fused
        remove_packed_loss(model)
        assert model.loss_function is ForCausalLMLoss
        assert "_loss_function" not in model.__dict__ and "forward" not in model.__dict__
        assert model.forward.__func__ is cls_forward
        assert dict(model._forward_pre_hooks) == hooks
        assert not model.get_decoder()._forward_pre_hooks
        assert packed_loss_of(model) is None
    with pytest.raises(ValueError, match="not installed"):
        remove_packed_loss(model)

    # a loss function set before is put back
    def custom(*args, **kwargs):
        return torch.zeros(())

    model.loss_function = custom
    remove_packed_loss(apply_packed_loss(model))
    assert model.loss_function is custom


def pickled(model):
    return pickle.loads(pickle.dumps(model))


def saved(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("duplicate", [copy.deepcopy, pickled, saved], ids=["deepcopy", "pickle", "torch.save"])
def test_a_copy_of_a_patched_model_has_the_packed_loss(fused, duplicate):
    """EMA and reference models are copies: a copy of a patched model gives the packed loss and
    gradients of the original, trains its own weights, and ``remove_packed_loss`` gives it back
    transformers' own loss."""
    batch = PackedCollator()(synthetic_conversations([12, 30, 7, 19], 96))
    model = tiny_model("llama", 96)
    plain_loss = model(**batch, use_cache=False).loss  # transformers' token mean over the row
    apply_packed_loss(model, fused_linear=fused)
    expected_loss, expected_grads = loss_and_gradients(model, model_loss(batch))
    twin = duplicate(model)
    assert twin._packed_ce.forward.model is twin and twin.forward is twin._packed_ce.forward
    actual_loss, actual_grads = loss_and_gradients(twin, model_loss(batch))
    assert_loss_close(actual_loss, expected_loss)
    assert_gradients_close(actual_grads, expected_grads, rtol=1e-6)
    with torch.no_grad():
        twin.get_output_embeddings().weight.zero_()  # uniform logits: every token loss is log V
    assert_loss_close(twin(**batch).loss, torch.tensor(math.log(96)))
    assert_loss_close(model(**batch).loss, expected_loss)
    remove_packed_loss(twin)
    assert "forward" not in twin.__dict__ and packed_loss_of(twin) is None
    remove_packed_loss(model)
    assert_loss_close(model(**batch, use_cache=False).loss, plain_loss)


def test_unknown_option_and_unfusable_head():
    model = tiny_model("llama", 64)
    with pytest.raises(TypeError):
        apply_packed_loss(model, reduction="sum")
    model.config.logit_scale = 0.5
    with pytest.raises(ValueError, match="logit_scale"):
        apply_packed_loss(model, fused_linear=True)
    assert packed_loss_of(model) is None
    gemma = tiny_model("gemma2", 64, attn="eager")
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        apply_packed_loss(gemma, inplace_backward=True)


def test_boundaries_from_every_batch_format():
    """cu_seqlens, flash-attention varlen keywords, position_ids alone: the same loss."""
    vocab_size = 96
    conversations = synthetic_conversations([12, 30, 7, 19, 1, 25], vocab_size)
    full = PackedCollator()(conversations)
    model = apply_packed_loss(tiny_model("llama", vocab_size), is_packed=True)
    truth = one_at_a_time(model, conversations)
    formats = {
        "PackedCollator": full,
        "varlen keywords": {
            k: full[k]
            for k in (
                "input_ids",
                "labels",
                "position_ids",
                "cu_seq_lens_q",
                "cu_seq_lens_k",
                "max_length_q",
                "max_length_k",
            )
        },
        "position_ids only": {k: full[k] for k in ("input_ids", "labels", "position_ids")},
    }
    for name, batch in formats.items():
        assert_loss_close(model(**batch, use_cache=False).loss, truth), name

    # a padded batch without cu_seqlens: every row is one conversation
    padded = PaddedCollator()(conversations)
    del padded["cu_seqlens"]
    assert_loss_close(model(**padded, use_cache=False).loss, truth)


def test_count_num_items():
    conversations = [
        {"input_ids": [1, 2, 3], "labels": [-100, 2, 3]},  # 2 targets
        {"input_ids": [4, 5], "labels": [-100, -100]},  # no target
        {"input_ids": [6, 7, 8, 9], "labels": [-100, -100, 8, -100]},  # 1 target
    ]
    packed, padded = PackedCollator()(conversations), PaddedCollator()(conversations)
    for batch in (packed, padded):
        assert int(count_num_items(batch)) == 2 == batch["num_sequences"]
        assert int(count_num_items(batch, is_packed=False)) == 3
    assert int(count_num_items([packed, padded, packed])) == 6
    # already shifted labels (a padding-free collator's shift_labels) are counted as they are
    shifted = {
        "shift_labels": torch.tensor([[2, 3, -100, -100, -100, -100, 8, -100, -100]]),
        "cu_seqlens": packed["cu_seqlens"],
    }
    assert int(count_num_items(shifted)) == 2


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("inplace_backward", [False, True])
def test_triton_backend_through_the_interpreter(inplace_backward):
    """The kernel inside a model; in place, the logits' storage takes their gradient safely."""
    vocab_size = 64
    conversations = synthetic_conversations([9, 14, 5], vocab_size)
    batch = PackedCollator()(conversations)
    model = apply_packed_loss(tiny_model("llama", vocab_size), is_packed=True, backend="torch")
    expected_loss, expected_grads = loss_and_gradients(model, model_loss(batch))
    apply_packed_loss(model, is_packed=True, backend="triton", inplace_backward=inplace_backward)
    actual_loss, actual_grads = loss_and_gradients(model, model_loss(batch))
    assert_loss_close(actual_loss, expected_loss)
    assert_gradients_close(actual_grads, expected_grads)


def test_a_family_that_never_calls_its_loss_function_is_refused():
    """BART-style causal LMs compute their own token mean and never call ``self.loss_function``:
    with labels, even on an unpacked batch, the packed forward raises naming the family instead of
    returning a loss apply_packed_loss did not make."""
    from packed_ce.integrations import tiny_causal_lm

    model = apply_packed_loss(tiny_causal_lm(96, model_type="bart", attn_implementation="eager"))
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="model_type='bart'.* without calling its loss_function"):
        model(input_ids=ids, labels=ids, use_cache=False)
    assert model(input_ids=ids, use_cache=False).logits.shape == (2, 9, 96)  # without labels: its logits
