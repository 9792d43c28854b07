"""Sequence boundaries and counts of a batch, as the packed loss of a causal LM reads them.

- :func:`sequence_boundaries` finds the boundaries of ``labels`` in a batch or in a model's loss
  keywords;
- :func:`next_token_targets` is the target of every token, as the loss scores it;
- :func:`count_num_items` is the normaliser of one optimiser step over micro-batches and processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from collators.columns import CU_SEQLENS, CU_SEQ_LENS_Q, LABELS, POSITION_IDS, SEQ_TARGETS, SEQ_WEIGHTS, SHIFT_LABELS

from ..options import LossOptions
from ..targets import count_normaliser, prepare_targets
from .guards import BOUNDARIES_KEY


def sequence_boundaries(
    labels: torch.Tensor, batch: Mapping[str, Any], *, is_packed: bool = True
) -> dict[str, torch.Tensor]:
    """The sequence boundaries of ``labels`` found in a batch or in a model's loss keywords.

    Args:
        labels: ``(B, T)`` or ``(N,)`` integer labels; the boundaries are moved to their device.
        batch: a collated batch or the keywords a model passes to its loss function.
        is_packed: whether the loss weighs per sequence; ``seq_targets`` only matter then.

    Returns:
        ``{"cu_seqlens": ...}`` or ``{"position_ids": ...}``, keywords for
        :func:`packed_ce.cross_entropy`. Taken from ``cu_seqlens``, else what the forward of
        :func:`apply_packed_loss` handed on, else ``cu_seq_lens_q``, else ``position_ids``,
        else one sequence per row of ``labels``: ``cu_seqlens = [0, T, 2T, ..., B*T]``. With
        the batch's ``cu_seqlens``, its ``seq_targets`` (with ``is_packed``) and ``seq_weights``
        come along (:class:`collators.PackedCollator`, :func:`collators.shard_batch`): a
        conversation split across rows, micro-batches or ranks keeps its weight.

    A value that is not a tensor (a list, say) is passed on as it is: the loss refuses it, naming
    its argument (:func:`packed_ce.validation.checked_boundaries`).
    """

    def on_device(value):  # anything but a tensor is refused by name where the loss checks it
        return value.to(labels.device) if isinstance(value, torch.Tensor) else value

    if batch.get(CU_SEQLENS) is not None:
        keys = (SEQ_TARGETS, SEQ_WEIGHTS) if is_packed else (SEQ_WEIGHTS,)
        found = {key: on_device(batch[key]) for key in keys if batch.get(key) is not None}
        return {CU_SEQLENS: on_device(batch[CU_SEQLENS]), **found}
    if batch.get(BOUNDARIES_KEY) is not None:
        return {key: on_device(value) for key, value in batch[BOUNDARIES_KEY].items()}
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
        batch: the batch (or the model's keywords), read for the boundaries as
            :func:`sequence_boundaries` does.
        ignore_index: label value that is not a target.
        shift_labels: labels already shifted (the target of each token, used as they are), or
            None.

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

    With ``is_packed=True`` the number of sequences that have at least one target, with
    ``is_packed=False`` the number of targets (with ``seq_targets`` / ``seq_weights`` in a
    batch: the weight mass, :func:`packed_ce.count_normaliser`), over every micro-batch of the
    step and, with ``all_reduce``, every process of the default (or given) process group.
    Passing it to each micro-batch's loss makes the summed gradients of the step those of one
    loss over the whole global batch. Data-parallel wrappers average the gradients over the ``W`` processes, so
    multiply each micro-batch's loss by ``W`` before ``backward`` (the Trainer does this when
    ``average_tokens_across_devices=True``; :class:`PackedTrainer` counts with this function).

    Args:
        batches: one batch or the micro-batches of a step, each with ``labels`` (or
            ``shift_labels``) and the boundaries :func:`sequence_boundaries` reads.
        is_packed: count sequences (True) or target tokens (False), as the loss averages.
        shift: ``labels`` are aligned with ``input_ids`` (the causal-LM convention).
        ignore_index: label value that is not a target.
        all_reduce: sum over processes when ``torch.distributed`` is initialised; the ranks of a
            context-parallel group (:func:`enable_context_parallel`) hold the same rows, and
            their sum counts each row once.
        group: the process group of the sum (default: the whole world).

    Returns:
        0-d tensor on the labels' device (on the current CUDA device with NCCL): int64, or
        float64 when a batch carries ``seq_targets`` or ``seq_weights``.

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
        # the ranks of a context-parallel group hold the same rows: each row counted once
        # (imported here: context_parallel imports the loss, which imports this module)
        from .context_parallel import ranks_per_row

        sharing = ranks_per_row(group)
        if sharing > 1:
            total = total / sharing if total.is_floating_point() else total // sharing
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
