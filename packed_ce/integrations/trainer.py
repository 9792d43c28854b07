"""``PackedTrainer``: the transformers Trainer with the normaliser of the packed loss.

How one optimiser step of the Trainer adds up, with ``W`` data-parallel processes and ``G``
micro-batches per process (gradient accumulation):

- before the step, ``num_items_in_batch`` is counted once over the ``G`` micro-batches and
  gathered over the ``W`` processes;
- each micro-batch's loss is ``sum of its per-sequence means / num_items_in_batch`` (the model's
  loss function receives ``num_items_in_batch``), and the Trainer then leaves it alone for
  gradient accumulation because it is already normalised for the whole step;
- with ``average_tokens_across_devices=True`` the Trainer multiplies it by ``W``, which cancels
  the ``1 / W`` of the data-parallel gradient averaging.

So the step's gradient is that of ``sum over all sequences of the global batch of their mean
token loss / number of those sequences``: unpacked per-sequence averaging over the whole global
batch. The Trainer's own count is the number of target tokens, right for ``is_packed=False`` only;
:class:`PackedTrainer` counts what the installed loss divides by.
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainerCallback

from ..pending import check_pending
from .batch import count_num_items
from .transformers import packed_loss_of


class CheckPendingValues(TrainerCallback):
    """Raises, before each optimiser step, the error of a bad label or ``cu_seqlens`` that a loss
    call of the step received.

    On CUDA the loss checks its values on the device without waiting for them
    (:func:`packed_ce.check_pending`): the bad micro-batch's loss is NaN and the error would come
    only with the next loss call, after the optimiser had stepped on NaN gradients (the Trainer
    steps whatever the loss). Read here, the step never happens.
    """

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        check_pending()


class PackedNormaliserMixin:
    """What both packed trainers change in ``transformers.Trainer``: the normaliser of a step.

    - ``num_items_in_batch`` is the number of sequences with at least one target (with
      ``is_packed=True``; the number of targets with ``is_packed=False``) over all micro-batches
      of the optimiser step and all processes;
    - the ``seq_lengths`` column of packed rows is kept when ``remove_unused_columns=True``
      (without it a packed row would be collated as one sequence), and so are ``seq_targets`` and
      ``seq_weights`` (a split or weighted conversation keeps its weight);
    - a bad label or ``cu_seqlens`` raises before the optimiser step (:class:`CheckPendingValues`);
    - ``counts_packed_items`` tells the model's pre-hook (see :func:`apply_packed_loss`) that this
      trainer may call a model with the packed loss: any other ``Trainer`` is refused.
    """

    counts_packed_items = True

    def _check_packed_setup(self) -> None:
        """Raises for a model or a set-up with which the step would not be the packed mean."""
        if packed_loss_of(self.model) is None:
            raise ValueError(
                f"{type(self).__name__} needs a model with the packed loss: call "
                "packed_ce.integrations.apply_packed_loss(model) before creating the trainer"
            )
        if not self.model_accepts_loss_kwargs:
            raise ValueError(
                f"{type(self.model).__name__}.forward takes no **kwargs, so the trainer could not "
                "pass num_items_in_batch to the packed loss"
            )
        if self.args.n_gpu > 1:
            raise ValueError(
                f"{type(self).__name__} does not support several GPUs in one process "
                "(nn.DataParallel); launch one process per GPU (torchrun or accelerate launch)"
            )
        if self.args.world_size > 1 and not self.args.average_tokens_across_devices:
            raise ValueError(
                f"{type(self).__name__} over several processes needs "
                "average_tokens_across_devices=True: the loss is then multiplied by the number of "
                "processes, which cancels the data-parallel gradient averaging of a loss "
                "normalised over all processes"
            )
        self.add_callback(CheckPendingValues)

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        # the collator's inputs: the packed row's boundaries and each conversation's weight
        for column in ("seq_lengths", "seq_targets", "seq_weights"):
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    def _get_num_items_in_batch(
        self, batch_samples: list, device: torch.device
    ) -> torch.Tensor | None:
        """Sequences with a target (or targets) over ``batch_samples`` and all processes."""
        if not batch_samples or "labels" not in batch_samples[0]:
            return None
        loss = packed_loss_of(self.model)
        count = count_num_items(
            batch_samples,
            is_packed=loss.is_packed,
            ignore_index=loss.ignore_index,
            all_reduce=False,
        ).to(device)
        if self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count


class PackedTrainer(PackedNormaliserMixin, Trainer):
    """A ``transformers.Trainer`` for models given to :func:`apply_packed_loss`.

    Differences from ``Trainer`` (see :class:`PackedNormaliserMixin`): ``num_items_in_batch``
    counts the sequences with a target over all micro-batches of the optimiser step and all
    processes, so gradient accumulation and data parallelism give the gradient of one
    per-sequence average over the whole global batch; the ``seq_lengths`` column of packed rows
    (:func:`collators.pack_dataset`) is kept for the collator.

    Supported: one process or data parallelism over processes (DDP or FSDP2, through ``torchrun``
    or ``accelerate launch``) with any gradient accumulation. Not supported: ``nn.DataParallel``
    (several GPUs in one process), tensor, context or sequence parallelism.

    Raises:
        ValueError: if the model has no packed loss, if the Trainer would not pass
            ``num_items_in_batch`` to it, with ``average_tokens_across_devices=False`` over several
            processes, or with several GPUs in one process.

    Example:
        >>> from transformers import TrainingArguments
        >>> from collators import PackedCollator, pack_dataset
        >>> from packed_ce.integrations import PackedTrainer, apply_packed_loss
        >>> apply_packed_loss(model, is_packed=True)                            # doctest: +SKIP
        >>> trainer = PackedTrainer(
        ...     model=model,
        ...     args=TrainingArguments("out", per_device_train_batch_size=4,
        ...                            gradient_accumulation_steps=2),
        ...     train_dataset=pack_dataset(tokenized, max_length=4096),
        ...     data_collator=PackedCollator(),
        ... )                                                                   # doctest: +SKIP
        >>> trainer.train()                                                     # doctest: +SKIP
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._check_packed_setup()
