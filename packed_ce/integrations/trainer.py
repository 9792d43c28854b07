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

from collators.columns import FLOAT_SEQUENCE_KEYS, LABELS, ROW_COLUMNS, SEQ_SOURCES, source_names

from ..pending import check_pending
from .batch import count_num_items
from .context_parallel import context_parallel_of, enable_context_parallel, shard_for_rank
from .data_checks import check_datasets
from .installation import base_model, installation_of, packed_loss_of
from .loss import SEQ_LOSSES_KEY
from .seams import CHECKED, RefuseOtherTrainers

# Float batch keys that are data, not activations: under DeepSpeed the Trainer casts every float
# tensor to the engine's dtype, while the normaliser is counted from the float64 weights as
# collated (in bf16 a weight of 0.1 would weigh 0.10009765625, in float32 1e39 would be inf).
EXACT_FLOAT_KEYS = FLOAT_SEQUENCE_KEYS


class CheckPendingValues(TrainerCallback):
    """Raises a bad value a loss call of the step received before the optimiser steps: on CUDA
    the error would otherwise come with the next loss call, after a step on NaN gradients."""

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        check_pending()


class PackedNormaliserMixin:
    """What both packed trainers change in ``transformers.Trainer``: the normaliser of a step.

    - ``num_items_in_batch``: what the loss divides by, over the step's micro-batches and processes;
    - the row columns (``seq_lengths``, ``seq_targets``, weights, sources) survive
      ``remove_unused_columns``;
    - ``loss/<source>`` logged beside ``loss`` (:class:`packed_ce.SequenceLosses`);
    - a MoE router loss added per micro-batch over the accumulation steps, as trl adds it;
    - :class:`CheckPendingValues` added, :class:`RefuseOtherTrainers` removed.
    """

    _context_parallel: tuple[int, int] | None = None  # (rank, size) in the context-parallel group
    _row_sharded = False  # set by _prepare_context_parallel_inputs, taken by the next model call
    _sources: tuple[str, ...] = ()
    _source_sums: torch.Tensor | None = None  # (sources, 2): weighted loss and weight, on device

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
        refuse_token_mean_options(type(self).__name__, self.args, self.compute_loss_func)
        self._set_up_context_parallel()
        self.remove_callback(RefuseOtherTrainers)
        self.add_callback(CheckPendingValues)
        if not self._sources:
            self._sources = source_names(self.train_dataset, self.eval_dataset)

    def _set_up_context_parallel(self) -> None:
        """``ParallelismConfig(cp_size=K)``: :func:`enable_context_parallel` on accelerate's ``"cp"``
        mesh group; the other dimension is data parallel."""
        config = getattr(self.accelerator, "parallelism_config", None)
        if config is None or not config.cp_enabled:
            return
        if config.sp_enabled or config.tp_enabled:
            raise ValueError(
                f"{type(self).__name__}: context parallelism (cp_size) combines with data "
                "parallelism only; set tp_size and sp_size to 1"
            )
        mesh = self.accelerator.torch_device_mesh["cp"]
        if context_parallel_of(self.model) is None:
            enable_context_parallel(self.model, group=mesh.get_group())
        self._context_parallel = (mesh.get_local_rank(), config.cp_size)

    def _prepare_context_parallel_inputs(self, model, inputs):
        """This rank's shard of the row (:func:`shard_for_rank`), in place of accelerate's ring
        attention, which would let conversations attend to each other."""
        if self._context_parallel is None:
            return super()._prepare_context_parallel_inputs(model, inputs)
        rank, size = self._context_parallel
        loss = packed_loss_of(self.model)
        self._row_sharded = True
        return contextlib.nullcontext, shard_for_rank(
            inputs, rank, size, ignore_index=loss.ignore_index
        )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Under context parallelism, the evaluation loss as the training step computes it: the
        row's normaliser, then this rank's shard (trl's ``prediction_step`` does neither: every
        rank would run the whole row). Each rank returns its share times the number of
        processes, so the evaluation loop's mean over the ranks is the row's loss."""
        if self._context_parallel is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if not prediction_loss_only:
            raise ValueError(
                f"{type(self).__name__}: under context parallelism each rank holds a shard of the "
                "row, so evaluation gives the loss only: leave out compute_metrics and "
                "prediction_loss_only=False"
            )
        inputs = self._prepare_inputs(inputs)
        count = self._get_num_items_in_batch([inputs], self.args.device)
        _, inputs = self._prepare_context_parallel_inputs(model, inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=count)
        return loss.detach(), None, None

    def _set_signature_columns_if_needed(self) -> None:
        super()._set_signature_columns_if_needed()
        for column in ROW_COLUMNS:  # the collator's inputs
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    def _prepare_inputs(self, inputs: dict) -> dict:
        """The Trainer's preparation of a batch, with the keys of ``EXACT_FLOAT_KEYS`` moved to
        the device in their own dtype."""
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
        if self._context_parallel is not None and not self._row_sharded:
            # a Trainer that no longer calls the override would feed every rank the whole row
            raise RuntimeError(
                f"context parallelism: this transformers {transformers.__version__} Trainer did "
                "not call Trainer._prepare_context_parallel_inputs before the model call, so the "
                "row was not sharded; packed-ce is tested with "
                f"{CHECKED} (packed_ce/integrations/seams.py)"
            )
        self._row_sharded = False
        inputs = dict(inputs)
        sources = inputs.pop(SEQ_SOURCES, None)
        want_sources = sources is not None and model.training and bool(self._sources)
        call = {**inputs, "use_cache": False}
        if want_sources:
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
            steps = self.current_gradient_accumulation_steps if num_items_in_batch is not None else 1
            loss = loss + coef * aux / steps
        if want_sources:
            self._add_source_losses(packed_loss.take_seq_losses(), sources, num_items_in_batch)
        return (loss, outputs) if return_outputs else loss

    def _add_source_losses(self, seq_losses, sources: list, num_items_in_batch) -> None:
        """Adds a micro-batch's per-sequence losses to the window's per-source sums (no sync).

        Times ``D`` the sums of ``coef_t * l_t`` and ``coef_t = w_t / D`` are the sequence's
        weighted loss and weight, which add up over micro-batches and steps.
        """
        index = {name: i for i, name in enumerate(self._sources)}
        # non_blocking: a blocking host-to-device copy would wait for the step's queued kernels
        ids = torch.tensor([index.get(s, -1) for s in sources])
        ids = ids.to(seq_losses.loss.device, non_blocking=True)
        scale = 1.0 if num_items_in_batch is None else num_items_in_batch
        # float64 before the scale: times a float64 D the weight is the conversation's weight,
        # which may pass float32's range (a weight column of 1e39)
        rows = torch.stack([seq_losses.loss, seq_losses.weight], dim=-1)[: len(ids)]
        rows = torch.where((ids >= 0)[:, None], rows.to(torch.float64) * scale, 0.0)
        sums = rows.new_zeros(len(self._sources), 2).index_add_(0, ids.clamp(min=0), rows)
        self._source_sums = sums if self._source_sums is None else self._source_sums + sums

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        """The Trainer's log, with ``loss/<source>`` of the window's conversations per source."""
        if self._sources and "loss" in logs and self.model.training:
            sums = self._source_sums
            if sums is None:
                sums = torch.zeros(len(self._sources), 2, dtype=torch.float64, device=self.args.device)
            sums = self.accelerator.gather_for_metrics(sums[None]).sum(0).tolist()
            for source, (loss, weight) in zip(self._sources, sums):
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
            count = self.accelerator.gather(count).sum()
        if self._context_parallel is not None:
            # the ranks of a context-parallel group hold the same rows: each counted them once
            size = self._context_parallel[1]
            count = count / size if count.is_floating_point() else count // size
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
            =False`` over several processes, several GPUs in one process; naming the data set or
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

