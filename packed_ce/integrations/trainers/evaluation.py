"""The trainers' per-conversation sums: ``loss/<source>`` in training, ``eval_loss`` in evaluation.

A loss call's :class:`packed_ce.SequenceLosses` times its normaliser ``D`` are each conversation's
``w_c mean_c`` and ``w_c`` (a split conversation's pieces add up to them, and so do the shards of
context-parallel ranks). Summed in float64 over batches and processes and divided once,

    eval_loss = sum_c w_c mean_c / sum_c w_c

over the whole eval set, whatever the batch size, packing or process count (transformers' own
``eval_loss`` is a mean of per-batch means); the copies accelerate adds to the last batch are left
out before the forward (:mod:`.copies`).
"""

from __future__ import annotations

import numpy as np
import torch

from ...stats import SequenceLosses


def sequence_sums(
    seq_losses: SequenceLosses, sources: list | None, names: tuple[str, ...], scale
) -> torch.Tensor:
    """A loss call's ``w_c mean_c`` and ``w_c``, in total and per source.

    Args:
        seq_losses: the call's :class:`packed_ce.SequenceLosses` (``S`` slots).
        sources: the source of each sequence (None for none), or None.
        names: the sources reported; row ``1 + i`` is ``names[i]``'s.
        scale: the call's ``num_items_in_batch`` (int, float or 0-d tensor; 1.0 without): times
            ``D``, the sums of ``coef_t * l_t`` and ``coef_t`` are ``w_c mean_c`` and ``w_c``.

    Returns:
        ``(1 + len(names), 2)`` float64 on the losses' device: row 0 over every sequence.
    """
    # float64 before the scale: times a float64 D the weight is the conversation's weight,
    # which may pass float32's range (a weight column of 1e39)
    rows = torch.stack([seq_losses.loss, seq_losses.weight], dim=-1).to(torch.float64) * scale
    index = {name: i + 1 for i, name in enumerate(names)}
    # non_blocking: a blocking host-to-device copy would wait for the step's queued kernels
    ids = torch.tensor([index.get(s, 0) for s in sources or []], dtype=torch.int64)
    ids = ids.to(rows.device, non_blocking=True)
    sums = rows.new_zeros(1 + len(names), 2)
    sums[0] = rows.sum(0)
    named = rows[: len(ids)]
    return sums.index_add_(0, ids, torch.where((ids > 0)[:, None], named, 0.0))


class EvaluationSums:
    """One evaluation's sums (:func:`sequence_sums`), on the device, and how to finish them.

    Args:
        names: the sources reported as ``<prefix>_loss/<source>``.
        device: where the sums are kept.
    """

    def __init__(self, names: tuple[str, ...], device):
        self.names = names
        self.sums = torch.zeros(1 + len(names), 2, dtype=torch.float64, device=device)
        self.batches = 0  # batches with labels

    def add(self, seq_losses: SequenceLosses, sources: list | None, num_items_in_batch) -> None:
        """Adds one loss call's sums; ``num_items_in_batch`` is the ``D`` it was given."""
        self.sums += sequence_sums(seq_losses, sources, self.names, num_items_in_batch)

    def metrics(self, accelerator, prefix: str) -> dict[str, float]:
        """``<prefix>_loss`` and ``<prefix>_loss/<source>``, summed over the processes.

        Raises:
            ValueError: if batches had labels but no conversation a target and a weight > 0.
        """
        local = torch.cat([self.sums.flatten(), self.sums.new_tensor([self.batches])])
        totals = accelerator.reduce(local, reduction="sum").tolist()
        (loss, mass), *by_source = np.reshape(totals[:-1], (-1, 2)).tolist()
        if totals[-1] == 0:  # no labels: predictions only
            return {}
        if mass <= 0:
            raise ValueError(
                f"no conversation of the evaluation data has a target and a weight > 0, so "
                f"{prefix}_loss would be 0 / 0: give it conversations to evaluate"
            )
        metrics = {f"{prefix}_loss": loss / mass}
        for name, (loss, weight) in zip(self.names, by_source):
            if weight > 0:
                metrics[f"{prefix}_loss/{name}"] = loss / weight
        return metrics
