"""The trainers' per-conversation sums: ``loss/<source>`` in training, ``eval_loss`` in evaluation.

A loss call's :class:`packed_ce.SequenceLosses` times its normaliser ``D`` are each conversation's
``w_c mean_c`` and ``w_c`` (a split conversation's pieces add up to them, and so do the shards of
context-parallel ranks). Summed in float64 over batches and processes and divided once,

    eval_loss = sum_c w_c mean_c / sum_c w_c

over the whole eval set, whatever the batch size, packing or process count (transformers' own
``eval_loss`` is a mean of per-batch means). Under several processes accelerate's
``even_batches`` fills the last batch of some processes with copies of the first examples, which
``gather_for_metrics`` trims per example; a packed batch is one row whatever its example count,
so each evaluation batch carries its examples' token counts (:class:`ExampleTokens`) and the
labels of the copies are masked before the forward (:meth:`EvaluationSums.without_copies`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

from collators.columns import EXAMPLE_TOKENS, INPUT_IDS, LABELS, SHIFT_LABELS

from ..stats import SequenceLosses


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


class ExampleTokens:
    """An evaluation collator: ``collator``'s batch plus :data:`EXAMPLE_TOKENS`, ``(B,)`` int64,
    the token count of each example in order (what :meth:`EvaluationSums.without_copies` reads to
    find an example's tokens in a packed row).
    """

    def __init__(self, collator: Callable):
        self.collator = collator

    def __call__(self, examples: list[dict]) -> dict:
        # before the collator, which may take keys out of the examples
        tokens = [
            np.size(example[INPUT_IDS]) if INPUT_IDS in example else None for example in examples
        ]
        batch = self.collator(examples)
        if None not in tokens:  # else copies cannot be found: without_copies says so, if any
            batch[EXAMPLE_TOKENS] = torch.tensor(tokens, dtype=torch.int64)
        return batch


def copies_layout(dataloader, world_size: int, trainer: str) -> tuple[int, int] | None:
    """Where accelerate puts copies in an evaluation's last batch.

    ``BatchSamplerShard`` (even_batches, no drop_last) deals each process ``b`` examples per batch
    and completes the last round with the data set's first examples; ``gather_for_metrics``
    keeps the first ``remainder = len(dataset) % (b * processes)`` examples of that round in
    process-major order, so data-parallel rank ``r`` holds ``clamp(remainder - r * b, 0, b)``
    real ones.

    Returns:
        ``(r, b)``, or None where no batch holds copies (one data-parallel process, drop_last,
        uneven batches, a data set sharded by ``datasets``).

    Raises:
        ValueError: for a loader whose copies cannot be told apart (an eval set without a length
            over several processes).
    """
    dataset = getattr(dataloader, "dataset", None)
    sharded = isinstance(dataset, IterableDatasetShard) and dataset.num_processes > 1
    if world_size > 1 and (
        isinstance(dataloader, DataLoaderDispatcher) or (sharded and not dataset.drop_last)
    ):
        raise ValueError(
            f"{trainer}: evaluation over {world_size} processes of an eval data set without a "
            "length: accelerate completes the last batches with copies of the first examples, "
            "which could not be told apart and would count twice in eval_loss; pass a data set "
            "with a length (a datasets.Dataset)"
        )
    samplers = (getattr(dataloader, "batch_sampler", None), getattr(dataloader, "sampler", None))
    sampler = next((s for s in samplers if isinstance(s, BatchSamplerShard)), None)
    if sampler is None or sampler.num_processes == 1:
        return None
    if sampler.drop_last or not sampler.even_batches:  # no copies are added
        return None
    size = sampler.batch_size
    if sampler.split_batches:  # one batch of the loader is split over the processes
        size //= sampler.num_processes
    return sampler.process_index, size


class EvaluationSums:
    """One evaluation's sums (:func:`sequence_sums`), on the device, and how to finish them.

    Args:
        names: the sources reported as ``<prefix>_loss/<source>``.
        copies: :func:`copies_layout` of the evaluation's loader.
        device: where the sums are kept.
    """

    def __init__(self, names: tuple[str, ...], copies: tuple[int, int] | None, device):
        self.names = names
        self.copies = copies
        self.sums = torch.zeros(1 + len(names), 2, dtype=torch.float64, device=device)
        self.batches = 0  # batches with labels

    def add(self, seq_losses: SequenceLosses, sources: list | None, num_items_in_batch) -> None:
        """Adds one loss call's sums; ``num_items_in_batch`` is the ``D`` it was given."""
        self.sums += sequence_sums(seq_losses, sources, self.names, num_items_in_batch)

    def without_copies(self, batch: dict, remainder: int, ignore_index: int) -> dict:
        """The last batch with the labels of accelerate's copies set to ``ignore_index``: they add
        no target, so no loss and no weight.

        Args:
            batch: the last batch, with :data:`EXAMPLE_TOKENS` and ``labels`` ``(B, T)`` (one
                example per row) or ``(1, T)`` (the examples back to back); ``shift_labels`` alike.
            remainder: accelerate's ``gradient_state.remainder`` (0 or -1: no copies).
        """
        if self.copies is None or remainder <= 0:
            return batch
        rank, size = self.copies
        keep = min(max(remainder - rank * size, 0), size)
        tokens = batch.get(EXAMPLE_TOKENS)
        if tokens is None:
            raise RuntimeError(
                "the last evaluation batch holds copies of examples but no example_tokens: build "
                "the evaluation loader with the trainer's get_eval_dataloader / get_test_dataloader"
            )
        count = tokens.numel()
        if keep >= count:
            return batch
        batch = dict(batch)
        for key in (LABELS, SHIFT_LABELS):
            labels = batch.get(key)
            if labels is None:
                continue
            labels = labels.clone()
            if labels.dim() == 2 and labels.shape[0] == count:  # one example per row
                labels[keep:] = ignore_index
            elif labels.dim() == 2 and labels.shape[0] == 1:  # one packed row
                labels[:, int(tokens[:keep].sum()) :] = ignore_index
            else:
                raise ValueError(
                    f"evaluation: a batch of {count} examples with {key} of shape "
                    f"{tuple(labels.shape)} is neither one row per example nor one packed row, so "
                    "the copies accelerate added to the last batch cannot be left out"
                )
            batch[key] = labels
        return batch

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
