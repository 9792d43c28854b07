"""``PackedSFTTrainer``: trl's SFTTrainer whose step is the mean over conversations.

trl's own step is a token mean (``fused_lm_head=True``): a conversation weighs as many times
more as it has targets. Here the step is, over its conversations ``c`` on every micro-batch and
process (:class:`PackedNormaliserMixin`),

    L_step = sum_c w_c mean_c / sum_c w_c        (w_c = 1 without a ``weight`` column)

with ``mean_c`` the mean token loss of ``c``, for every batch layout trl builds (padding-free,
``"bfd"`` / ``"bfd_split"`` packing, padded).
"""

from __future__ import annotations

import copy
import inspect

import datasets
import torch
import transformers
from packaging.version import Version
from transformers import TrainingArguments
from trl import SFTConfig, SFTTrainer
from trl.chat_template_utils import has_generation_markers
from trl.data_utils import is_conversational
from trl.trainer.utils import get_config_model_id

from collators.vision import is_processor
from collators.vision_collate import VisionCollator
from packed_ce.columns import ATTENTION_MASK, IMAGES, INPUT_IDS, LABELS, source_names

from ...stats import TokenStats
from ..model.forward import fusable_reason
from ..model.install import apply_packed_loss
from ..model.installation import base_model, installation_of, packed_loss_of
from ..model.loss import TOKEN_STATS_KEY
from . import data_checks, trl_data
from .data_checks import check_datasets, each_dataset, skip_or_refuse_without_targets
from .seams import warn_if_untested_trl
from .transformers_trainer import (
    PackedNormaliserMixin,
    refuse_prediction_metrics,
    refuse_token_mean_options,
)

_SIGNATURE = inspect.signature(SFTTrainer.__init__)


