"""The packed loss as the loss function of a transformers causal LM.

transformers computes a causal LM's loss inside ``forward`` as ``self.loss_function(logits,
labels, vocab_size, **kwargs)``, where ``kwargs`` are the extra keywords of the ``model(...)``
call (every key of a :class:`collators.PackedCollator` batch other than ``input_ids``, ``labels``
and ``position_ids``, plus ``num_items_in_batch`` from the Trainer).
``PreTrainedModel.loss_function`` is a property whose setter stores an instance attribute, so one
model instance can get its own loss without touching the class:

- :func:`apply_packed_loss` (this file) installs a :class:`PackedCausalLMLoss` (``loss.py``) on
  one model, a forward pre-hook (``hooks.py``) that hands ``position_ids`` to it (the model
  consumes them and does not pass them on) and keeps packed calls exact, and optionally a forward
  (``fused_forward.py``) that computes the loss from the hidden states with
  :func:`packed_ce.fused_linear_cross_entropy`;
- :func:`remove_packed_loss` (this file) undoes all three exactly;
- :func:`count_num_items` (``batch.py``) is the normaliser of one optimiser step over
  micro-batches and processes.

Sequence boundaries are read, in this order, from ``cu_seqlens`` (:class:`collators.PackedCollator`,
:class:`collators.PaddedCollator`), ``cu_seq_lens_q`` (transformers' flash-attention varlen
keywords, e.g. ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``), ``position_ids``
(padding-free batches); without any of them every row of ``labels`` is one sequence, which is also
what the model's attention assumes then (:func:`sequence_boundaries`, ``batch.py``).

Nothing here imports ``datasets``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .fused_forward import _MISSING, _check_fusable, _make_fused_forward
from .hooks import _packed_batch_pre_hook
from .loss import TOKEN_STATS_KEY, PackedCausalLMLoss  # noqa: F401 (TOKEN_STATS_KEY: re-exported)


@dataclass
class _Installation:
    """What :func:`apply_packed_loss` changed on a model, so that it can be undone exactly."""

    loss: PackedCausalLMLoss
    hook: torch.utils.hooks.RemovableHandle
    previous_loss_function: Any
    fused_options: Mapping[str, Any] | None  # None: the model's own forward is kept
    forward: Callable | None
    previous_forward: Any


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
