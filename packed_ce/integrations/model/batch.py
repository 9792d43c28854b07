"""Sequence boundaries, targets and step normaliser of a batch, as the packed loss reads them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from packed_ce.columns import (
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    LABELS,
    POSITION_IDS,
    SEQ_TARGETS,
    SEQ_WEIGHTS,
    SHIFT_LABELS,
)

from ...options import LossOptions
from ...targets import count_normaliser, prepare_targets
from .guards import BOUNDARIES_KEY


def sequence_boundaries(
    labels: torch.Tensor, batch: Mapping[str, Any], *, is_packed: bool = True
) -> dict[str, torch.Tensor]:
    """The sequence boundaries of ``labels`` found in a batch or in a model's loss keywords.

    Args:
        labels: ``(B, T)`` or ``(N,)`` integer labels, whose device the boundaries move to.
        batch: a collated batch or a model's loss keywords.
        is_packed: whether ``seq_targets`` matter.

    Returns:
        Keywords of :func:`packed_ce.cross_entropy`, from ``cu_seqlens`` (with ``seq_targets``
        and ``seq_weights``), else what :func:`apply_packed_loss`'s forward handed on, else
        ``cu_seq_lens_q``, else ``position_ids``, else one sequence per row. Non-tensors are
        passed on, for the loss to refuse by name.
    """

    def on_device(value):  # anything but a tensor is refused by name where the loss checks it
        return value.to(labels.device) if isinstance(value, torch.Tensor) else value

    handed = batch.get(BOUNDARIES_KEY)  # the packed forward's, already found
    source = batch if handed is None else handed
    if source.get(CU_SEQLENS) is not None:
        keys = (SEQ_TARGETS, SEQ_WEIGHTS) if is_packed else (SEQ_WEIGHTS,)
        found = {key: on_device(source[key]) for key in keys if source.get(key) is not None}
        return {CU_SEQLENS: on_device(source[CU_SEQLENS]), **found}
    if handed is not None:
        return {POSITION_IDS: on_device(handed[POSITION_IDS])}
    if batch.get(CU_SEQ_LENS_Q) is not None:
        return {CU_SEQLENS: on_device(batch[CU_SEQ_LENS_Q])}
    if batch.get(POSITION_IDS) is not None:
        return {POSITION_IDS: on_device(batch[POSITION_IDS])}
    rows = labels.shape[0] if labels.dim() == 2 else 1
    row_length = labels.shape[-1] if labels.dim() else 0
    return {CU_SEQLENS: torch.arange(rows + 1, device=labels.device) * row_length}


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