class PackedSFTTrainer(PackedNormaliserMixin, SFTTrainer):
    """``trl.SFTTrainer`` (same constructor) minimising the mean over conversations.

    The model gets the packed loss at construction unless it has one: fused (no ``(N, V)``
    logits) where :func:`fusable_reason` allows (not with a LoRA adapter on the head or a MoE
    router loss), else on the logits; call :func:`apply_packed_loss` first to choose.

    What it adds to trl:

    - PEFT (``peft_config=`` or a PEFT model), QLoRA included (the head stays unquantized).
    - A MoE router loss: ``coef * aux`` per micro-batch over the accumulation steps, as trl.
    - ``packing_strategy="bfd_split"``: over-long conversations split across rows, every target
      trained once, a split conversation weighing as one.
    - A numeric ``weight`` column (0 removes a conversation); a string ``source`` column:
      ``loss/<source>`` logged beside ``loss``.
    - ``evaluate()``: ``eval_loss`` the per-conversation mean over the whole eval set, at any batch
      size or process count, and ``eval_loss/<source>`` (:mod:`.evaluation`).
    - Context parallelism (``ParallelismConfig(cp_size=K)`` with ``padding_free=True``,
      :func:`enable_context_parallel`).
    - ``assistant_only_loss=True`` under a template without ``{% generation %}`` markers
      (:func:`collators.tokenize_conversation`).
    - ``skip_no_assistant`` (default False): a conversation without a target is an error naming
      its row; with True it is skipped and counted in a logged warning.

    Logged like trl (``loss``, ``entropy``, ``mean_token_accuracy``, ``num_tokens``,
    ``aux_loss``), the metrics from the loss's own pass.

    Raises:
        ValueError / TypeError naming the option or row, before tokenising, for what cannot give
            the per-conversation mean: ``loss_type`` other than ``"nll"``,
            ``label_smoothing_factor > 0``, ``compute_loss_func``, ``compute_metrics`` or
            ``preprocess_logits_for_metrics``, ``packing_strategy="wrapped"``,
            sequence parallelism, context parallelism without ``padding_free=True,
            packing=False``, bad ``weight`` / ``source`` values or all weights 0, an empty data
            set, a conversation without a target; and those of :class:`PackedTrainer`.

    Example:
        >>> from trl import SFTConfig
        >>> trainer = PackedSFTTrainer(
        ...     model=model, args=SFTConfig("out", padding_free=True), train_dataset=dataset,
        ...     processing_class=tokenizer,
        ... )                                                                   # doctest: +SKIP
        >>> trainer.train()                                                     # doctest: +SKIP
    """

    def __init__(self, *args, skip_no_assistant: bool = False, **kwargs):
        warn_if_untested_trl()
        signature = _SIGNATURE.bind(self, *args, **kwargs)
        bound = signature.arguments
        config = bound["args"] = sft_config(bound.get("args"), bound.get("model"))
        _refuse_inexact_options(config, bound.get("compute_loss_func"))
        refuse_prediction_metrics(
            type(self).__name__,
            bound.get("compute_metrics"),
            bound.get("preprocess_logits_for_metrics"),
        )
        check_datasets(
            bound,
            type(self).__name__,
            skip_no_assistant,
            assistant_only=config.assistant_only_loss,
            text_field=config.dataset_text_field,
        )
        self._skip_no_assistant = skip_no_assistant
        self._prediction_formatting = bound.get("formatting_func")  # predict() prepares with it
        # the sources of the raw data (packing moves them to seq_sources)
        self._sources = source_names(bound.get("train_dataset"), bound.get("eval_dataset"))
        self._own_assistant_labels = False
        self._vision = is_processor(bound.get("processing_class")) and trl_data.has_images(
            bound.get("train_dataset")
        )
        if self._vision:
            hidden = self._prepare_vision(bound, config)
        elif config.assistant_only_loss:
            template = getattr(bound.get("processing_class"), "chat_template", None)
            # trl refuses such a template (or swaps in one of its own for a few known ones):
            # the assistant turns are found by collators.tokenize_conversation instead
            if template is not None and not has_generation_markers(template):
                self._own_assistant_labels = True
        if self._own_assistant_labels:  # trl's own check is kept from refusing the template
            config.assistant_only_loss = False
        try:
            super().__init__(*signature.args[1:], **signature.kwargs)
        finally:
            if self._own_assistant_labels:
                config.assistant_only_loss = True
            if self._vision:
                for key, value in hidden.items():
                    setattr(config, key, value)
        if packed_loss_of(self.model) is None:
            fused = fusable_reason(base_model(self.model)) is None
            apply_packed_loss(self.model, is_packed=True, fused_linear=fused)
        self._check_packed_setup()
        if self._vision:
            self.padding_free = config.packing or config.padding_free
        else:
            self.data_collator = trl_data.SequenceColumns(self.data_collator, self.padding_free)

    def _prepare_vision(self, bound: dict, config: SFTConfig) -> dict:
        """Data with images, prepared here (:func:`trl_data.vision_rows`) and collated by
        :class:`collators.VisionCollator` (one packed row with ``packing`` or ``padding_free``,
        else one padded row per conversation).

        trl refuses packing, padding-free and (transformers < 5.18) ``assistant_only_loss`` for
        data with images and collates them itself, one padded row each: the options are hidden
        from its constructor, which then takes the prepared rows as they are.

        Returns:
            the options hidden from trl's constructor, to restore after it.
        """
        processor = bound["processing_class"]
        eval_packing = config.packing if config.eval_packing is None else config.eval_packing
        for key, packing in (("train_dataset", config.packing), ("eval_dataset", eval_packing)):
            bound[key] = self._vision_rows(bound.get(key), key, processor, config, packing)
        if bound.get("data_collator") is None:
            bound["data_collator"] = VisionCollator(
                processor,
                packed=config.packing or config.padding_free,
                pad_to_multiple_of=config.pad_to_multiple_of,
            )
        hidden = {
            key: getattr(config, key)
            for key in ("packing", "padding_free", "assistant_only_loss", "eval_packing")
        }
        config.packing = config.padding_free = config.assistant_only_loss = False
        config.eval_packing = None
        return hidden

    def _set_signature_columns_if_needed(self) -> None:
        # trl keeps a vision data set's raw columns (messages, images) for its own collator; the
        # rows prepared here are tokens and images
        if self._vision and self._signature_columns is None:
            self._signature_columns = [INPUT_IDS, LABELS, IMAGES]
        super()._set_signature_columns_if_needed()

    def _vision_rows(self, argument, name: str, processor, config: SFTConfig, packing: bool):
        """:func:`trl_data.vision_rows` of a ``train_dataset`` / ``eval_dataset`` argument."""
        return each_dataset(
            argument,
            name,
            lambda data, where: trl_data.vision_rows(
                data,
                processor,
                config,
                packing,
                where,
                type(self).__name__,
                self._skip_no_assistant,
            ),
        )

    def _check_later_dataset(self, dataset, name: str):
        """A data set given to ``evaluate()`` or ``predict()``: the checks of the constructor's
        data sets (:func:`check_datasets`), the rows kept returned.
        """
        found = {name: dataset}
        check_datasets(
            found,
            type(self).__name__,
            self._skip_no_assistant,
            assistant_only=self.args.assistant_only_loss,
            text_field=self.args.dataset_text_field,
            names=(name,),
        )
        return found[name]

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The ``evaluate()`` of trl (which prepares a data set given here), the data set checked
        as the constructor's are first; one with images prepared as at construction (trl leaves
        it raw for its own collator).
        """
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._later_dataset(eval_dataset, "eval_dataset")
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _later_dataset(self, dataset, name: str):
        """A data set given to ``evaluate()`` or ``predict()``, checked and (with images)
        prepared as the constructor's.
        """
        if not self._vision:
            return self._check_later_dataset(dataset, name)
        args = self.args
        packing = args.packing if args.eval_packing is None else args.eval_packing
        return self._vision_rows(dataset, name, self.processing_class, args, packing)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        """The Trainer's ``predict()`` on ``test_dataset`` checked and prepared as ``evaluate()``
        prepares a data set (trl 1.16's ``predict()`` takes it as it is: untokenised
        conversations reached the collator without ``input_ids``, a bare ``KeyError``).

        Returns:
            The Trainer's ``PredictionOutput``: ``<prefix>_loss`` the per-conversation mean over
            the data set (and ``<prefix>_loss/<source>``), the logits and labels of its rows.
        """
        test_dataset = self._later_dataset(test_dataset, "test_dataset")
        args = self.args
        skip = (args.dataset_kwargs or {}).get("skip_prepare_dataset", False)
        if not (skip or self._vision):
            packing = args.packing if args.eval_packing is None else args.eval_packing
            test_dataset = self._prepare_dataset(
                test_dataset,
                self.processing_class,
                args,
                packing,
                self._prediction_formatting,
                metric_key_prefix,
            )
        return super().predict(test_dataset, ignore_keys, metric_key_prefix)

    def _router_loss(self) -> float:
        """TRL's coefficient of a MoE router's loss (``router_aux_loss_coef``), 0.0 when off."""
        return float(self.router_aux_loss_coef) if self.aux_loss_enabled else 0.0

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, name):
        """TRL's preparation, with this trainer's packing and, where needed, its labels.

        A conversational data set's ``documents`` and system prompt columns reach the chat template
        (:func:`trl_data.as_the_template_reads`). Without generation markers,
        ``assistant_only_loss`` data is tokenised by :func:`trl_data.assistant_labels` first; with
        ``packing=True`` the rows come from :func:`trl_data.pack`, which carries ``weight`` and
        ``source`` to every piece. Rows packed already (``seq_lengths``) are used as they are,
        under ``packing=True`` or ``False`` (:func:`trl_data.packed_rows`).
        """
        if trl_data.is_packed(dataset):  # rows of collators.pack_dataset, packed-ce pack, ...
            return trl_data.packed_rows(
                dataset, f"{name}_dataset", type(self).__name__, self.padding_free
            )
        map_kwargs = {"num_proc": args.dataset_num_proc} if hasattr(dataset, "num_rows") else {}
        if is_conversational(next(iter(dataset))):
            dataset = trl_data.as_the_template_reads(dataset, map_kwargs, f"{name}_dataset")
            if self._own_assistant_labels:
                dataset = trl_data.assistant_labels(dataset, processing_class, map_kwargs)
        if not packing:
            given = len(dataset) if isinstance(dataset, datasets.Dataset) else 0
            prepared = super()._prepare_dataset(
                data_checks.numbered(dataset),
                processing_class,
                args,
                packing,
                formatting_func,
                name,
            )
            prepared = data_checks.skip_or_refuse_dropped(
                prepared,
                given,
                f"{name}_dataset",
                type(self).__name__,
                self._skip_no_assistant,
                args.max_length,
            )
            return self._without_targets(prepared, name)
        if args.max_length is None:
            raise ValueError("PackedSFTTrainer: packing=True needs max_length (the row length)")
        # trl truncates unpacked rows to max_length; here the packer decides what a long
        # conversation becomes, so it must see them whole
        whole = copy.copy(args)
        whole.max_length = None
        unpacked = super()._prepare_dataset(
            dataset, processing_class, whole, False, formatting_func, name
        )
        unpacked = self._without_targets(unpacked, name)
        return trl_data.pack(
            unpacked, args.max_length, args.packing_strategy, f"{name}_dataset", type(self).__name__
        )

    def _without_targets(self, prepared, name: str):
        """The prepared rows, checked for a target each (trl's truncation, an empty completion):
        skipped with ``skip_no_assistant``, else ValueError naming the first row without one.
        """
        return skip_or_refuse_without_targets(
            prepared, f"{name}_dataset", type(self).__name__, self._skip_no_assistant
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The packed loss of one micro-batch, normalised for the whole step
        (:meth:`PackedNormaliserMixin.compute_loss`); logs trl's metrics from the same call.
        """
        mode = "train" if self.model.training else "eval"
        packed_loss = installation_of(self.model).loss
        packed_loss.take_token_stats()  # so that stats of an earlier call are never read as these
        loss, outputs = super().compute_loss(
            model, {**inputs, TOKEN_STATS_KEY: True}, True, num_items_in_batch
        )
        stats = packed_loss.take_token_stats()
        if stats is None:
            raise RuntimeError(
                f"{type(self.model).__name__}'s forward returned a loss without calling its packed "
                "loss function (model.loss_function): the step would not be the packed mean"
            )
        self._log_token_metrics(mode, stats, inputs)
        if self.aux_loss_enabled:
            aux = outputs.aux_loss.detach()[None]
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux).mean().item()
            )
        return (loss, outputs) if return_outputs else loss

    def _log_token_metrics(self, mode: str, stats: TokenStats, inputs) -> None:
        """TRL's ``entropy``, ``mean_token_accuracy``, ``num_tokens``, gathered over processes."""
        sums = torch.stack(stats)[None]  # (1, 3): entropy sum, top-1 hits, targets
        entropy, correct, targets = self.accelerator.gather_for_metrics(sums).sum(0).tolist()
        metrics = self._metrics[mode]
        metrics["entropy"].append(entropy / targets if targets > 0 else 0.0)
        metrics["mean_token_accuracy"].append(correct / targets if targets > 0 else 0.0)
        if mode == "train":
            # tokens seen, padding excluded, counted as trl counts them
            if ATTENTION_MASK in inputs:
                local = inputs[ATTENTION_MASK].sum()
            else:
                local = sums.new_tensor(inputs[INPUT_IDS].numel())
            tokens = int(self.accelerator.gather_for_metrics(local[None]).sum())
            self._total_train_tokens += tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]


