"""``PackedTrainer``: the transformers Trainer with the normaliser of the packed loss.

One step with ``W`` processes and ``G`` micro-batches each: ``num_items_in_batch`` is counted
over the ``G`` micro-batches and gathered over the ``W`` processes (what the installed loss
divides by; the Trainer's own count, of target tokens, fits ``is_packed=False`` only); each
micro-batch's loss is divided by it, and ``average_tokens_across_devices`` multiplies it by ``W``,
cancelling the data-parallel averaging (DDP, FSDP2, DeepSpeed ZeRO alike). The step's gradient
is that of the per-sequence mean over the whole global batch.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import transformers
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import has_length
from transformers.training_args import ParallelMode

from collators.sharding import shard_for_rank
from packed_ce.columns import (
    EXAMPLE_TOKENS,
    FLOAT_SEQUENCE_KEYS,
    LABELS,
    ROW_COLUMNS,
    SEQ_SOURCES,
    SHARD,
    source_names,
)

from ...pending import check_pending
from ..context_parallel import context_parallel_of, enable_context_parallel
from ..context_parallel.enable import ContextParallel
from ..model.batch import count_num_items
from ..model.installation import base_model, installation_of, packed_loss_of
from ..model.loss import SEQ_LOSSES_KEY
from ..model.other_trainers import RefuseOtherTrainers
from .copies import CopiesLeftOut, ExampleTokens, Layout, copies_layout, without_copies
from .data_checks import check_datasets
from .evaluation import EvaluationSums, sequence_sums
from .seams import ACCELERATE_PREPARED, CHECKED

# Float batch keys that are data, not activations: under DeepSpeed the Trainer casts every float
# tensor to the engine's dtype, while the normaliser is counted from the float64 weights as
# collated (in bf16 a weight of 0.1 would weigh 0.10009765625, in float32 1e39 would be inf).
EXACT_FLOAT_KEYS = FLOAT_SEQUENCE_KEYS


class CheckPendingValues(TrainerCallback):
    """Raises a bad value a loss call of the step received before the optimiser steps: on CUDA
    the error would otherwise come with the next loss call, after a step on NaN gradients.
    """

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        check_pending()


class PackedNormaliserMixin:
    """What both packed trainers change in ``transformers.Trainer``: the normaliser of a step.

    - ``num_items_in_batch``: what the loss divides by, over the step's micro-batches and processes;
    - the row columns (``seq_lengths``, ``seq_targets``, weights, sources) survive
      ``remove_unused_columns``;
    - ``loss/<source>`` logged beside ``loss`` (:class:`packed_ce.SequenceLosses`);
    - ``eval_loss``: the per-conversation mean over the whole eval set, with ``eval_loss/<source>``
      (:mod:`.evaluation`);
    - a MoE router loss added per micro-batch over the accumulation steps, as trl adds it;
    - :class:`CheckPendingValues` added, :class:`RefuseOtherTrainers` removed.
    """

    _context_parallel: ContextParallel | None = None  # the model's, with ParallelismConfig(cp_size)
    _sources: tuple[str, ...] = ()
    _source_sums: torch.Tensor | None = None  # sequence_sums of the logging window, on device
    _evaluation: EvaluationSums | None = None  # while an evaluation loop runs
    _train_copies: Layout | None = None  # where the train loader's last batch holds copies
    _eval_copies: Layout | None = None  # the same for the evaluation loop's loader

    def _check_packed_setup(self) -> None:
        """Raises for a model or a set-up with which the step would not be the packed mean."""
        if packed_loss_of(self.model) is None:
            raise ValueError(
                f"{type(self).__name__} needs a model with the packed loss: call "
                "packed_ce.integrations.apply_packed_loss(model) before creating the trainer"
            )
        if not self.model_accepts_loss_kwargs:
            forward = inspect.signature(base_model(self.model).forward).parameters.values()
            if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in forward):
                raise ValueError(
                    f"{type(self.model).__name__}.forward takes no **kwargs, so the trainer could "
                    "not pass num_items_in_batch to the packed loss"
                )
            # transformers marks the vision-language models accepts_loss_kwargs=False: their own
            # loss is no per-step mean, but their forward hands **kwargs to loss_function, where
            # the packed loss takes num_items_in_batch (the Trainer would divide each
            # micro-batch's loss by the accumulation steps once more)
            self.model_accepts_loss_kwargs = True
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
        refuse_token_mean_options(type(self).__name__, self.args, self.compute_loss_func)
        refuse_prediction_metrics(
            type(self).__name__, self.compute_metrics, self.preprocess_logits_for_metrics
        )
        self._set_up_context_parallel()
        self.remove_callback(RefuseOtherTrainers)
        self.add_callback(CheckPendingValues)
        if not self._sources:
            self._sources = source_names(self.train_dataset, self.eval_dataset)

    def create_accelerator_and_postprocess(self) -> None:
        """The Trainer's accelerator, every process collating its own batches (accelerate's
        dispatching turned off).

        accelerate dispatches the batches of a data set without a length (an ``IterableDataset``,
        ``dispatch_batches`` unset) from the first process: it concatenates ``W`` batches and gives
        each process the slice of every tensor along its first dimension, of the size of the first
        tensor's. A packed batch's per-sequence tensors (``cu_seqlens`` ``(S+1,)``, ``seq_targets``
        ``(S,)``, ...) have no such dimension: on one process ``cu_seqlens`` was cut to ``(1,)``
        ("seq_targets must have shape (S,) = (0,)"), and rows of other lengths do not concatenate.

        Raises:
            ValueError: for ``accelerator_config={"dispatch_batches": True}``.
        """
        super().create_accelerator_and_postprocess()
        config = self.accelerator.dataloader_config
        if config.dispatch_batches:
            raise ValueError(
                f"{type(self).__name__}: accelerator_config dispatch_batches=True slices every "
                "tensor of a batch along its first dimension, which a packed batch's per-sequence "
                "tensors (cu_seqlens, seq_targets, ...) do not have: leave dispatch_batches unset "
                "(each process then collates its own batches)"
            )
        config.dispatch_batches = False

    def _set_up_context_parallel(self) -> None:
        """``ParallelismConfig(cp_size=K)``: :func:`enable_context_parallel` on accelerate's
        ``"cp"`` mesh group; the other dimension is data parallel.
        """
        config = getattr(self.accelerator, "parallelism_config", None)
        if config is None or not config.cp_enabled:
            return
        if config.sp_enabled or config.tp_enabled:
            raise ValueError(
                f"{type(self).__name__}: context parallelism (cp_size) combines with data "
                "parallelism only; set tp_size and sp_size to 1"
            )
        if context_parallel_of(self.model) is None:
            group = self.accelerator.torch_device_mesh["cp"].get_group()
            enable_context_parallel(self.model, group=group)
        self._context_parallel = context_parallel_of(self.model)

    def _prepare_context_parallel_inputs(self, model, inputs):
        """This rank's shard of the row (:func:`shard_for_rank`), in place of accelerate's ring
        attention, which would let conversations attend to each other.
        """
        if self._context_parallel is None:
            return super()._prepare_context_parallel_inputs(model, inputs)
        state, loss = self._context_parallel, packed_loss_of(self.model)
        return contextlib.nullcontext, shard_for_rank(
            inputs, state.rank, state.world_size, ignore_index=loss.ignore_index
        )

    def train(self, *args, **kwargs):
        """The Trainer's training, its model wrapped for data parallelism even after an
        ``evaluate()``.

        ``evaluate()`` before ``train()`` prepares the bare model with accelerate in evaluation
        mode, which marks it prepared without wrapping it in DistributedDataParallel; the
        training's ``prepare`` then kept it bare, and each process stepped on its own gradient
        (measured on two gloo processes: updates 1.04x to 2x the global step's). The mark is taken
        off such a model before training (FSDP and DeepSpeed prepare it whole in evaluation too).
        """
        distributed = self.args.parallel_mode == ParallelMode.DISTRIBUTED
        plain_ddp = distributed and not (self.is_fsdp_enabled or self.is_deepspeed_enabled)
        if plain_ddp and self.model_wrapped is self.model:
            self.model.__dict__.pop(ACCELERATE_PREPARED, None)
        return super().train(*args, **kwargs)

    def get_train_dataloader(self):
        """The Trainer's loader, its batches carrying their examples' token counts (the copies of
        the last batch are left out of the step, :meth:`get_batch_samples`).

        Raises:
            ValueError: with ``dataloader_drop_last=True`` where it would drop conversations.
        """
        with self._counting_example_tokens():
            loader = super().get_train_dataloader()
        self._train_copies = copies_layout(loader, self.args.world_size, type(self).__name__)
        dataset = self.train_dataset
        if self.args.dataloader_drop_last and has_length(dataset):
            dropped = len(dataset) % loader.total_batch_size
            if dropped:
                raise ValueError(
                    f"{type(self).__name__}: dataloader_drop_last=True drops the last {dropped} of "
                    f"the {len(dataset)} rows of train_dataset every epoch (batches of "
                    f"{loader.total_batch_size} over all processes), and their conversations with "
                    "them: set dataloader_drop_last=False (the copies accelerate adds to complete "
                    "the last batch are left out of the step), or give a number of rows that "
                    "divides"
                )
        return loader

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The Trainer's micro-batches of one step and their count, the copies accelerate adds to
        an epoch's last batch left out (:mod:`.copies`): each conversation counts once an epoch.
        """
        state = self.accelerator.gradient_state
        ignore_index = packed_loss_of(self.model).ignore_index
        batches = CopiesLeftOut(epoch_iterator, self._train_copies, state, ignore_index)
        return super().get_batch_samples(batches, num_batches, device)

    def get_eval_dataloader(self, eval_dataset=None):
        with self._counting_example_tokens(), self._keeping_last_batch():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self._counting_example_tokens(), self._keeping_last_batch():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _counting_example_tokens(self):
        """The data collator wrapped in :class:`ExampleTokens` while a loader is built (in the
        batch: a worker process's collator cannot report back otherwise).
        """
        collator = self.data_collator
        self.data_collator = ExampleTokens(collator)
        try:
            yield
        finally:
            self.data_collator = collator

    @contextlib.contextmanager
    def _keeping_last_batch(self):
        """``dataloader_drop_last`` off while an evaluation loader is built: ``eval_loss`` is over
        the whole eval set (accelerate's copies are left out instead).
        """
        drop_last = self.args.dataloader_drop_last
        self.args.dataloader_drop_last = False
        try:
            yield
        finally:
            self.args.dataloader_drop_last = drop_last

    def evaluation_loop(
        self,
        dataloader,
        description,
        prediction_loss_only=None,
        ignore_keys=None,
        metric_key_prefix="eval",
    ):
        """The Trainer's loop, its ``<prefix>_loss`` replaced by the per-conversation mean over the
        whole data set, and ``<prefix>_loss/<source>`` beside it (:class:`EvaluationSums`).
        """
        name = type(self).__name__
        refuse_prediction_metrics(name, self.compute_metrics, self.preprocess_logits_for_metrics)
        sources = set(self._sources) | set(source_names(getattr(dataloader, "dataset", None)))
        self._eval_copies = copies_layout(dataloader, self.args.world_size, name)
        evaluation = EvaluationSums(tuple(sorted(sources)), self.args.device)
        self._evaluation = evaluation
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        finally:
            self._evaluation = None
        output.metrics.update(evaluation.metrics(self.accelerator, metric_key_prefix))
        return output

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """One evaluation batch's loss as the training step computes it: the batch's normaliser
        over the processes, then (context parallelism) this rank's shard of the row, whose loss
        is its share. The per-sequence sums go to the evaluation's :class:`EvaluationSums`, the
        copies accelerate adds to the last batch left out.

        Returns:
            ``(loss, logits, labels)`` as the Trainer's (logits None under context parallelism).
        """
        if self._context_parallel is not None and not prediction_loss_only:
            raise ValueError(
                f"{type(self).__name__}: under context parallelism each rank holds a shard of the "
                "row, so predict() gives the loss only: set prediction_loss_only=True"
            )
        inputs = dict(inputs)
        if LABELS not in inputs:  # predictions only, as the Trainer makes them
            inputs.pop(EXAMPLE_TOKENS, None)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        evaluation, state = self._evaluation, self.accelerator.gradient_state
        remainder = state.remainder if evaluation is not None and state.end_of_dataloader else -1
        ignore_index = packed_loss_of(self.model).ignore_index
        inputs = without_copies(inputs, self._eval_copies, remainder, ignore_index)
        count = self._get_num_items_in_batch([inputs], self.args.device)
        _, call = self._prepare_context_parallel_inputs(model, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss, outputs = self.compute_loss(model, call, True, num_items_in_batch=count)
        if evaluation is not None:
            evaluation.batches += 1
        if prediction_loss_only:
            return loss.detach(), None, None
        return loss.detach(), outputs.logits, inputs[LABELS]

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        for column in ROW_COLUMNS:  # the collator's inputs
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    def _prepare_inputs(self, inputs: dict) -> dict:
        """The Trainer's preparation of a batch, with the keys of ``EXACT_FLOAT_KEYS`` moved to
        the device in their own dtype.
        """
        exact = {key: inputs[key] for key in EXACT_FLOAT_KEYS if torch.is_tensor(inputs.get(key))}
        prepared = super()._prepare_inputs({k: v for k, v in inputs.items() if k not in exact})
        prepared.update({key: value.to(self.args.device) for key, value in exact.items()})
        return prepared

    def _router_loss(self) -> float:
        """The coefficient of a MoE router's auxiliary loss, 0.0 when there is none."""
        config = base_model(self.model).config
        if not getattr(config, "output_router_logits", False):
            return 0.0
        return float(getattr(config, "router_aux_loss_coef", 0.0))

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The model call of one micro-batch and its loss, normalised for the whole step.

        A MoE forward's ``coef * aux`` is taken out and added back over the accumulation steps
        after the multiplication by the process count (trl's way).

        Returns:
            ``loss``, or ``(loss, outputs)`` with ``return_outputs``.
        """
        if self._context_parallel is not None and SHARD not in inputs:
            # a Trainer that no longer calls the override would feed every rank the whole row
            raise RuntimeError(
                f"context parallelism: this transformers {transformers.__version__} Trainer did "
                "not call Trainer._prepare_context_parallel_inputs before the model call, so the "
                "row was not sharded; packed-ce is tested with "
                f"{CHECKED} (packed_ce/integrations/trainers/seams.py)"
            )
        inputs = dict(inputs)
        sources = inputs.pop(SEQ_SOURCES, None)
        want_sources = sources is not None and model.training and bool(self._sources)
        evaluation = None if model.training else self._evaluation
        call = {**inputs, "use_cache": False}
        if want_sources or evaluation is not None:
            call[SEQ_LOSSES_KEY] = True
        if num_items_in_batch is not None:
            call["num_items_in_batch"] = num_items_in_batch
        coef = self._router_loss()
        if coef:
            call["output_router_logits"] = True
        packed_loss = installation_of(self.model).loss
        packed_loss.take_seq_losses()  # never read an earlier call's as this one's
        outputs = model(**call)
        loss = outputs.loss
        if coef:
            aux = outputs.aux_loss.to(loss.device)
            loss = loss - getattr(base_model(self.model), "router_aux_loss_coef", 0.0) * aux
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        if coef:
            # the Trainer sets current_gradient_accumulation_steps in its training loop only: an
            # evaluation (before train() too) adds the router loss once
            accumulated = model.training and num_items_in_batch is not None
            steps = self.current_gradient_accumulation_steps if accumulated else 1
            loss = loss + coef * aux / steps
        # the sums are scaled by the step's count; under context parallelism the model divides it
        # by the group's size first, so both sums come out that many times larger: only their
        # ratios (loss/<source>, eval_loss) are reported
        if want_sources:
            scale = 1.0 if num_items_in_batch is None else num_items_in_batch
            sums = sequence_sums(packed_loss.take_seq_losses(), sources, self._sources, scale)
            self._source_sums = sums if self._source_sums is None else self._source_sums + sums
        elif evaluation is not None:
            evaluation.add(packed_loss.take_seq_losses(), sources, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """The Trainer's log, with ``loss/<source>`` of the window's conversations per source."""
        if self._sources and "loss" in logs and self.model.training:
            sums = self._source_sums
            if sums is None:
                shape = (1 + len(self._sources), 2)
                sums = torch.zeros(shape, dtype=torch.float64, device=self.args.device)
            sums = self.accelerator.gather_for_metrics(sums[None]).sum(0).tolist()
            for source, (loss, weight) in zip(self._sources, sums[1:]):
                if weight > 0:
                    logs[f"loss/{source}"] = loss / weight
            self._source_sums = None
        super().log(logs, *args, **kwargs)

    def _get_num_items_in_batch(
        self, batch_samples: list, device: torch.device
    ) -> torch.Tensor | None:
        """Sequences with a target (or targets) over ``batch_samples`` and all processes."""
        if not batch_samples or LABELS not in batch_samples[0]:
            return None
        loss = packed_loss_of(self.model)
        count = count_num_items(
            batch_samples,
            is_packed=loss.is_packed,
            ignore_index=loss.ignore_index,
            all_reduce=False,
        ).to(device)
        if self.args.world_size > 1:
            # under context parallelism each rank of a group counts its row: the model divides
            count = self.accelerator.gather(count).sum()
        return count


_SIGNATURE = inspect.signature(Trainer.__init__)


class PackedTrainer(PackedNormaliserMixin, Trainer):
    """A ``transformers.Trainer`` for models given to :func:`apply_packed_loss`.

    The step's gradient is that of one per-sequence average over the global batch, under any
    gradient accumulation, DDP, FSDP2 or DeepSpeed ZeRO-3 and context parallelism
    (``ParallelismConfig(cp_size=K)``); not ``nn.DataParallel``, tensor or sequence parallelism
    (:class:`PackedNormaliserMixin`). A conversation without a target is an error naming its row;
    ``skip_no_assistant=True`` skips it (or leaves it in its packed row, weighing nothing), counted
    in a logged warning.

    Raises:
        ValueError: a model without the packed loss or ``**kwargs``, ``average_tokens_across_devices
            =False`` over several processes, several GPUs in one process, ``compute_metrics`` or
            ``preprocess_logits_for_metrics`` (:mod:`.evaluation`); naming the data set or
            row: empty, a conversation without a target, bad weights or sources, every weight 0.

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

    def __init__(self, *args, skip_no_assistant: bool = False, **kwargs):
        bound = _SIGNATURE.bind(self, *args, **kwargs)
        check_datasets(bound.arguments, type(self).__name__, skip_no_assistant)
        super().__init__(*bound.args[1:], **bound.kwargs)
        self._check_packed_setup()


def refuse_token_mean_options(trainer: str, args, compute_loss_func) -> None:
    """Raises for the Trainer options that replace the packed loss by a token mean."""
    if args.label_smoothing_factor > 0:
        raise ValueError(
            f"{trainer}: label_smoothing_factor goes through the Trainer's label smoother, a "
            "token mean; set it to 0 and call apply_packed_loss(model, label_smoothing=...) "
            "before creating the trainer"
        )
    if compute_loss_func is not None:
        raise ValueError(f"{trainer}: compute_loss_func replaces the packed loss; leave it out")


def refuse_prediction_metrics(trainer: str, compute_metrics, preprocess_logits_for_metrics) -> None:
    """Raises for the Trainer options that read predictions: a packed batch's are rows of several
    conversations (and the last batch's hold copies), not one prediction per conversation.
    """
    for option, value in (
        ("compute_metrics", compute_metrics),
        ("preprocess_logits_for_metrics", preprocess_logits_for_metrics),
    ):
        if value is not None:
            raise ValueError(
                f"{trainer}: {option} reads the Trainer's predictions batch by batch, which are "
                "no per-conversation result (a packed or padding-free row holds several "
                "conversations, and accelerate completes the last batch with copies); leave it "
                "out: evaluate() reports eval_loss (the per-conversation mean over the eval set) "
                "and eval_loss/<source>"
            )
