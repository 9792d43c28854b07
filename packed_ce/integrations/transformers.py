"""The packed loss as the loss function of a transformers causal LM.

transformers computes a causal LM's loss inside ``forward`` as ``self.loss_function(logits,
labels, vocab_size, **kwargs)``, where ``kwargs`` are the extra keywords of the ``model(...)``
call (every key of a :class:`collators.PackedCollator` batch other than ``input_ids``, ``labels``
and ``position_ids``, plus ``num_items_in_batch`` from the Trainer).
``PreTrainedModel.loss_function`` is a property whose setter stores an instance attribute, so one
model instance can get its own loss without touching the class:

- :func:`apply_packed_loss` installs a :class:`PackedCausalLMLoss` on one model, a forward pre-hook
  that hands ``position_ids`` to it (the model consumes them and does not pass them on), and
  optionally a forward that computes the loss from the hidden states with
  :func:`packed_ce.fused_linear_cross_entropy`;
- :func:`remove_packed_loss` undoes all three exactly;
- :func:`count_num_items` is the normaliser of one optimiser step over micro-batches and processes.

Sequence boundaries are read, in this order, from ``cu_seqlens`` (:class:`collators.PackedCollator`,
:class:`collators.PaddedCollator`), ``cu_seq_lens_q`` (transformers' flash-attention varlen
keywords, e.g. ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), ``position_ids``
(padding-free batches); without any of them every row of ``labels`` is one sequence, which is also
what the model's attention assumes then.

Nothing here imports ``datasets``.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..cross_entropy import cross_entropy
from ..stats import TokenStats
from ..options import LossOptions
from ..targets import count_normaliser, prepare_targets

# The forward pre-hook passes the model's ``position_ids`` to the loss under this keyword; like any
# extra keyword it also reaches the attention functions, which ignore keywords they do not know.
POSITION_IDS_KEY = "packed_ce_position_ids"

# Configuration fields with which a causal LM's forward does more than ``lm_head`` (plus the final
# softcap) between the hidden states and the loss: the fused forward would silently drop it.
_UNFUSABLE_CONFIG_FIELDS = {
    "logit_scale": "the logits are multiplied by config.logit_scale",
    "logits_scaling": "the logits are divided by config.logits_scaling",
}

# With this keyword set to True in a model call, the packed loss (on the logits, or the fused
# forward's) also computes the targets' TokenStats in its own pass and keeps them on the model's
# PackedCausalLMLoss for PackedCausalLMLoss.take_token_stats(). Like POSITION_IDS_KEY it also
# reaches the attention functions, which ignore keywords they do not know.
TOKEN_STATS_KEY = "packed_ce_token_stats"

_MISSING = object()


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
        :func:`packed_ce.cross_entropy`. Taken from ``cu_seqlens``, else ``cu_seq_lens_q``, else
        ``position_ids`` (or what the forward pre-hook of :func:`apply_packed_loss` passed on),
        else one sequence per row of ``labels``: ``cu_seqlens = [0, T, 2T, ..., B*T]``. With
        the batch's ``cu_seqlens``, its ``seq_targets`` (with ``is_packed``) and ``seq_weights``
        come along (:class:`collators.PackedCollator`, :func:`collators.shard_batch`): a
        conversation split across rows, micro-batches or ranks keeps its weight.
    """
    if batch.get("cu_seqlens") is not None:
        found = {"cu_seqlens": batch["cu_seqlens"].to(labels.device)}
        for key in ("seq_targets", "seq_weights") if is_packed else ("seq_weights",):
            if batch.get(key) is not None:
                found[key] = batch[key].to(labels.device)
        return found
    if batch.get("cu_seq_lens_q") is not None:
        return {"cu_seqlens": batch["cu_seq_lens_q"].to(labels.device)}
    for key in (POSITION_IDS_KEY, "position_ids"):
        if batch.get(key) is not None:
            return {"position_ids": batch[key].to(labels.device)}
    rows = labels.shape[0] if labels.dim() == 2 else 1
    row_length = labels.shape[-1] if labels.dim() else 0
    return {"cu_seqlens": torch.arange(rows + 1, device=labels.device) * row_length}


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


