"""PackedCollator and PaddedCollator: exact small batches, equivalence, DataLoader workers, a real model."""

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
datasets = pytest.importorskip("datasets")  # not on every GPU image
from collator_reference import IGNORE  # also derandomises hypothesis when CI is set
from loss_utils import per_sequence_loss
from datasets import Dataset
from torch.utils.data import DataLoader

from collators import PackedCollator, PaddedCollator, pack_dataset


# Three conversations: the third has no target, so it counts as a sequence in cu_seqlens but not in
# num_sequences; the second has its only prompt token first.
EXAMPLES = [
    {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]},
    {"input_ids": [8, 9, 10, 11], "labels": [8, 9, 10, 11]},
    {"input_ids": [12, 13], "labels": [IGNORE, IGNORE]},
]


def test_packed_from_examples():
    batch = PackedCollator()(EXAMPLES)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13]]
    # First label of every sequence -100: 8 was a target of nothing (no token before it in its sequence).
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, 9, 10, 11, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 9]
    assert batch["max_seqlen"] == 4
    assert batch["num_sequences"] == 2
    assert batch["cu_seq_lens_q"].tolist() == batch["cu_seq_lens_k"].tolist() == [0, 3, 7, 9]
    assert batch["max_length_q"] == batch["max_length_k"] == 4
    assert "attention_mask" not in batch
    for key in ("input_ids", "labels", "position_ids"):
        assert batch[key].dtype == torch.int64 and batch[key].shape == (1, 9)
    assert batch["cu_seqlens"].dtype == torch.int32
    assert isinstance(batch["max_seqlen"], int) and isinstance(batch["num_sequences"], int)


def test_packed_from_prepacked_rows():
    rows = [
        {"input_ids": [5, 6, 7, 12, 13], "labels": [IGNORE, 6, 7, IGNORE, IGNORE], "seq_lengths": [3, 2]},
        {"input_ids": [8, 9, 10, 11], "labels": [8, 9, 10, 11], "seq_lengths": [4]},
    ]
    batch = PackedCollator()(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 12, 13, 8, 9, 10, 11]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, IGNORE, IGNORE, 9, 10, 11]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 5, 9]
    assert (batch["max_seqlen"], batch["num_sequences"]) == (4, 2)


def test_packed_pad_to_multiple_of():
    batch = PackedCollator(pad_to_multiple_of=4, pad_token_id=0)(EXAMPLES)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 0, 0, 0]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, 9, 10, 11, IGNORE, IGNORE, IGNORE, IGNORE, IGNORE]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 1, 0, 1, 2]]
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 9, 12]
    assert (batch["max_seqlen"], batch["num_sequences"]) == (4, 2)
    # Already a multiple: no padding segment.
    assert PackedCollator(pad_to_multiple_of=9)(EXAMPLES)["cu_seqlens"].tolist() == [0, 3, 7, 9]


def test_sources_follow_their_sequences():
    """`source` per conversation and `seq_sources` per piece of a packed row land on their
    sequences of `cu_seqlens`; padding and empty sequences have none."""
    sourced = [{**e, "source": s} for e, s in zip(EXAMPLES, ["chat", "code", "chat"])]
    batch = PackedCollator(pad_to_multiple_of=4)(sourced)
    assert batch["cu_seqlens"].tolist() == [0, 3, 7, 9, 12]
    assert batch["seq_sources"] == ["chat", "code", "chat", None]
    assert "seq_sources" not in PackedCollator()(EXAMPLES)
    rows = [
        {"input_ids": [5, 6, 7, 12, 13], "labels": [IGNORE, 6, 7, IGNORE, IGNORE], "seq_lengths": [3, 0, 2],
         "seq_sources": ["a", "b", "c"]},
        {"input_ids": [8, 9], "labels": [8, 9]},  # no source: None
    ]
    assert PackedCollator()(rows)["seq_sources"] == ["a", "c", None]
    assert PaddedCollator()(sourced)["seq_sources"] == ["chat", "code", "chat"]
    with pytest.raises(ValueError, match=r"examples\[0\].*seq_sources"):
        PackedCollator()([{**rows[0], "seq_sources": ["a"]}])
    with pytest.raises(ValueError, match="packed row"):
        PackedCollator()([{**rows[0], "seq_sources": None, "source": "a"}])
    with pytest.raises(TypeError, match="strings"):
        PackedCollator()([{**EXAMPLES[0], "source": 3}])
    # pack_dataset carries the column to every piece of a split conversation
    data = Dataset.from_dict({"input_ids": [[1, 2, 3, 4, 5, 6, 7], [8, 9]], "labels": [[1, 2, 3, 4, 5, 6, 7], [8, 9]],
                              "source": ["long", "short"]})
    packed = pack_dataset(data, max_length=4, overflow="split")
    assert packed["seq_sources"] == [["long"], ["long"], ["short"]]
    with pytest.raises(TypeError, match="'source'"):
        pack_dataset(Dataset.from_dict({**data.to_dict(), "source": [1, 2]}), max_length=4)


