"""Conversations split across rows and per-conversation weights: every target trained once, each conversation
weighing exactly its weight, checked on exact small rows, random data and a loss with gradients."""

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")  # not on every GPU image
from collator_reference import IGNORE, conversation_mean_loss, lookup_table, packed_weighted_sum
from datasets import Dataset
from hypothesis import given, settings
from hypothesis import strategies as st

from collators import PackedCollator, PackingStats, pack_dataset, pack_stream


def test_split_small():
    """A 10-token conversation in rows of 4: pieces start every 3 tokens, each repeating the token at the cut."""
    dataset = Dataset.from_dict(
        {
            "input_ids": [list(range(10, 20)), [30, 31]],
            # A user turn (10-12), then an assistant turn (13-19): the first cut (after 13) is inside the answer.
            "labels": [[IGNORE] * 3 + list(range(13, 20)), [IGNORE, 31]],
            "weight": [2.0, 0.5],
        }
    )
    packed, stats = pack_dataset(dataset, 4, overflow="split", return_stats=True)
    assert packed[:] == {
        "input_ids": [[10, 11, 12, 13], [13, 14, 15, 16], [16, 17, 18, 19], [30, 31]],
        "labels": [[IGNORE, IGNORE, IGNORE, 13], [IGNORE, 14, 15, 16], [IGNORE, 17, 18, 19], [IGNORE, 31]],
        "seq_lengths": [[4], [4], [4], [2]],
        "seq_targets": [[7], [7], [7], [1]],
        "seq_weights": [[2.0], [2.0], [2.0], [0.5]],
    }
    assert (stats.num_split, stats.num_split_pieces, stats.num_packed, stats.num_truncated) == (1, 3, 2, 0)
    assert stats.num_tokens == 14 and stats.num_rows == 4
    # The last piece shares a row with the short conversation.
    assert pack_dataset(dataset, 5, overflow="split")[:]["seq_lengths"] == [[5], [5], [2, 2]]
    batch = PackedCollator()(packed.select([1, 3]))
    assert batch["seq_targets"].tolist() == [7, 1] and batch["seq_weights"].tolist() == [2.0, 0.5]
    assert batch["labels"].tolist() == [[IGNORE, 14, 15, 16, IGNORE, 31]]


def test_split_needs_two_tokens_per_row():
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3]], "labels": [[1, 2, 3]]})
    with pytest.raises(ValueError, match=r"`max_length` must be an int >= 2"):
        pack_dataset(dataset, 1, overflow="split")
    # Without splitting one token per row is a valid (if useless) capacity.
    assert pack_dataset(dataset, 1)[:]["input_ids"] == [[1]]


def random_conversations(rng, num, max_tokens, vocab, weights=False):
    rows = {"input_ids": [], "labels": []}
    for _ in range(num):
        n = int(rng.integers(1, max_tokens + 1))
        ids = rng.integers(0, vocab, n).tolist()
        trained = rng.random(n) < rng.choice([0.0, 0.3, 0.8])
        rows["input_ids"].append(ids)
        rows["labels"].append([t if keep else IGNORE for t, keep in zip(ids, trained)])
    if weights:
        rows["weight"] = rng.choice([0.0, 0.5, 1.0, 3.0], num).tolist()
    return rows


