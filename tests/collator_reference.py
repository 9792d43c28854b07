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
