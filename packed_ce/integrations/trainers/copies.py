"""The copies accelerate adds to the last batch of an epoch, left out of training and evaluation.

Over several processes accelerate's ``BatchSamplerShard`` (``even_batches``, no ``drop_last``) deals
each process ``b`` examples per batch and completes the last round with the first examples of the
epoch. Counted, a copied conversation would weigh twice in the step (and in ``eval_loss``). A
packed batch is one row whatever its example count, so each batch carries its examples' token
counts (:class:`ExampleTokens`) and the labels of the copies are masked before the forward
(:func:`without_copies`): they add no target, so neither loss nor weight nor gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import datasets
import numpy as np
import torch
from accelerate.data_loader import BatchSamplerShard, DataLoaderDispatcher, IterableDatasetShard

from packed_ce.columns import EXAMPLE_TOKENS, INPUT_IDS, LABELS, SHIFT_LABELS

# (data-parallel rank, examples per process and batch): where the copies of a last batch are.
Layout = tuple[int, int]


class ExampleTokens:
    """A collator: ``collator``'s batch plus :data:`EXAMPLE_TOKENS`, ``(B,)`` int64, the token count
    of each example in order (what :func:`without_copies` reads to find an example's tokens in a
    packed row).
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


def copies_layout(dataloader, world_size: int, trainer: str) -> Layout | None:
    """Where accelerate puts copies in a loader's last batch.

    ``gather_for_metrics`` (and the examples really in the data) are the first
    ``remainder = len(dataset) % (b * processes)`` examples of the last round, in process-major
    order, so data-parallel rank ``r`` holds ``clamp(remainder - r * b, 0, b)`` real ones.

    Returns:
        ``(r, b)``, or None where no batch holds copies (one data-parallel process, drop_last,
        uneven batches).

    Raises:
        ValueError: for a data set without a length over several processes: its copies cannot
            be told apart, or (a ``datasets.IterableDataset`` split by its shards) the processes'
            batch counts may differ.
    """
    dataset = getattr(dataloader, "dataset", None)
    sharded = isinstance(dataset, IterableDatasetShard) and dataset.num_processes > 1
    # a datasets.IterableDataset of enough shards that accelerate split between the processes:
    # their batch counts may differ
    split = isinstance(dataset, datasets.IterableDataset)
    if world_size > 1 and (
        isinstance(dataloader, DataLoaderDispatcher) or (sharded and not dataset.drop_last) or split
    ):
        raise ValueError(
            f"{trainer}: a data set without a length over {world_size} processes: accelerate "
            "completes the last batches with copies of the first examples, which could not be told "
            "apart and would count twice (or, splitting a datasets.IterableDataset by its shards, "
            "gives the processes different numbers of batches); pass a data set with a length (a "
            "datasets.Dataset, or collators.pack_dataset of a streamed one)"
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


def without_copies(batch: dict, layout: Layout | None, remainder: int, ignore_index: int) -> dict:
    """The batch with the labels of accelerate's copies set to ``ignore_index``, and without
    :data:`EXAMPLE_TOKENS`.

    Args:
        batch: a batch of an :class:`ExampleTokens` collator, ``labels`` ``(B, T)`` (one example
            per row) or ``(1, T)`` (the examples back to back); ``shift_labels`` alike.
        layout: :func:`copies_layout` of its loader.
        remainder: accelerate's ``gradient_state.remainder`` at the last batch (0 or -1 elsewhere:
            no copies).
    """
    batch = dict(batch)
    tokens = batch.pop(EXAMPLE_TOKENS, None)
    if layout is None or remainder <= 0:
        return batch
    rank, size = layout
    keep = min(max(remainder - rank * size, 0), size)
    if tokens is None:
        raise RuntimeError(
            "the last batch holds copies of examples but no example_tokens: build the loader with "
            "the trainer's get_train_dataloader / get_eval_dataloader / get_test_dataloader"
        )
    count = tokens.numel()
    if keep >= count:
        return batch
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
                f"a batch of {count} examples with {key} of shape {tuple(labels.shape)} is neither "
                "one row per example nor one packed row, so the copies accelerate added to the "
                "last batch cannot be left out"
            )
        batch[key] = labels
    return batch


class CopiesLeftOut:
    """An epoch's batch iterator whose last batch has its copies left out (:func:`without_copies`).

    Args:
        batches: the iterator of an accelerate loader (its gradient state marks the last batch).
        layout: :func:`copies_layout` of the loader.
        state: accelerate's ``GradientState``.
        ignore_index: the loss's.
    """

    def __init__(self, batches, layout: Layout | None, state, ignore_index: int):
        self.batches, self.layout, self.state, self.ignore_index = (
            batches,
            layout,
            state,
            ignore_index,
        )

    def __iter__(self) -> "CopiesLeftOut":
        return self

    def __next__(self) -> dict:
        batch = next(self.batches)
        # the loader iterates one batch ahead: it has marked the last one when it hands it over
        remainder = self.state.remainder if self.state.end_of_dataloader else -1
        return without_copies(batch, self.layout, remainder, self.ignore_index)