class PackedCausalLMLoss:
    """A transformers causal-LM loss function backed by :func:`packed_ce.cross_entropy`.

    Called like transformers' ``ForCausalLMLoss``: ``labels`` are aligned with ``input_ids`` and
    shifted inside (``shift=True``), never across a sequence boundary; a ``shift_labels`` keyword
    (already shifted labels, as some padding-free collators emit) is used as is. The reduction is
    "mean": with ``is_packed=True`` the mean over sequences of each sequence's mean token loss,
    with ``is_packed=False`` the mean over target tokens (what ``ForCausalLMLoss`` computes), each
    divided by ``num_items_in_batch`` instead when the caller gives it.

    ``final_logit_softcapping`` is not applied here: the models that have it (Gemma 2 and later)
    cap the logits in ``forward`` before calling the loss. The fused forward of
    :func:`apply_packed_loss`, which sees hidden states, applies it.

    Args:
        is_packed: average per sequence (True) or per token (False).
        ignore_index: label value that is not a target.
        label_smoothing: ``eps`` of :func:`packed_ce.cross_entropy`.
        z_loss_scale: weight of ``logsumexp**2`` in each token's loss.
        inplace_backward: let the backward overwrite the returned ``outputs.logits`` with their
            gradient (saves one ``(N, V)`` buffer; only when nothing reads the logits after the
            backward, and not with a model that soft-caps its logits, whose ``tanh`` backward
            reads them).
        backend: "auto", "triton" or "torch", as in :func:`packed_ce.cross_entropy`.
        validate: check labels and boundaries (on CUDA on the device, without a host sync: see
            :func:`packed_ce.check_pending`).

    A call with the keyword ``packed_ce_token_stats=True`` (:data:`TOKEN_STATS_KEY`, passed to
    ``model(...)``, which hands its extra keywords to the loss) also computes the
    :class:`packed_ce.TokenStats` of its targets in the loss's own pass over the logits and
    keeps them for :meth:`take_token_stats`; so does the fused forward of
    :func:`apply_packed_loss`. They live on this object, which the model holds, so they are
    found the same way under DDP or FSDP wrappers.

    Example:
        >>> loss_fn = PackedCausalLMLoss(is_packed=True)
        >>> logits = torch.zeros(1, 5, 4)                   # uniform: every token loss is log 4
        >>> labels = torch.tensor([[-100, 1, 2, -100, 3]])  # two sequences: tokens 0-2 and 3-4
        >>> loss_fn(logits, labels, 4, cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
        tensor(1.3863)
    """

    def __init__(
        self,
        *,
        is_packed: bool = True,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        inplace_backward: bool = False,
        backend: str = "auto",
        validate: bool = True,
    ):
        self.is_packed = is_packed
        self.ignore_index = ignore_index
        self.options = dict(
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            inplace_backward=inplace_backward,
            backend=backend,
            validate=validate,
        )
        self.token_stats: TokenStats | None = None

    def take_token_stats(self) -> TokenStats | None:
        """The stats of the last call made with :data:`TOKEN_STATS_KEY`, once; then None."""
        stats, self.token_stats = self.token_stats, None
        return stats

    def loss_keywords(
        self,
        labels: torch.Tensor,
        device: torch.device,
        shift_labels: torch.Tensor | None,
        num_items_in_batch: int | torch.Tensor | None,
        kwargs: Mapping[str, Any],
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Targets and keywords of :func:`packed_ce.cross_entropy` for one model call.

        Returns:
            ``(targets, keywords)``: ``labels`` (or ``shift_labels``) on ``device`` and the keyword
            arguments that go with them.
        """
        shift = shift_labels is None
        targets = (labels if shift else shift_labels).to(device)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(device)
        keywords = dict(
            sequence_boundaries(targets, kwargs, is_packed=self.is_packed),
            is_packed=self.is_packed,
            shift=shift,
            ignore_index=self.ignore_index,
            num_items_in_batch=num_items_in_batch,
            **self.options,
        )
        return targets, keywords

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The loss of one forward pass.

        Args:
            logits: ``(B, T, V)`` float32/bfloat16/float16, already soft-capped by the model.
            labels: ``(B, T)`` aligned with ``input_ids``; ``ignore_index`` where not trained.
            vocab_size: unused (``V`` is read from ``logits``); part of transformers' call.
            num_items_in_batch: the normaliser of the whole optimiser step (see
                :func:`count_num_items`); the local count when None.
            shift_labels: ``(B, T)`` labels already shifted (target of ``logits[t]``), or None.
            **kwargs: the model call's extra keywords, read for ``cu_seqlens``,
                ``cu_seq_lens_q``, ``packed_ce_position_ids`` and ``packed_ce_token_stats``;
                the rest is ignored.

        Returns:
            0-d float32 loss.
        """
        targets, keywords = self.loss_keywords(
            labels, logits.device, shift_labels, num_items_in_batch, kwargs
        )
        if not kwargs.get(TOKEN_STATS_KEY):
            return cross_entropy(logits, targets, **keywords)
        loss, self.token_stats = cross_entropy(
            logits, targets, return_token_stats=True, **keywords
        )
        return loss

    def __repr__(self) -> str:
        options = dict(is_packed=self.is_packed, ignore_index=self.ignore_index, **self.options)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"


@dataclass
class _Installation:
    """What :func:`apply_packed_loss` changed on a model, so that it can be undone exactly."""

    loss: PackedCausalLMLoss
    hook: torch.utils.hooks.RemovableHandle
    previous_loss_function: Any
    fused_options: Mapping[str, Any] | None  # None: the model's own forward is kept
    forward: Callable | None
    previous_forward: Any


def _packed_batch_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Keeps every call of a model with the packed loss on the packed objective, or refuses it.

    - ``fused_lm_head=True`` (trl's ``SFTTrainer``) computes trl's own token mean and never calls
      the packed loss: refused, :class:`PackedSFTTrainer` is the fix.
    - A training call from a ``transformers.Trainer`` that does not count the packed normaliser
      (the stock ``Trainer`` divides the per-sequence sums by a token count): refused,
      :class:`PackedTrainer` is the fix.
    - A packed batch (see :func:`_exact_packed_call`) runs without a KV cache and without an
      all-ones ``attention_mask``, either of which would make its sequences attend to each other.
    - ``position_ids`` are handed to the loss when the batch has no ``cu_seqlens``: a causal LM's
      forward consumes them and does not pass them on.
    """
    if kwargs.get("fused_lm_head"):
        raise ValueError(
            "this model has the packed loss (apply_packed_loss), but trl's fused_lm_head=True "
            "computes trl's own token mean and never calls it: train with "
            "packed_ce.integrations.PackedSFTTrainer instead of trl.SFTTrainer"
        )
    if module.training and kwargs.get("labels") is not None:
        _refuse_token_count_trainer()
    kwargs = _exact_packed_call(args, kwargs)
    if kwargs.get("labels") is not None and kwargs.get("position_ids") is not None:
        if kwargs.get("cu_seqlens") is None and kwargs.get("cu_seq_lens_q") is None:
            kwargs[POSITION_IDS_KEY] = kwargs["position_ids"]
    return args, kwargs


def _refuse_token_count_trainer() -> None:
    """Raises when the calling ``transformers.Trainer`` would normalise by a token count.

    The Trainer calls the model from ``compute_loss``; the frames above this one are walked to
    find it (a few dozen frames at most, only for training calls with labels). The packed
    trainers carry ``counts_packed_items = True``.
    """
    if "transformers.trainer" not in sys.modules:
        return
    trainer_class = sys.modules["transformers.trainer"].Trainer
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "compute_loss":
            trainer = frame.f_locals.get("self")
            if isinstance(trainer, trainer_class):
                if getattr(trainer, "counts_packed_items", False):
                    return
                raise ValueError(
                    f"this model has the packed loss (apply_packed_loss), but "
                    f"{type(trainer).__name__} normalises each micro-batch by a token count, so it "
                    "would train on another objective (per-sequence sums over tokens): use "
                    "packed_ce.integrations.PackedTrainer (or PackedSFTTrainer for trl)"
                )
        frame = frame.f_back


def _exact_packed_call(args: tuple, kwargs: dict) -> dict:
    """The keywords of a packed call, changed so that no sequence attends to another.

    A batch is packed when it has ``cu_seqlens`` or ``cu_seq_lens_q`` with a boundary inside a
    row, or ``labels`` and ``position_ids`` that restart inside a row. transformers builds the
    block-diagonal mask of such a row from ``position_ids`` only without an ``attention_mask``
    and without a KV cache; otherwise every token attends to every earlier token of its row
    (a relative loss error of about 2e-3 on Llama and Qwen2, sdpa and eager). So:

    - the cache is turned off (a training or scoring call never reads it back);
    - an ``attention_mask`` of ones, which says nothing, is dropped;
    - an ``attention_mask`` that masks tokens, or a ``past_key_values`` passed in, cannot be
      made exact: ValueError.

    Deciding whether boundaries lie inside rows reads them (one host sync), and only happens
    when an ``attention_mask`` or ``past_key_values`` is passed with them.
    """
    boundaries = kwargs.get("cu_seqlens")
    if boundaries is None:
        boundaries = kwargs.get("cu_seq_lens_q")
    positions = kwargs.get("position_ids") if kwargs.get("labels") is not None else None
    if boundaries is None and positions is None:
        return kwargs
    kwargs = {**kwargs, "use_cache": False}
    mask = kwargs.get("attention_mask")
    if mask is None and kwargs.get("past_key_values") is None:
        return kwargs
    if not _restarts_inside_rows(args, kwargs, boundaries, positions):
        return kwargs
    if kwargs.get("past_key_values") is not None:
        raise ValueError(
            "past_key_values cannot be used with a packed batch (sequence boundaries inside a "
            "row): the cached keys would be attended across sequences"
        )
    if not bool(mask.all()):
        raise ValueError(
            "a packed batch (sequence boundaries inside a row) cannot have an attention_mask that "
            "masks tokens: transformers then ignores the boundaries and lets sequences attend to "
            "each other. Leave attention_mask out and make padding a sequence of its own "
            "(collators.PackedCollator(pad_to_multiple_of=...) does)"
        )
    del kwargs["attention_mask"]
    return kwargs


def _restarts_inside_rows(args, kwargs, boundaries, positions) -> bool:
    """True if a sequence of the batch starts anywhere but at the start of a row."""
    if boundaries is not None:
        tokens = kwargs.get("input_ids")
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        width = tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None
        if width is None:
            return True
        return bool((boundaries.to(torch.int64) % width != 0).any())
    positions = positions.reshape(-1, positions.shape[-1])
    return bool((positions[:, 1:] != positions[:, :-1] + 1).any())


def _check_fusable(model: nn.Module) -> None:
    """Raises unless the fused forward computes exactly what the model's own forward does."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"fused_linear=True needs a model whose output embedding is an nn.Linear, got "
            f"{type(head).__name__} on {type(model).__name__}"
        )
    config = model.config
    for field, reason in _UNFUSABLE_CONFIG_FIELDS.items():
        if getattr(config, field, None) not in (None, 1, 1.0):
            raise ValueError(f"fused_linear=True cannot reproduce {type(model).__name__}: {reason}")
    if getattr(config, "output_router_logits", False):
        raise ValueError(
            f"fused_linear=True cannot reproduce {type(model).__name__}: with "
            "config.output_router_logits the loss includes the router's auxiliary loss"
        )


def _own_forward(model: nn.Module, installation: _Installation) -> Callable:
    """The forward the model had before the fused one was installed."""
    if installation.previous_forward is _MISSING:
        return type(model).forward.__get__(model)
    return installation.previous_forward


def _fused_linear_forward(model: nn.Module, args: tuple, kwargs: dict):
    """The model's forward with the loss from the hidden states, when training with labels.

    In training mode with ``labels`` (passed by keyword) the decoder runs as in the model's own
    forward and the loss comes from :func:`packed_ce.fused_linear_cross_entropy` on its last
    hidden states ``(B, T, H)`` and ``lm_head``, soft-capped by
    ``config.final_logit_softcapping`` if set; the output has ``logits=None``. With the keyword
    ``packed_ce_token_stats=True`` the loss's own :class:`packed_ce.TokenStats` of the targets
    (the logged metrics of :class:`PackedSFTTrainer`) are kept on the model's
    :class:`PackedCausalLMLoss`, as its call on logits does. Every other call runs the model's
    own forward (the keyword then reaches the loss function). Everything is looked up on ``model`` at call time, so a copy
    of the model (``copy.deepcopy``) uses its own modules.
    """
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ..fused_linear import fused_linear_cross_entropy

    installation = model._packed_ce
    kwargs = dict(kwargs)
    labels = kwargs.get("labels")
    if args or labels is None or not model.training:
        return _own_forward(model, installation)(*args, **kwargs)
    want_stats = kwargs.pop(TOKEN_STATS_KEY, False)
    del kwargs["labels"]
    kwargs.pop("logits_to_keep", None)  # no logits are kept: there are none
    return_dict = kwargs.pop("return_dict", None)
    shift_labels = kwargs.pop("shift_labels", None)
    outputs = model.get_decoder()(**kwargs)
    hidden = outputs[0]
    head = model.get_output_embeddings()
    targets, keywords = installation.loss.loss_keywords(
        labels, hidden.device, shift_labels, kwargs.get("num_items_in_batch"), kwargs
    )
    softcap = getattr(model.config, "final_logit_softcapping", None)
    loss = fused_linear_cross_entropy(
        hidden,
        head.weight,
        targets,
        bias=head.bias,
        softcap=softcap,
        return_token_stats=bool(want_stats),
        **keywords,
        **installation.fused_options,
    )
    if want_stats:
        loss, installation.loss.token_stats = loss
    result = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    return result if return_dict is not False else result.to_tuple()


def _make_fused_forward(model: nn.Module) -> Callable:
    """:func:`_fused_linear_forward` bound to ``model``, with the signature of its own forward."""

    # wraps: inspect.signature(model.forward) keeps the original parameters, which the Trainer
    # reads to decide which data set columns to keep and whether the model takes loss keywords.
    @functools.wraps(type(model).forward)
    def forward(self, *args, **kwargs):
        return _fused_linear_forward(self, args, kwargs)

    return forward.__get__(model)


def apply_packed_loss(
    model: nn.Module,
    *,
    is_packed: bool = True,
    fused_linear: bool = False,
    fused_linear_options: Mapping[str, Any] | None = None,
    **options,
) -> nn.Module:
    """Makes ``model(**batch)`` return the packing-aware loss; :func:`remove_packed_loss` undoes it.

    Works for decoder-only transformers models that compute their loss through
    ``self.loss_function`` (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo, ...). Only this model
    instance changes: its ``loss_function`` becomes a :class:`PackedCausalLMLoss`, a forward
    pre-hook hands ``position_ids`` to it, and with ``fused_linear=True`` its ``forward`` is
    replaced by one that, when training with ``labels``, computes the loss from the hidden states
    with :func:`packed_ce.fused_linear_cross_entropy` and returns ``logits=None``: the ``(N, V)``
    logits, the largest activation of fine-tuning, never exist. Calling it again replaces the
    previous installation.

    The batch keys of :class:`collators.PackedCollator` (``cu_seqlens``, ``max_seqlen``,
    ``num_sequences`` and the varlen keywords) can all be passed to ``model(...)``: sdpa and eager
    attention ignore the ones they do not use, flash attention uses ``cu_seq_lens_q/k`` and
    ``max_length_q/k``.

    Args:
        model: a transformers causal LM (``PreTrainedModel``).
        is_packed: average per sequence (True) or per token like transformers (False).
        fused_linear: use the fused linear cross entropy when training with labels. Needs an
            ``nn.Linear`` output embedding and no extra logit scaling in the model's forward;
            honours ``config.final_logit_softcapping``.
        fused_linear_options: extra keywords of :func:`packed_ce.fused_linear_cross_entropy`
            (``grad_accumulation_dtype``, ``chunk_size``).
        **options: the other keywords of :class:`PackedCausalLMLoss` (``ignore_index``,
            ``label_smoothing``, ``z_loss_scale``, ``inplace_backward``, ``backend``, ``validate``).

    Returns:
        ``model``, changed in place.

    Raises:
        TypeError: for an unknown option.
        ValueError: if ``fused_linear=True`` and the model's head cannot be fused, or with
            ``inplace_backward=True`` on a model that soft-caps its logits before the loss.

    Example:
        >>> from collators import PackedCollator
        >>> from packed_ce.integrations import apply_packed_loss
        >>> apply_packed_loss(model, is_packed=True)                  # doctest: +SKIP
        >>> batch = PackedCollator()(examples)                        # doctest: +SKIP
        >>> model(**batch, use_cache=False).loss.backward()           # doctest: +SKIP
    """
    if getattr(model, "_packed_ce", None) is not None:
        remove_packed_loss(model)
    loss = PackedCausalLMLoss(is_packed=is_packed, **options)
    if fused_linear:
        _check_fusable(model)
    elif loss.options["inplace_backward"] and getattr(
        model.config, "final_logit_softcapping", None
    ):
        # the capped logits are tanh's output, which its backward reads: writing the loss
        # gradient into them would silently corrupt every gradient upstream
        raise ValueError(
            "inplace_backward=True cannot be used with config.final_logit_softcapping; use "
            "fused_linear=True, which applies the softcap inside the fused loss"
        )
    installation = _Installation(
        loss=loss,
        hook=model.register_forward_pre_hook(_packed_batch_pre_hook, with_kwargs=True),
        previous_loss_function=model.__dict__.get("_loss_function", _MISSING),
        fused_options=dict(fused_linear_options or {}) if fused_linear else None,
        forward=_make_fused_forward(model) if fused_linear else None,
        previous_forward=model.__dict__.get("forward", _MISSING),
    )
    model.loss_function = loss
    if installation.forward is not None:
        model.forward = installation.forward
    model._packed_ce = installation
    return model


def remove_packed_loss(model: nn.Module) -> nn.Module:
    """Undoes :func:`apply_packed_loss`: the model's loss function, hooks and forward are as before.

    Args:
        model: a model given to :func:`apply_packed_loss`.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: if the packed loss is not installed on ``model``.
        RuntimeError: if ``model.forward`` was replaced again after the fused forward was installed
            (restoring would drop that later change).
    """
    installation = getattr(model, "_packed_ce", None)
    if installation is None:
        raise ValueError(f"the packed loss is not installed on this {type(model).__name__}")
    if installation.forward is not None:
        if model.__dict__.get("forward") is not installation.forward:
            raise RuntimeError(
                "model.forward was replaced after apply_packed_loss(..., fused_linear=True); undo "
                "that change first"
            )
        if installation.previous_forward is _MISSING:
            del model.forward
        else:
            model.forward = installation.previous_forward
    installation.hook.remove()
    if installation.previous_loss_function is _MISSING:
        del model._loss_function
    else:
        model._loss_function = installation.previous_loss_function
    del model._packed_ce
    return model


def packed_loss_of(model: nn.Module) -> PackedCausalLMLoss | None:
    """The :class:`PackedCausalLMLoss` installed on ``model`` (unwrapped from DDP), or None."""
    installation = installation_of(model)
    return None if installation is None else installation.loss


def installation_of(model: nn.Module) -> _Installation | None:
    """What :func:`apply_packed_loss` installed on ``model`` (unwrapped from DDP), or None."""
    return getattr(getattr(model, "module", model), "_packed_ce", None)


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
        all_reduce: sum over processes when ``torch.distributed`` is initialised.
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
    return total


def _count_items(batch: Mapping[str, Any], *, is_packed: bool, shift: bool, ignore_index: int):
    """What the loss of one batch divides by (:func:`packed_ce.count_normaliser`), 0-d."""
    labels = batch.get("shift_labels")
    if labels is None:
        labels = batch["labels"]
    else:
        shift = False  # already shifted
    options = LossOptions(is_packed=is_packed, shift=shift, ignore_index=ignore_index)
    return count_normaliser(
        labels, options=options, **sequence_boundaries(labels, batch, is_packed=is_packed)
    )