def test_packed_options_and_inputs():
    plain = PackedCollator(return_varlen_kwargs=False)(EXAMPLES)
    assert set(plain) == {
        "input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen", "num_sequences", "seq_targets"
    }
    # Missing labels train every token; tensors and arrays are accepted like lists.
    no_labels = PackedCollator()([{"input_ids": torch.tensor([1, 2])}, {"input_ids": [3, 4, 5]}])
    assert no_labels["labels"].tolist() == [[IGNORE, 2, IGNORE, 4, 5]]
    # Empty sequences carry no boundary.
    with_empty = PackedCollator()([{"input_ids": [1, 2], "labels": [1, 2], "seq_lengths": [0, 2]}])
    assert with_empty["cu_seqlens"].tolist() == [0, 2]
    with pytest.raises(ValueError, match=r"`examples\[0\]`"):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1]}])
    with pytest.raises(ValueError, match=r"`examples\[0\]`"):
        PackedCollator()([{"input_ids": [1, 2], "labels": [1, 2], "seq_lengths": [3]}])
    with pytest.raises(ValueError, match="`examples` holds no token"):
        PackedCollator()([{"input_ids": [], "labels": []}])


def test_padded():
    batch = PaddedCollator(pad_token_id=0, pad_to_multiple_of=5)(EXAMPLES)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0, 0], [8, 9, 10, 11, 0], [12, 13, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 0]]
    assert batch["labels"].tolist() == [
        [IGNORE, 6, 7, IGNORE, IGNORE],
        [IGNORE, 9, 10, 11, IGNORE],
        [IGNORE, IGNORE, IGNORE, IGNORE, IGNORE],
    ]
    assert batch["cu_seqlens"].tolist() == [0, 5, 10, 15] and batch["cu_seqlens"].dtype == torch.int32
    assert batch["num_sequences"] == 2
    with pytest.raises(ValueError, match="packed row"):
        PaddedCollator()([{"input_ids": [1, 2], "labels": [1, 2], "seq_lengths": [1, 1]}])


sequences = st.lists(
    st.lists(st.tuples(st.integers(0, 50), st.booleans()), min_size=0, max_size=9), min_size=1, max_size=6
).filter(lambda seqs: any(seqs))


@settings(max_examples=150, deadline=None)
@given(sequences, st.sampled_from([None, 1, 4, 8]))
def test_packed_properties(seqs, multiple):
    examples = [{"input_ids": [t for t, _ in s], "labels": [t if keep else IGNORE for t, keep in s]} for s in seqs]
    batch = PackedCollator(pad_to_multiple_of=multiple)(examples)
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    positions = batch["position_ids"][0].tolist()
    real = [e for e in examples if e["input_ids"]]
    flat_ids = [t for e in real for t in e["input_ids"]]
    assert ids[: len(flat_ids)] == flat_ids and len(ids) % (multiple or 1) == 0
    # Boundaries from position_ids by transformers' rule agree with cu_seqlens.
    starts = [t for t in range(len(positions)) if t == 0 or positions[t] != positions[t - 1] + 1]
    assert batch["cu_seqlens"].tolist() == starts + [len(ids)]
    bounds = batch["cu_seqlens"].tolist()
    assert batch["max_seqlen"] == max(b - a for a, b in zip(bounds, bounds[1:]))
    # Labels: as given, except the first of every sequence; padding has none.
    expected = []
    for e in real:
        expected += [IGNORE] + e["labels"][1:]
    assert labels == expected + [IGNORE] * (len(ids) - len(flat_ids))
    assert batch["num_sequences"] == sum(any(t != IGNORE for t in e["labels"][1:]) for e in real)


def per_sequence_mean_loss(logits, labels, cu_seqlens):
    """The suite's reference (:func:`loss_utils.per_sequence_loss`) under the shift, and the number of
    sequences with a target."""
    logits, labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    bounds = cu_seqlens.tolist()
    slices = list(zip(bounds[:-1], bounds[1:]))
    count = sum(bool((labels[start + 1 : end] != IGNORE).any()) for start, end in slices)
    return per_sequence_loss(logits, labels, slices, is_packed=True, shift=True), count


