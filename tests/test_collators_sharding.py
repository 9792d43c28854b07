"""shard_batch: each rank's weighted "sum" loss adds up to the whole batch's, value and gradients, for 1, 2 and
3 ranks in one process and 2 gloo processes, with cuts in the middle of a conversation, at a turn boundary and
at a sequence boundary."""

import os

import pytest
import torch
import torch.nn.functional as F
from collator_reference import IGNORE, lookup_table, packed_weighted_sum

from collators import PackedCollator, shard_batch

VOCAB = 40

# Three conversations in 16 tokens. With 2 ranks (4 chunks of 4 tokens) the cuts fall at 4, inside the first
# conversation between its user turn (0-3) and its answer (4-5): the target of token 3 is the first answer
# token, across the cut; at 8, in the middle of the second conversation's answer; at 12, where the third
# conversation starts (a sequence boundary).
EXAMPLES = [
    {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [IGNORE] * 4 + [5, 6], "weight": 1.0},
    {"input_ids": [7, 8, 9, 10, 11, 12], "labels": [IGNORE, IGNORE, 9, 10, 11, 12], "weight": 2.5},
    {"input_ids": [13, 14, 15, 16], "labels": [IGNORE, 14, 15, 16], "weight": 0.5},
]


def test_two_ranks_exact():
    batch = PackedCollator()(EXAMPLES)
    rank0, rank1 = shard_batch(batch, 0, 2), shard_batch(batch, 1, 2)
    # Attention work per chunk (sum of positions + 1): 10, 14, 18, 10. Largest first to the least loaded rank:
    # rank 0 gets chunks 2 and 3 (tokens 8-15, work 28), rank 1 chunks 0 and 1 (tokens 0-7, work 24); the
    # zig-zag (chunks 0 and 3 against 1 and 2) would be 20 against 32.
    assert rank0["input_ids"].tolist() == [[9, 10, 11, 12, 13, 14, 15, 16]]
    assert rank0["labels"].tolist() == batch["labels"][:, 8:].tolist()
    assert rank0["position_ids"].tolist() == [[2, 3, 4, 5, 0, 1, 2, 3]]
    assert rank0["shift_labels"].tolist() == [[10, 11, 12, IGNORE, 14, 15, 16, IGNORE]]
    assert rank0["cu_seqlens"].tolist() == [0, 4, 8] and rank0["cu_seqlens"].dtype == torch.int32
    assert rank0["seq_targets"].tolist() == [4, 3] and rank0["seq_targets"].dtype == torch.int32
    assert rank0["seq_weights"].tolist() == [2.5, 0.5] and rank0["seq_weights"].dtype == torch.float64
    assert rank1["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]
    assert rank1["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1]]
    assert rank1["shift_labels"].tolist() == [[IGNORE, IGNORE, IGNORE, 5, 6, IGNORE, IGNORE, 9]]
    assert rank1["cu_seqlens"].tolist() == [0, 4, 6, 8]
    assert rank1["seq_targets"].tolist() == [2, 2, 4]
    assert rank1["seq_weights"].tolist() == [1.0, 1.0, 2.5]
    assert set(rank0) == {
        "input_ids", "labels", "position_ids", "shift_labels", "cu_seqlens", "seq_targets", "seq_weights",
        "context_parallel_shard",
    }
    # each shard records what it is: the model's forward refuses one cut for another rank or row
    record = rank1["context_parallel_shard"]
    assert (record.rank, record.world_size, record.row_length, record.chunks) == (1, 2, 16, ((2, 3), (0, 1)))
    assert record.row_checksum == rank0["context_parallel_shard"].row_checksum
    other = PackedCollator()([EXAMPLES[1], EXAMPLES[0], EXAMPLES[2]])
    assert shard_batch(other, 1, 2)["context_parallel_shard"].row_checksum != record.row_checksum


def local_weighted_sum(table, shard, logits=None):
    """A rank's `sum_t w_t l_t` with `shift=False`: the target of local token t is `shift_labels[t]`."""
    logits = table[shard["input_ids"][0]] if logits is None else logits
    losses = F.cross_entropy(logits, shard["shift_labels"][0], ignore_index=IGNORE, reduction="none")
    segment = torch.repeat_interleave(torch.arange(len(shard["seq_targets"])), shard["cu_seqlens"].diff().long())
    weights = shard.get("seq_weights", torch.ones(len(shard["seq_targets"]))).double() / shard["seq_targets"].double()
    return (weights[segment] * losses).sum()


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_add_up_to_the_whole_batch(world_size, weighted):
    examples = EXAMPLES if weighted else [{k: v for k, v in e.items() if k != "weight"} for e in EXAMPLES]
    # A second split conversation's piece: its seq_targets count the whole conversation.
    examples = examples + [
        dict({"input_ids": [20, 21, 22, 23, 24], "labels": [IGNORE, 21, IGNORE, 23, 24], "seq_lengths": [5],
              "seq_targets": [9]}, **({"seq_weights": [3.0]} if weighted else {}))
    ]
    batch = PackedCollator(pad_to_multiple_of=2 * world_size)(examples)
    table = lookup_table(VOCAB)
    # The whole batch, by the per-sequence loop of the reference, with the logits as a leaf.
    logits = table[batch["input_ids"][0]].detach().requires_grad_()
    whole, _ = packed_weighted_sum(table, batch, logits)
    whole.backward()

    shards = [shard_batch(batch, rank, world_size) for rank in range(world_size)]
    # Every token on exactly one rank.
    tokens = sorted(t for shard in shards for t in shard["input_ids"][0].tolist())
    assert tokens == sorted(batch["input_ids"][0].tolist())
    total = 0.0
    chunks = shards[0]["context_parallel_shard"].chunks
    size = batch["input_ids"].shape[1] // (len(chunks) * len(chunks[0]))
    assert sorted(c for held in chunks for c in held) == list(range(2 * world_size))
    for rank, shard in enumerate(shards):
        local = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks[rank]])
        assert torch.equal(shard["input_ids"][0], batch["input_ids"][0, local])
        assert torch.equal(shard["position_ids"][0], batch["position_ids"][0, local])
        local_logits = table[shard["input_ids"][0]].detach().requires_grad_()
        part = local_weighted_sum(table, shard, local_logits)
        part.backward()
        # Each rank's logit gradients are the matching slice of the whole batch's.
        torch.testing.assert_close(local_logits.grad, logits.grad[local], rtol=1e-12, atol=1e-15)
        total = total + part.detach()
    torch.testing.assert_close(total, whole.detach(), rtol=1e-12, atol=0)

    # Through the table (what a model's parameters see): the ranks' gradients add up to the whole batch's.
    table.grad = None
    packed_weighted_sum(table, batch)[0].backward()
    expected_grad, table.grad = table.grad, None
    sum(local_weighted_sum(table, shard) for shard in shards).backward()
    torch.testing.assert_close(table.grad, expected_grad, rtol=1e-12, atol=1e-15)


