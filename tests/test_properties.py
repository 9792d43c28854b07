"""Invariances of the packed loss over generated packings (hypothesis).

Two properties every packing must keep, on both backends: permuting whole sequences inside a
pack leaves the loss unchanged (the gradient rows move with their tokens), and inserting a
sequence without targets anywhere changes nothing (its rows get a zero gradient). The examples
are derandomised: every run draws the same ones, so a failure is a bug, never bad luck.
"""

from __future__ import annotations

import pytest
import torch

import packed_ce

from loss_utils import CPU_BACKENDS as BACKENDS, assert_close

hypothesis = pytest.importorskip("hypothesis")  # the GPU image runs the cuda tests without it
st = hypothesis.strategies

V = 7
PROPERTY_SETTINGS = hypothesis.settings(max_examples=12, derandomize=True, deadline=None)


@st.composite
def packs(draw):
    """``(lengths, labels, logits)``: 1-6 sequences of 0-8 tokens, a fifth of labels ignored."""
    lengths = draw(st.lists(st.integers(0, 8), min_size=1, max_size=6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    labels = torch.randint(0, V, (n,), generator=gen)
    labels[torch.rand(n, generator=gen) < 0.2] = -100
    logits = torch.randn(n, V, generator=gen) * 3
    return lengths, labels, logits


def _loss_and_grad(logits, labels, lengths, backend, **options):
    cu_seqlens = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    x = logits.clone().requires_grad_()
    loss = packed_ce.cross_entropy(
        x, labels, cu_seqlens=cu_seqlens, is_packed=True, shift=True, backend=backend, **options
    )
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY_SETTINGS
@hypothesis.given(pack=packs(), order_seed=st.integers(0, 1000))
def test_permuting_sequences_changes_nothing(backend, pack, order_seed):
    lengths, labels, logits = pack
    loss, grad = _loss_and_grad(logits, labels, lengths, backend)
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(order_seed)).tolist()
    starts = torch.tensor([0] + lengths).cumsum(0).tolist()
    index = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in order])
    permuted_loss, permuted_grad = _loss_and_grad(
        logits[index], labels[index], [lengths[s] for s in order], backend
    )
    assert_close(permuted_loss, loss)
    assert_close(permuted_grad, grad[index])


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY_SETTINGS
@hypothesis.given(pack=packs(), at=st.integers(0, 6), length=st.integers(0, 5))
def test_a_sequence_without_targets_changes_nothing(backend, pack, at, length):
    lengths, labels, logits = pack
    at = min(at, len(lengths))
    loss, grad = _loss_and_grad(logits, labels, lengths, backend, label_smoothing=0.1)
    start = sum(lengths[:at])
    inserted = torch.randn(length, V, generator=torch.Generator().manual_seed(length))
    grown_logits = torch.cat([logits[:start], inserted, logits[start:]])
    grown_labels = torch.cat([labels[:start], torch.full((length,), -100), labels[start:]])
    grown_loss, grown_grad = _loss_and_grad(
        grown_logits, grown_labels, lengths[:at] + [length] + lengths[at:], backend,
        label_smoothing=0.1,
    )
    assert_close(grown_loss, loss)
    assert_close(torch.cat([grown_grad[:start], grown_grad[start + length :]]), grad)
    assert not grown_grad[start : start + length].any()


@st.composite
def invalid_calls(draw):
    """Keywords of a call whose values are anything the metadata checks let through: labels
    outside ``[0, V)``, ``cu_seqlens`` out of range and in any order, ``seq_targets`` below 1,
    ``seq_weights`` and a tensor ``num_items_in_batch`` negative or not finite."""
    n = draw(st.integers(1, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    big = 2**31 - 1
    labels = torch.tensor(draw(st.lists(st.integers(-big, big), min_size=n, max_size=n)))
    bounds = draw(st.lists(st.integers(-big, big), min_size=2, max_size=6))
    s = len(bounds) - 1
    odd = st.sampled_from([float("nan"), float("inf"), -float("inf"), -1.0, 0.0, 2.0])
    return dict(
        logits=torch.randn(n, V, generator=gen),
        labels=labels,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        seq_targets=torch.tensor(draw(st.lists(st.integers(-big, big), min_size=s, max_size=s))),
        seq_weights=torch.tensor(draw(st.lists(odd, min_size=s, max_size=s))),
        num_items_in_batch=torch.tensor(draw(odd)),
        reduction=draw(st.sampled_from(["mean", "sum", "none"])),
        shift=draw(st.booleans()),
    )


@pytest.mark.parametrize("backend", BACKENDS)
@PROPERTY_SETTINGS
@hypothesis.given(call=invalid_calls())
def test_unvalidated_invalid_values_are_memory_safe(backend, call):
    """validate=False promises memory safety only: any values run to a loss and a gradient of
    the right shapes without an error (no out-of-range index, no device assert, no hang)."""
    logits = call.pop("logits").requires_grad_()
    loss = packed_ce.cross_entropy(logits, is_packed=True, backend=backend, validate=False, **call)
    loss.sum().backward()
    assert loss.shape == (() if call["reduction"] != "none" else call["labels"].shape)
    assert logits.grad.shape == logits.shape
