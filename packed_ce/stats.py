"""Training metrics that come with the loss: ``return_token_stats`` and ``return_seq_losses``.

TRL's SFTTrainer logs ``entropy`` and ``mean_token_accuracy``, token means over the targets of
a step. Both need each target row's whole distribution, which the loss reads anyway: the Triton
kernel accumulates ``sum_j p_j x_j`` beside the logsumexp of its one pass over the row, so the
entropy ``H = lse - sum_j p_j x_j`` and the top-1 hit ``x_y >= max_j x_j`` cost no extra read of
the logits (the torch backend, the reference, computes them from the same upcast rows). The
loss call writes them into an ``(N, 2)`` float32 buffer, one row per token, and returns their
sums: sums are what a step gathers over micro-batches and ranks before dividing.

The same buffer's third column holds each row's weighted loss ``coef_t * l_t`` (copied from the
loss rows before they are summed), so a loss per sequence, and from it a loss per data source,
is a segment sum of numbers the loss computed anyway.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenStats(NamedTuple):
    """Sums over the rows of one loss call that have a target; 0-d float32 tensors, detached.

    A row counts when it has a target and a nonzero coefficient: every target, except under
    ``num_items_in_batch=0`` (nothing to learn from), where no row counts. The entropy is of the
    softmax of the logits after ``softcap``, in nats; a target is correct when no logit exceeds
    its own (ties count as correct, as for any argmax). Per-token means over a step:
    ``entropy_sum / targets`` and ``correct / targets`` after summing each field over the
    step's micro-batches and ranks (``torch.stack(stats)`` is one ``(3,)`` tensor to gather).

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

    ``S`` is the number of sequences of ``cu_seqlens`` (with ``position_ids``: one slot per token,
    the ``i``-th sequence in slot ``i``, the unused slots 0; without boundaries: one per row).

    Attributes:
        loss: ``sum_t coef_t * l_t`` over the sequence's targets: its share of the returned loss
            (summed over sequences it is the loss, for "mean" and "sum").
        weight: ``sum_t coef_t`` over the same targets. ``loss / weight`` is the sequence's mean
            token loss; for ``is_packed=True`` and "mean", ``weight * D`` is the sequence's share
            of its conversation times the conversation's weight (1 for a whole conversation).
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