def test_packed_and_padded_hold_the_same_targets():
    """Per sequence, both batches give the same (prediction, target) pairs, so the same per-sequence loss."""
    torch.manual_seed(0)
    embedding = torch.randn(16, 16, dtype=torch.float64)  # logits depend on the token only
    packed, padded = PackedCollator()(EXAMPLES), PaddedCollator()(EXAMPLES)
    packed_loss, packed_count = per_sequence_mean_loss(
        embedding[packed["input_ids"]], packed["labels"], packed["cu_seqlens"]
    )
    padded_loss, padded_count = per_sequence_mean_loss(
        embedding[padded["input_ids"]], padded["labels"], padded["cu_seqlens"]
    )
    torch.testing.assert_close(packed_loss, padded_loss)
    assert packed_count == packed["num_sequences"] == padded_count == padded["num_sequences"] == 2


def test_packed_ce_loss_is_the_same_for_packed_and_padded_batches():
    """The contract's one call, `cross_entropy(..., is_packed=True, shift=True)`, on both batch layouts."""
    packed_ce = pytest.importorskip("packed_ce")
    torch.manual_seed(0)
    embedding = torch.randn(16, 16, dtype=torch.float64)
    packed, padded = PackedCollator()(EXAMPLES), PaddedCollator()(EXAMPLES)
    reference, _ = per_sequence_mean_loss(embedding[packed["input_ids"]], packed["labels"], packed["cu_seqlens"])
    for batch, boundaries in (
        (packed, {"cu_seqlens": packed["cu_seqlens"]}),
        (packed, {"position_ids": packed["position_ids"]}),
        (padded, {"cu_seqlens": padded["cu_seqlens"]}),
    ):
        logits = embedding[batch["input_ids"]].float()
        loss = packed_ce.cross_entropy(
            logits, batch["labels"], is_packed=True, shift=True, backend="torch", **boundaries
        )
        torch.testing.assert_close(loss.double(), reference, atol=1e-5, rtol=1e-5)


def test_pickle_round_trip():
    for collator in (PackedCollator(pad_to_multiple_of=8, pad_token_id=3), PaddedCollator(pad_token_id=3)):
        clone = pickle.loads(pickle.dumps(collator))
        assert repr(clone) == repr(collator)
        expected, got = collator(EXAMPLES), clone(EXAMPLES)
        assert expected.keys() == got.keys()
        for key in expected:
            assert torch.equal(torch.as_tensor(expected[key]), torch.as_tensor(got[key]))


def _batches(loader):
    return [{k: v.tolist() if torch.is_tensor(v) else v for k, v in batch.items()} for batch in loader]


@pytest.mark.parametrize(
    "collator", [PackedCollator(pad_to_multiple_of=16), PaddedCollator()], ids=["packed", "padded"]
)
def test_dataloader_workers_match_single_process(collator):
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 40, (64,), generator=generator).tolist()
    rows = {"input_ids": [], "labels": []}
    for i, n in enumerate(lengths):
        rows["input_ids"].append([(i * 7 + j) % 97 for j in range(n)])
        rows["labels"].append([IGNORE] * (n // 2) + [(i * 7 + j) % 97 for j in range(n // 2, n)])
    dataset = Dataset.from_dict(rows)
    if isinstance(collator, PackedCollator):
        dataset = pack_dataset(dataset, 64)
    single = _batches(DataLoader(dataset, batch_size=3, collate_fn=collator, num_workers=0))
    workers = _batches(DataLoader(dataset, batch_size=3, collate_fn=collator, num_workers=2))
    assert single == workers and len(single) > 2


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
def test_causal_lm_sees_each_packed_sequence_alone(attn_implementation):
    """model(**batch) on a packed row gives, for every sequence, the logits of that sequence run alone."""
    pytest.importorskip("transformers")
    from packed_ce.integrations import tiny_causal_lm

    model = tiny_causal_lm(64, attn_implementation=attn_implementation).eval()
    examples = [
        {"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (7, 3, 12, 1, 5)
    ]
    batch = PackedCollator(pad_to_multiple_of=8)(examples)
    with torch.no_grad():
        # Every key of the batch goes in: the extra ones travel through **kwargs.
        packed = model(**batch, use_cache=False)
        bounds = batch["cu_seqlens"].tolist()
        for start, end in zip(bounds[:-1], bounds[1:]):
            alone = model(input_ids=batch["input_ids"][:, start:end], use_cache=False).logits
            torch.testing.assert_close(packed.logits[:, start:end], alone, atol=1e-5, rtol=1e-5)
        # Without position_ids the row is one long sequence: a different result, so the check above has teeth.
        unpacked = model(input_ids=batch["input_ids"], use_cache=False).logits
        assert not torch.allclose(unpacked, packed.logits, atol=1e-3)
    assert torch.isfinite(packed.loss)
