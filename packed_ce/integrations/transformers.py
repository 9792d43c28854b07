"""The packed loss as the loss function of a transformers causal LM.

transformers computes a causal LM's loss inside ``forward`` as ``self.loss_function(logits,
labels, vocab_size, **kwargs)``, where ``kwargs`` are the extra keywords of the ``model(...)``
call (every key of a :class:`collators.PackedCollator` batch other than ``input_ids``, ``labels``
and ``position_ids``, plus ``num_items_in_batch`` from the Trainer).
``PreTrainedModel.loss_function`` is a property whose setter stores an instance attribute, so one
model instance can get its own loss without touching the class:

- :func:`apply_packed_loss` (this file) installs a :class:`PackedCausalLMLoss` (``loss.py``) on
  one model and a forward (``forward.py``) that keeps every call exact (``guards.py``),
  hands ``position_ids`` to the loss (the model consumes them and does not pass them on) and,
  optionally, computes the loss from the hidden states with
  :func:`packed_ce.fused_linear_cross_entropy`; what it changed is recorded
  (``installation.py``);
- :func:`remove_packed_loss` (this file) undoes it exactly;
- :func:`count_num_items` (``batch.py``) is the normaliser of one optimiser step over
  micro-batches and processes.

Sequence boundaries are read, in this order, from ``cu_seqlens`` (:class:`collators.PackedCollator`,
:class:`collators.PaddedCollator`), ``cu_seq_lens_q`` (transformers' flash-attention varlen
keywords, e.g. ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), ``position_ids``
(padding-free batches); without any of them every row of ``labels`` is one sequence, which is also
what the model's attention assumes then (:func:`sequence_boundaries`, ``batch.py``).

The first :func:`apply_packed_loss` of a process imports ``transformers.trainer`` (seconds):
every Trainer created after it refuses a model with the packed loss unless it is a packed one
(``seams.py``).
"""

from __future__ import annotations

import functools

from torch import nn

from ..options import ChunkOptions
from .forward import fusable_reason, make_forward, refuse_bypass
from .installation import MISSING, Installation, base_model
from .loss import PackedCausalLMLoss


def apply_packed_loss(
    model: nn.Module,
    *,
    is_packed: bool = True,
    fused_linear: bool = False,
    fused_linear_options: ChunkOptions | None = None,
    **options,
) -> nn.Module:
    """Makes ``model(**batch)`` return the packing-aware loss; :func:`remove_packed_loss` undoes it.

    Works for decoder-only transformers models that compute their loss through
    ``self.loss_function`` (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo, Mixtral, ...), and
    for a PEFT model wrapping one (``get_peft_model(model, LoraConfig(...))``), before or after
    wrapping: the loss goes on the transformers model inside. Only that model instance changes:
    its ``loss_function`` becomes a :class:`PackedCausalLMLoss` and its ``forward`` one that
    checks every call (a packed batch runs without KV cache or all-ones ``attention_mask``,
    ``position_ids`` reach the loss, a trainer that would normalise by a token count is refused)
    before running the model's own. With ``fused_linear=True`` that forward, when training with
    ``labels``, computes the loss from the hidden states with
    :func:`packed_ce.fused_linear_cross_entropy` and returns ``logits=None``: the ``(N, V)``
    logits, the largest activation of fine-tuning, never exist. Calling it again replaces the
    previous installation.

    The batch keys of :class:`collators.PackedCollator` (``cu_seqlens``, ``max_seqlen``,
    ``num_sequences`` and the varlen keywords) can all be passed to ``model(...)``: sdpa and eager
    attention ignore the ones they do not use, flash attention uses ``cu_seq_lens_q/k`` and
    ``max_length_q/k``.

    Args:
        model: a transformers causal LM (``PreTrainedModel``), or a PEFT model of one.
        is_packed: average per sequence (True) or per token like transformers (False).
        fused_linear: use the fused linear cross entropy when training with labels. Needs a plain
            ``nn.Linear`` output embedding (not one a LoRA adapter wraps) and no extra logit
            scaling in the model's forward (:func:`fusable_reason`); honours
            ``config.final_logit_softcapping``.
        fused_linear_options: a :class:`packed_ce.ChunkOptions` for the fused loss
            (``grad_accumulation_dtype``, ``chunk_size``, ``drop_ignored_rows``).
        **options: the other keywords of :class:`PackedCausalLMLoss` (``ignore_index``,
            ``label_smoothing``, ``z_loss_scale``, ``inplace_backward``, ``backend``, ``validate``).

    Returns:
        ``model``, changed in place.

    Raises:
        TypeError: for an unknown option, or ``fused_linear_options`` that are not a
            ``ChunkOptions``.
        ValueError: if ``fused_linear=True`` and the model's head cannot be fused, or with
            ``inplace_backward=True`` on a model that soft-caps its logits before the loss.

    Example:
        >>> from collators import PackedCollator
        >>> from packed_ce.integrations import apply_packed_loss
        >>> apply_packed_loss(model, is_packed=True)                  # doctest: +SKIP
        >>> batch = PackedCollator()(examples)                        # doctest: +SKIP
        >>> model(**batch, use_cache=False).loss.backward()           # doctest: +SKIP
    """
    target = base_model(model)
    if fused_linear_options is not None and not isinstance(fused_linear_options, ChunkOptions):
        raise TypeError(
            "fused_linear_options must be a packed_ce.ChunkOptions, got "
            f"{type(fused_linear_options).__name__}: pass ChunkOptions(chunk_size=...)"
        )
    if getattr(target, "_packed_ce", None) is not None:
        remove_packed_loss(target)
    loss = PackedCausalLMLoss(is_packed=is_packed, **options)
    if fused_linear:
        reason = fusable_reason(target)
        if reason is not None:
            raise ValueError(reason)
    elif loss.options.inplace_backward and getattr(
        target.config, "final_logit_softcapping", None
    ):
        # the capped logits are tanh's output, which its backward reads: writing the loss
        # gradient into them would silently corrupt every gradient upstream
        raise ValueError(
            "inplace_backward=True cannot be used with config.final_logit_softcapping; use "
            "fused_linear=True, which applies the softcap inside the fused loss"
        )
    chunk_options = fused_linear_options if fused_linear_options is not None else ChunkOptions()
    installation = Installation(
        loss=loss,
        fused_options=vars(chunk_options).copy() if fused_linear else None,
        forward=make_forward(target),
        previous_loss_function=target.__dict__.get("_loss_function", MISSING),
        previous_forward=target.__dict__.get("forward", MISSING),
    )
    target.loss_function = loss
    target.forward = installation.forward
    if hasattr(target, "get_decoder"):
        installation.decoder_hook = target.get_decoder().register_forward_pre_hook(
            functools.partial(refuse_bypass, target), with_kwargs=True
        )
    target._packed_ce = installation
    from .seams import refuse_in_other_trainers  # imports transformers.Trainer: seconds, once

    refuse_in_other_trainers()
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
    target = base_model(model)
    installation = getattr(target, "_packed_ce", None)
    if installation is None:
        raise ValueError(f"the packed loss is not installed on this {type(model).__name__}")
    if target.__dict__.get("forward") is not installation.forward:
        raise RuntimeError(
            "model.forward was replaced after apply_packed_loss; undo that change first"
        )
    if installation.previous_forward is MISSING:
        del target.forward
    else:
        target.forward = installation.previous_forward
    if installation.decoder_hook is not None:
        installation.decoder_hook.remove()
    if installation.previous_loss_function is MISSING:
        del target._loss_function
    else:
        target._loss_function = installation.previous_loss_function
    del target._packed_ce
    return model
