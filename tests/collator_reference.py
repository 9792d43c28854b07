"""Independent references for the collator tests: a context-free model and per-conversation losses by loops.

The model is a lookup table: the logits of a token depend on that token only, so a conversation gives the
same logits whole, cut into pieces, packed with others or sharded across ranks. Any difference in a loss is
then a difference in which targets are trained and how they are weighed.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

IGNORE = -100

def lookup_table(vocab_size: int, seed: int = 0) -> torch.Tensor:
    """`(V, V)` float64 logits per input token, a leaf that collects gradients."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab_size, vocab_size, generator=generator, dtype=torch.float64).requires_grad_()


def conversation_mean_loss(table: torch.Tensor, input_ids, labels) -> torch.Tensor | None:
    """Mean token loss of one whole conversation under the causal shift, or None without a target."""
    input_ids, labels = torch.as_tensor(input_ids), torch.as_tensor(labels)
    targets = labels[1:]
    if not (targets != IGNORE).any():
        return None
    return F.cross_entropy(table[input_ids[:-1]], targets, ignore_index=IGNORE)


def packed_weighted_sum(table: torch.Tensor, batch, logits: torch.Tensor | None = None):
    """`(sum_t w_t l_t, sum_t w_t)` of a packed batch, looping over its sequences.

    `logits` `(T, V)`, optional: the batch's logits (default: `table[input_ids]`), e.g. a leaf for their gradient.

    Sequence `s` predicts `labels[t + 1]` from token `t` inside `[cu_seqlens[s], cu_seqlens[s + 1])`, and each
    of its targets weighs `seq_weights[s] / seq_targets[s]` (weight 1 without `seq_weights`).
    """
    input_ids, labels = batch["input_ids"].reshape(-1), batch["labels"].reshape(-1)
    logits = table[input_ids] if logits is None else logits
    bounds = batch["cu_seqlens"].tolist()
    weights = batch.get("seq_weights")
    total, mass = table.new_zeros(()), table.new_zeros(())
    for s, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        targets = labels[start + 1 : end]
        trained = targets != IGNORE
        if not trained.any():
            continue
        weight = (1.0 if weights is None else float(weights[s])) / int(batch["seq_targets"][s])
        losses = F.cross_entropy(logits[start : end - 1], targets, ignore_index=IGNORE, reduction="none")
        total = total + weight * losses.sum()
        mass = mass + weight * trained.sum().to(table.dtype)  # an int tensor times a float would be float32
    return total, mass
