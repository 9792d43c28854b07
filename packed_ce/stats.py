"""Metrics from the loss's own pass: ``return_token_stats`` and ``return_seq_losses``.

The kernel accumulates ``sum_j p_j x_j`` beside the logsumexp, so trl's ``entropy``
(``H = lse - sum_j p_j x_j``) and ``mean_token_accuracy`` (``x_y >= max_j x_j``) cost no extra
read of the logits. A per-row ``(N, 3)`` float32 buffer holds entropy, top-1 hit and the weighted
loss ``coef_t * l_t``; the loss returns sums (what a step gathers before dividing), over targets
or over each sequence's targets.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenStats(NamedTuple):
    """Sums over the rows of one loss call that have a target; 0-d float32 tensors, detached.

    A row counts when its coefficient is nonzero (every target, none under
    ``num_items_in_batch=0``). Entropy of the softmax after ``softcap``, in nats; ties for the
    top logit count as correct. Step means: ``entropy_sum / targets``, ``correct / targets``
    after summing over micro-batches and ranks (``torch.stack(stats)`` gathers as one tensor).

    Attributes:
        entropy_sum: sum of the entropies of the rows with a target.
        correct: number of those rows whose target is a top-1 class.
        targets: number of those rows.
    """

    entropy_sum: torch.Tensor
    correct: torch.Tensor
    targets: torch.Tensor


def sum_token_stats(rows: torch.Tensor, coef: torch.Tensor) -> TokenStats:
    """The :class:`TokenStats` of per-row stats.

    Args:
        rows: ``(N, 2)`` float32: each row's entropy and top-1 hit (0 or 1), any value where
            ``coef`` is 0.
        coef: ``(N,)`` the rows' loss coefficients (:func:`packed_ce.targets.prepare_targets`),
            0 for the rows without a target.
    """
    counted = coef != 0
    sums = torch.where(counted[:, None], rows, 0.0).sum(0)
    return TokenStats(sums[0], sums[1], counted.sum().to(torch.float32))


class SequenceLosses(NamedTuple):
    """Each sequence's part of one loss call; ``(S,)`` float32 tensors, detached.

    ``S``: the sequences of ``cu_seqlens`` (with ``position_ids`` one slot per token, the
    ``i``-th sequence in slot ``i``, the rest 0; without boundaries one per row).

    Attributes:
        loss: ``sum_t coef_t * l_t`` over the sequence's targets (they add up to the loss).
        weight: ``sum_t coef_t``; ``loss / weight`` is the sequence's mean token loss.
    """

    loss: torch.Tensor
    weight: torch.Tensor


def sum_sequence_losses(
    loss_rows: torch.Tensor, coef: torch.Tensor, seq: torch.Tensor, num_slots: int
) -> SequenceLosses:
    """The :class:`SequenceLosses` of per-row losses.

    Args:
        loss_rows: ``(N,)`` float32 ``coef_t * l_t`` (any value where ``coef`` is 0).
        coef: ``(N,)`` the rows' loss coefficients. seq: ``(N,)`` int64 sequence of each row.
        num_slots: ``S``.
    """
    counted = coef != 0
    rows = torch.stack([torch.where(counted, loss_rows, 0.0), coef.to(torch.float32)], dim=-1)
    sums = rows.new_zeros(num_slots, 2).index_add_(0, seq, rows)
    return SequenceLosses(sums[:, 0], sums[:, 1])
