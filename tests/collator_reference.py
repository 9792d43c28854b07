"""Independent references for the collator tests: a context-free model, and the suite's per-sequence
loss (:func:`loss_utils.per_sequence_loss`) applied to whole conversations and to packed batches.

The model is a lookup table: the logits of a token depend on that token only, so a conversation gives the
same logits whole, cut into pieces, packed with others or sharded across ranks. Any difference in a loss is
then a difference in which targets are trained and how they are weighed.
"""

from __future__ import annotations

import torch

from loss_utils import per_sequence_loss

IGNORE = -100

def lookup_table(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """`(V, V)` float64 logits per input token, a leaf that collects gradients."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, vocab_size, generator=generator, dtype=torch.float64).requires_grad_()


def conversation_mean_loss(table: torch.Tensor, input_ids, labels) -> torch.Tensor | None:
    """Mean token loss of one whole conversation under the causal shift, or None without a target."""
    input_ids, labels = torch.as_tensor(input_ids), torch.as_tensor(labels)
    if not (labels[1:] != IGNORE).any():
        return None
    return per_sequence_loss(table[input_ids], labels, [(0, len(labels))], is_packed=True, shift=True)


def packed_weighted_sum(table: torch.Tensor, batch, logits: torch.Tensor | None = None):
    """`(sum_t w_t l_t, sum_t w_t)` of a packed batch.

    `logits` `(T, V)`, optional: the batch's logits (default: `table[input_ids]`), e.g. a leaf for their gradient.

    Sequence `s` predicts `labels[t + 1]` from token `t` inside `[cu_seqlens[s], cu_seqlens[s + 1])`, and each
    of its targets weighs `seq_weights[s] / seq_targets[s]` (weight 1 without `seq_weights`).
    """
    input_ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    logits = table[input_ids] if logits is None else logits
    bounds = batch["cu_seqlens"].tolist()
    slices = list(zip(bounds[:-1], bounds[1:]))
    seq_targets = batch["seq_targets"].tolist()
    weights = batch["seq_weights"].tolist() if "seq_weights" in batch else [1.0] * len(slices)
    total = per_sequence_loss(
        logits, labels, slices, is_packed=True, shift=True, reduction="sum",
        seq_targets=seq_targets, seq_weights=weights,
    )
    counts = [int((labels[start + 1 : end] != IGNORE).sum()) for start, end in slices]
    mass = sum(a * n / m for a, n, m in zip(weights, counts, seq_targets))
    return total, torch.tensor(mass, dtype=table.dtype)


def reference_pack(conversations, max_length: int, overflow: str, ignore_index: int = IGNORE):
    """`(rows, stats)` of `collators.pack_dataset` computed in memory, a Python list per row.

    `conversations`: dicts with `input_ids`, `labels` (lists of ints) and any other per-conversation value
    (`weight` -> `seq_weights`, `source` -> `seq_sources`, `name` -> `seq_<name>`). The plan is packing's own
    (overflow handling and best-fit decreasing, tested on their own); the rows are then built piece by piece,
    the way the in-memory `pack_dataset` built them before rows were written to an Arrow cache.
    """
    import numpy as np

    from collators.checks import targets_per_sequence
    from collators.planning import PackingStats, cut_to_capacity, plan_rows

    lengths = np.array([len(c["input_ids"]) for c in conversations], dtype=np.int64)
    labels = np.array([t for c in conversations for t in c["labels"]], dtype=np.int64)
    stats = PackingStats(max_length=max_length)
    kept = cut_to_capacity(lengths, max_length, overflow, stats)
    targets = targets_per_sequence(labels, lengths, ignore_index, counted=kept)
    stats.num_without_targets += int(((kept > 0) & (targets == 0)).sum())
    split = overflow == "split"
    plan = plan_rows(kept, max_length, split, stats)
    carried = {"weight": "seq_weights", "source": "seq_sources"}
    others = [k for k in (conversations[0] if conversations else {}) if k not in ("input_ids", "labels")]
    names = ["input_ids", "labels", "seq_lengths"] + ["seq_targets"] * split
    names += [carried.get(k, f"seq_{k}") for k in others if k == "weight"]
    names += [carried.get(k, f"seq_{k}") for k in others if k != "weight"]
    rows = {name: [] for name in names}
    piece = 0
    for count in plan.per_row.tolist():
        row = {name: [] for name in names}
        for p in range(piece, piece + count):
            conversation = conversations[plan.source[p]]
            a, b = int(plan.offset[p]), int(plan.offset[p] + plan.length[p])
            row["input_ids"] += conversation["input_ids"][a:b]
            # a piece after a cut repeats the token before it, its label already trained
            row["labels"] += ([ignore_index] if a else []) + conversation["labels"][a + bool(a) : b]
            row["seq_lengths"].append(b - a)
            if split:
                row["seq_targets"].append(max(int(targets[plan.source[p]]), 1))
            for key in others:
                row[carried.get(key, f"seq_{key}")].append(conversation[key])
        piece += count
        for name in names:
            rows[name].append(row[name])
    return rows, stats