def test_without_seq_targets_each_sequence_counts_its_own():
    batch = PackedCollator(pad_to_multiple_of=4)(EXAMPLES)
    with_targets = shard_batch(batch, 1, 2)
    without = shard_batch({k: v for k, v in batch.items() if k not in ("seq_targets", "position_ids")}, 1, 2)
    for key in ("input_ids", "position_ids", "shift_labels", "cu_seqlens", "seq_targets"):
        assert torch.equal(with_targets[key], without[key]), key


def _gloo_rank(rank, store, world_size, out_dir):
    """One context-parallel rank: its shard's weighted sum and table gradient, all-reduced over the ranks."""
    import torch.distributed as dist
    from integration_utils import start_rank

    start_rank(rank, world_size, store)
    try:
        table = lookup_table(VOCAB)
        shard = shard_batch(PackedCollator(pad_to_multiple_of=2 * world_size)(EXAMPLES), rank, world_size)
        part = local_weighted_sum(table, shard)
        part.backward()
        total = part.detach().clone()
        dist.all_reduce(total)
        dist.all_reduce(table.grad)
        torch.save({"loss": total, "grad": table.grad}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_add_up_to_the_whole_batch(tmp_path):
    """The same with two processes: all-reduced loss and gradients equal one process on the whole batch."""
    from integration_utils import rendezvous, spawn_ranks

    world_size = 2
    spawn_ranks(_gloo_rank, (rendezvous(tmp_path), world_size, str(tmp_path)), world_size)
    table = lookup_table(VOCAB)
    whole, _ = packed_weighted_sum(table, PackedCollator(pad_to_multiple_of=2 * world_size)(EXAMPLES))
    whole.backward()
    for rank in range(world_size):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(result["loss"], whole.detach(), rtol=1e-12, atol=0)
        torch.testing.assert_close(result["grad"], table.grad, rtol=1e-12, atol=1e-15)


def test_long_rows_balance_the_ranks_attention_work():
    """Rows of conversations of 8k-32k tokens (the context-parallel benchmark's): with chunks of CHUNK_TOKENS dealt
    out by work, the busiest rank does at most 0.1% more attention work than the mean (the zig-zag: up to 35%
    more), every chunk is held once, and every rank holds as many tokens."""
    import numpy as np

    from collators.sharding import CHUNK_TOKENS, balanced_chunks

    generator = np.random.default_rng(0)
    for num_tokens, world_size in ((65536, 2), (196608, 2), (131072, 4), (262144, 8)):
        lengths = []
        while sum(lengths) < num_tokens:
            lengths.append(int(min(generator.integers(8192, 32769), num_tokens - sum(lengths))))
        lengths = np.array(lengths)
        chunks = balanced_chunks(lengths, num_tokens, world_size)
        size = num_tokens // chunks.size
        assert size >= CHUNK_TOKENS and chunks.shape[0] == world_size
        assert sorted(chunks.reshape(-1).tolist()) == list(range(chunks.size))
        starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
        work = (np.arange(num_tokens) - starts + 1).reshape(-1, size).sum(1)
        per_rank = work[chunks].sum(1)
        assert per_rank.max() <= 1.001 * per_rank.mean(), (num_tokens, world_size, per_rank)
