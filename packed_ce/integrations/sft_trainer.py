"""``PackedSFTTrainer``: trl's SFTTrainer whose step is the mean over conversations.

trl's ``SFTTrainer.compute_loss`` runs the model with ``fused_lm_head=True``: per-token
log-probabilities summed and divided by the number of target tokens of the step. Packed or not,
a long conversation then weighs as many times more as it has targets. Here the loss is the
model's packed loss (:func:`apply_packed_loss`), normalised by the number of conversations with
a target over every micro-batch and process (:class:`PackedNormaliserMixin`):

    L_step = 1 / S' * sum over the step's conversations s of ( 1 / n_s * sum_{t in s} l_t )

which is what training every conversation alone, one per row, averaging per conversation gives.
It holds for every batch layout trl builds whose sequences are whole conversations:
``padding_free=True`` (boundaries from ``cu_seq_lens_q`` / ``position_ids``), ``packing=True``
with ``packing_strategy="bfd"`` (the same, from ``seq_lengths``) and padded batches (one
conversation per row), with the labels trl masks for ``completion_only_loss`` and
``assistant_only_loss``.
"""

from __future__ import annotations

import torch
from trl import SFTTrainer

from ..stats import TokenStats
from .trainer import PackedNormaliserMixin
from .fused_forward import _check_fusable
from .loss import TOKEN_STATS_KEY
from .transformers import apply_packed_loss, installation_of, packed_loss_of

# Packing strategies that cut a conversation across rows: its pieces would each be averaged as a
# conversation of its own until rows carry each piece's whole-conversation target count.
_SPLITTING_STRATEGIES = {
    "bfd_split": "splits conversations longer than max_length across rows",
    "wrapped": "cuts the concatenated conversations into rows without regard to boundaries",
}