def sft_config(args, model) -> SFTConfig:
    """``args`` as trl's ``SFTTrainer.__init__`` makes it an ``SFTConfig`` (trl 1.16), so that the
    options are read before trl reads them: None gives ``SFTConfig("<model name>-SFT")``, a plain
    ``TrainingArguments`` its own fields (and the hub token, which ``to_dict`` hides).
    """
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        return SFTConfig(f"{name.split('/')[-1]}-SFT")
    if isinstance(args, TrainingArguments) and not isinstance(args, SFTConfig):
        fields = args.to_dict()
        fields["hub_token"] = args.hub_token
        if Version(transformers.__version__) < Version("5.0.0"):
            fields.pop("push_to_hub_token")
        return SFTConfig(**fields)
    return args


def _refuse_inexact_options(args, compute_loss_func) -> None:
    """Raises for a configuration whose step would not be the per-conversation mean."""
    if args.loss_type != "nll":
        raise ValueError(
            f"PackedSFTTrainer: loss_type={args.loss_type!r} reweights each token by its own "
            "probability, so the step is no per-conversation mean; use loss_type='nll'"
        )
    refuse_token_mean_options("PackedSFTTrainer", args, compute_loss_func)
    if args.packing and args.packing_strategy == "wrapped":
        raise ValueError(
            "PackedSFTTrainer: packing_strategy='wrapped' cuts the concatenated conversations "
            "into rows without regard to their boundaries, so no conversation can be averaged; "
            "use packing_strategy='bfd' or 'bfd_split'"
        )
    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None and parallelism.sp_enabled:
        raise ValueError(
            "PackedSFTTrainer does not support sequence parallelism (parallelism_config.sp_size): "
            "use context parallelism (cp_size), which keeps packed conversations apart"
        )
    if parallelism is not None and parallelism.cp_enabled:
        if args.packing or args.eval_packing or not args.padding_free:
            raise ValueError(
                "PackedSFTTrainer with context parallelism (parallelism_config.cp_size > 1) needs "
                "padding_free=True and packing=False (eval_packing=False): each batch's "
                "conversations are laid into one row that the ranks share, conversations kept "
                "apart (trl's pre-packed data sets are refused by trl itself under cp_size > 1)"
            )