def pieces_of(rows):
    """(seq_targets, tokens, labels) of every sequence of packed rows."""
    pieces = []
    for row in rows:
        start = 0
        for s, n in enumerate(row["seq_lengths"]):
            pieces.append(
                (row["seq_targets"][s], row["input_ids"][start : start + n], row["labels"][start : start + n])
            )
            start += n
    return pieces


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(2, 12), st.sampled_from(["dataset", "stream"]))
def test_split_trains_every_target_once(seed, max_length, packer):
    """Rebuilt from its pieces, each conversation is whole; its targets under the shift are each trained once."""
    rng = np.random.default_rng(seed)
    rows = random_conversations(rng, 12, 40, 10)
    # Globally unique tokens, so that the first token of a piece tells its conversation and offset.
    where, next_token = {}, 0
    for c, ids in enumerate(rows["input_ids"]):
        unique = list(range(next_token, next_token + len(ids)))
        rows["input_ids"][c] = unique
        rows["labels"][c] = [IGNORE if label == IGNORE else t for t, label in zip(unique, rows["labels"][c])]
        where.update({t: (c, i) for i, t in enumerate(unique)})
        next_token += len(ids)
    stats = PackingStats(max_length=max_length)
    if packer == "dataset":
        packed, stats = pack_dataset(Dataset.from_dict(rows), max_length, overflow="split", return_stats=True)
        packed = list(packed)
    else:
        stream = iter(Dataset.from_dict(rows))
        packed = list(pack_stream(stream, max_length, overflow="split", buffer_size=5, stats=stats))
    assert all(len(row["input_ids"]) <= max_length for row in packed)
    by_conversation = {}
    for seq_targets, tokens, labels in pieces_of(packed):
        c, offset = where[tokens[0]]
        by_conversation.setdefault(c, []).append((offset, seq_targets, tokens, labels))
    assert sorted(by_conversation) == list(range(12))
    for c, (ids, labels) in enumerate(zip(rows["input_ids"], rows["labels"])):
        pieces = sorted(by_conversation[c])
        # Piece k starts at k (M - 1), on the last token of piece k - 1, and holds the tokens that follow.
        assert [offset for offset, *_ in pieces] == [k * (max_length - 1) for k in range(len(pieces))]
        assert all(tokens == ids[offset : offset + len(tokens)] for offset, _, tokens, _ in pieces)
        assert pieces[-1][0] + len(pieces[-1][2]) == len(ids)
        # The first label of a piece after the first is ignored; the labels after each piece's first token,
        # joined, are the conversation's labels after its first token: every target once, none lost.
        assert all(piece_labels[0] == IGNORE for offset, _, _, piece_labels in pieces if offset)
        assert [label for *_, piece_labels in pieces for label in piece_labels[1:]] == labels[1:]
        whole = sum(t != IGNORE for t in labels[1:])
        assert {seq_targets for _, seq_targets, _, _ in pieces} == {max(whole, 1)}
    too_long = sum(len(ids) > max_length for ids in rows["input_ids"])
    assert stats.num_split == too_long and stats.num_packed == 12
    assert stats.num_split_pieces == sum(len(p) for p in by_conversation.values() if len(p) > 1)
    assert stats.num_tokens == sum(len(row["input_ids"]) for row in packed)


@pytest.mark.parametrize("weights", [False, True], ids=["unweighted", "weighted"])
def test_split_packed_loss_is_the_mean_over_whole_conversations(weights):
    """Over all batches, the weighted packed loss is the (weighted) mean over conversations of each unsplit
    conversation's mean token loss, value and gradient."""
    rng = np.random.default_rng(7)
    vocab, max_length = 50, 16
    rows = random_conversations(rng, 40, 60, vocab, weights=weights)  # most longer than a row
    packed = pack_dataset(Dataset.from_dict(rows), max_length, overflow="split")
    assert max(len(ids) for ids in rows["input_ids"]) > 3 * max_length

    table = lookup_table(vocab)
    total = mass = 0.0
    collator = PackedCollator(pad_to_multiple_of=8)
    for start in range(0, packed.num_rows, 3):
        batch = collator(packed.select(range(start, min(start + 3, packed.num_rows))))
        part_sum, part_mass = packed_weighted_sum(table, batch)
        total, mass = total + part_sum, mass + part_mass
    loss = total / mass
    (grad,) = torch.autograd.grad(loss, table)

    means, conversation_weights = [], []
    for c, (ids, labels) in enumerate(zip(rows["input_ids"], rows["labels"])):
        mean = conversation_mean_loss(table, ids, labels)
        if mean is not None:
            means.append(mean)
            conversation_weights.append(rows["weight"][c] if weights else 1.0)
    conversation_weights = torch.tensor(conversation_weights, dtype=torch.float64)
    expected = (torch.stack(means) * conversation_weights).sum() / conversation_weights.sum()
    (expected_grad,) = torch.autograd.grad(expected, table)
    # Each conversation with a target weighs exactly its weight, however it was cut.
    torch.testing.assert_close(mass, conversation_weights.sum(), rtol=1e-12, atol=0)
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-14)
    # The check has teeth: weighing each piece as a conversation of its own gives another loss.
    naive = PackedCollator()([{k: v for k, v in row.items() if k != "seq_targets"} for row in packed])
    naive_sum, naive_mass = packed_weighted_sum(table, naive)
    assert abs(float((naive_sum / naive_mass).detach()) - float(expected.detach())) > 1e-3


def test_weights_uniform_change_nothing_and_zero_removes_a_conversation():
    rng = np.random.default_rng(3)
    rows = random_conversations(rng, 6, 20, 30)
    rows["labels"] = [[t for t in ids] for ids in rows["input_ids"]]  # every conversation has targets
    table = lookup_table(30)

    def packed_loss(dataset):
        total, mass = packed_weighted_sum(table, PackedCollator()(list(pack_dataset(dataset, 8, overflow="split"))))
        return total / mass

    def loss_of(weight_column):
        data = dict(rows) if weight_column is None else dict(rows, weight=weight_column)
        return packed_loss(Dataset.from_dict(data))

    plain = loss_of(None)
    torch.testing.assert_close(loss_of([2.5] * 6), plain, rtol=1e-14, atol=0)
    without_first = Dataset.from_dict({k: v[1:] for k, v in rows.items()})
    torch.testing.assert_close(loss_of([0.0] + [1.0] * 5), packed_loss(without_first), rtol=1e-14, atol=0)
