"""Sequence boundaries, targets and step normaliser of a batch, as the packed loss reads them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from packed_ce.columns import (
    LABELS,
    LAYOUT,
    SHIFT_LABELS,
)
from packed_ce.layout import loss_boundaries

from ...options import LossOptions
from ...targets import count_normaliser, prepare_targets


def sequence_boundaries(
    labels: torch.Tensor, batch: Mapping[str, Any], *, is_packed: bool = True
) -> dict[str, torch.Tensor]:
    """The sequence boundaries of ``labels`` found in a batch or in a model's loss keywords.

    Args:
        labels: ``(B, T)`` or ``(N,)`` integer labels, whose device the boundaries move to.
        batch: a collated batch or a model's loss keywords.
        is_packed: whether ``seq_targets`` matter.

    Returns:
        Keywords of :func:`packed_ce.cross_entropy` (:func:`packed_ce.layout.loss_boundaries`):
        from ``cu_seqlens`` (with ``seq_targets`` and ``seq_weights``), else what the packed
        forward's layout carries, else ``cu_seq_lens_q``, else ``position_ids``, else one sequence
        per row.
    """
    layout = batch.get(LAYOUT)
    found = layout.loss if layout is not None else loss_boundaries(labels, batch)
    if not is_packed:
        found = dataclasses.replace(found, seq_targets=None)
    return found.tensors()


def next_token_targets(
    labels: torch.Tensor,
    batch: Mapping[str, Any],
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The target of every token: the next label of its sequence, as the loss scores it.

    Args:
        labels: ``(B, T)`` or ``(N,)`` labels aligned with ``input_ids``.
        batch: read for the boundaries (:func:`sequence_boundaries`).
        ignore_index: label value that is not a target.
        shift_labels: labels already shifted, or None.

    Returns:
        ``(N,)`` int64: ``labels[t + 1]`` when ``t + 1`` is in the sequence of ``t``, else
        ``ignore_index``.

    Example:
        >>> labels = torch.tensor([[-100, 5, 6, -100, 7]])
        >>> next_token_targets(labels, {"cu_seqlens": torch.tensor([0, 3, 5])})
        tensor([   5,    6, -100,    7, -100])
    """
    shift = shift_labels is None
    labels = labels if shift else shift_labels
    prepared = prepare_targets(
        labels,
        shift=shift,
        ignore_index=ignore_index,
        reduction="none",
        **sequence_boundaries(labels, batch),
    )
    return prepared.targets


def count_num_items(
    batches: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    *,
    is_packed: bool = True,
    shift: bool = True,
    ignore_index: int = -100,
    all_reduce: bool = True,
    group: torch.distributed.ProcessGroup | None = None,
) -> torch.Tensor:
    """``num_items_in_batch`` for one optimiser step: what the loss of the whole step divides by.

    :func:`packed_ce.count_normaliser` summed over the micro-batches and, with ``all_reduce``, the
    processes: passed to each micro-batch's loss, the step's gradients are those of one loss over
    the global batch. Data-parallel wrappers average over the ``W`` processes: multiply each loss
    by ``W`` (the Trainer does with ``average_tokens_across_devices=True``). Under context
    parallelism each rank counts the whole batch it shards, as here; the model divides by the
    group's size (:func:`enable_context_parallel`).

    Args:
        batches: one batch or a step's micro-batches, with ``labels`` (or ``shift_labels``).
        is_packed, shift, ignore_index: as the loss's.
        all_reduce: sum over the processes of ``group`` (default: the world) when
            ``torch.distributed`` is initialised.

    Returns:
        0-d tensor on the labels' device (the current CUDA device with NCCL): int64, or float64
        with ``seq_targets`` / ``seq_weights``.

    Example:
        >>> batch = {"labels": torch.tensor([[-100, 5, -100, -100, -100, 7, 8]]),
        ...          "cu_seqlens": torch.tensor([0, 2, 4, 7], dtype=torch.int32)}
        >>> count_num_items(batch)                       # the middle sequence has no target
        tensor(2)
        >>> count_num_items(batch, is_packed=False)
        tensor(3)
    """
    if isinstance(batches, Mapping):
        batches = [batches]
    total = None
    for batch in batches:
        count = _count_items(batch, is_packed=is_packed, shift=shift, ignore_index=ignore_index)
        total = count if total is None else total + count.to(total.device)
    if total is None:
        raise ValueError("count_num_items needs at least one batch")
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if all_reduce and distributed and torch.distributed.get_world_size(group) > 1:
        if torch.distributed.get_backend(group) == "nccl":
            total = total.to(torch.device("cuda", torch.cuda.current_device()))
        torch.distributed.all_reduce(total, group=group)
    return total


def _count_items(batch: Mapping[str, Any], *, is_packed: bool, shift: bool, ignore_index: int):
    """What the loss of one batch divides by (:func:`packed_ce.count_normaliser`), 0-d."""
    labels = batch.get(SHIFT_LABELS)
    if labels is None:
        labels = batch[LABELS]
    else:
        shift = False  # already shifted
    options = LossOptions(is_packed=is_packed, shift=shift, ignore_index=ignore_index)
    return count_normaliser(
        labels, options=options, **sequence_boundaries(labels, batch, is_packed=is_packed)
    )