class PackedSFTTrainer(PackedNormaliserMixin, SFTTrainer):
    """``trl.SFTTrainer`` (same constructor) minimising the mean over conversations.

    Each optimiser step minimises the mean, over the conversations of all its micro-batches and
    all processes, of each conversation's mean token loss. The model gets the packed loss at
    construction unless it already has one: through the fused linear cross entropy (no
    ``(N, V)`` logits) when its head allows it, else on the logits. To choose, call
    :func:`apply_packed_loss` yourself first (``fused_linear=False``, ``label_smoothing``,
    ``z_loss_scale``, ...).

    Logged like trl: ``loss`` (the step's per-conversation mean), ``entropy`` and
    ``mean_token_accuracy`` (token means over the targets, as trl defines them), ``num_tokens``.
    The metrics come from the loss call itself (``return_token_stats``): the kernel computes
    each target's entropy and top-1 hit in the pass that computes its loss, so neither path
    reads the logits twice nor, in the fused path, runs the LM head again.

    Raises:
        ValueError: for options that cannot give the per-conversation mean, naming each:
            ``loss_type`` other than ``"nll"``, ``label_smoothing_factor > 0`` (use
            ``apply_packed_loss(model, label_smoothing=...)``), ``compute_loss_func``,
            ``packing_strategy`` ``"bfd_split"`` or ``"wrapped"``, a MoE router auxiliary
            loss (``router_aux_loss_coef``), a PEFT model, context or sequence parallelism; and
            those of :class:`PackedTrainer`.

    Example:
        >>> from trl import SFTConfig
        >>> trainer = PackedSFTTrainer(
        ...     model=model, args=SFTConfig("out", padding_free=True), train_dataset=dataset,
        ...     processing_class=tokenizer,
        ... )                                                                   # doctest: +SKIP
        >>> trainer.train()                                                     # doctest: +SKIP
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._refuse_inexact_options()
        if packed_loss_of(self.model) is None:
            apply_packed_loss(self.model, is_packed=True, fused_linear=_fusable(self.model))
        self._check_packed_setup()

    def _refuse_inexact_options(self) -> None:
        args = self.args
        if args.loss_type != "nll":
            raise ValueError(
                f"PackedSFTTrainer: loss_type={args.loss_type!r} reweights each token by its own "
                "probability, so the step is no per-conversation mean; use loss_type='nll'"
            )
        if args.label_smoothing_factor > 0:
            raise ValueError(
                "PackedSFTTrainer: label_smoothing_factor goes through the Trainer's label "
                "smoother, a token mean; set it to 0 and call "
                "apply_packed_loss(model, label_smoothing=...) before creating the trainer"
            )
        if self.compute_loss_func is not None:
            raise ValueError(
                "PackedSFTTrainer: compute_loss_func replaces the packed loss; leave it out"
            )
        if args.packing and args.packing_strategy in _SPLITTING_STRATEGIES:
            raise ValueError(
                f"PackedSFTTrainer: packing_strategy={args.packing_strategy!r} "
                f"{_SPLITTING_STRATEGIES[args.packing_strategy]}, so a conversation's pieces "
                "would be averaged as separate conversations; use packing_strategy='bfd'"
            )
        if self.aux_loss_enabled:
            raise ValueError(
                "PackedSFTTrainer: the MoE load-balancing loss (router_aux_loss_coef) is a "
                "per-token mean added to the loss; set router_aux_loss_coef=0.0"
            )
        if hasattr(self.model, "peft_config"):
            raise ValueError(
                "PackedSFTTrainer does not support PEFT models yet: the adapter's forward calls "
                "the base model's forward directly, past the packed loss's checks"
            )
        parallelism = self.accelerator.parallelism_config
        if parallelism is not None and (parallelism.cp_enabled or parallelism.sp_enabled):
            raise ValueError(
                "PackedSFTTrainer does not support context or sequence parallelism "
                "(parallelism_config): a conversation cut across ranks needs its whole target count"
            )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The packed loss of one micro-batch, normalised for the whole step; logs trl's metrics.

        ``num_items_in_batch`` (sequences with a target over the step's micro-batches and all
        processes) reaches the loss through the model call; with
        ``average_tokens_across_devices`` the loss is multiplied by the number of processes,
        which cancels the data-parallel gradient averaging.
        """
        mode = "train" if self.model.training else "eval"
        packed_loss = installation_of(self.model).loss
        call = {**inputs, "use_cache": False, TOKEN_STATS_KEY: True}
        if num_items_in_batch is not None:
            call["num_items_in_batch"] = num_items_in_batch
        packed_loss.take_token_stats()  # so that stats of an earlier call are never read as these
        outputs = model(**call)
        loss = outputs.loss
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())

        stats = packed_loss.take_token_stats()
        if stats is None:
            raise RuntimeError(
                f"{type(self.model).__name__}'s forward returned a loss without calling its packed "
                "loss function (model.loss_function): the step would not be the packed mean"
            )
        self._log_token_metrics(mode, stats, inputs)
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, mode: str, stats: TokenStats, inputs) -> None:
        """trl's ``entropy``, ``mean_token_accuracy`` and ``num_tokens``, gathered over processes."""
        sums = torch.stack(stats)[None]  # (1, 3): entropy sum, top-1 hits, targets
        entropy, correct, targets = self.accelerator.gather_for_metrics(sums).sum(0).tolist()
        metrics = self._metrics[mode]
        metrics["entropy"].append(entropy / targets if targets > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / targets if targets > 0 else 0.0)
        if mode == "train":
            # tokens seen, padding excluded, counted as trl counts them
            if "attention_mask" in inputs:
                local = inputs["attention_mask"].sum()
            else:
                local = sums.new_tensor(inputs["input_ids"].numel())
            tokens = int(self.accelerator.gather_for_metrics(local[None]).sum())
            self._total_train_tokens += tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]


def _fusable(model) -> bool:
    """Whether the fused linear cross entropy reproduces ``model``'s head exactly."""
    try:
        _check_fusable(model)
    except ValueError:
        return False
    return True
