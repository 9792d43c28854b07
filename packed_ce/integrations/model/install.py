"""The packed loss as the loss function of one transformers causal LM instance.

transformers computes the loss inside ``forward`` as ``self.loss_function(logits, labels,
vocab_size, **kwargs)`` with the call's extra keywords; ``loss_function`` is a property whose
setter stores an instance attribute, so one model gets its own loss without touching the class.
:func:`apply_packed_loss` installs a :class:`PackedCausalLMLoss` (``loss.py``) and a forward
(``forward.py``) that checks every call (``guards.py``) and per-conversation rotary embeddings
where their frequencies depend on the call (``rotary.py``), recorded in ``installation.py``;
:func:`remove_packed_loss` undoes it exactly. Its first call imports ``transformers.trainer``
(seconds): every Trainer created after it refuses a model with the packed loss unless it is a
packed one (``other_trainers.py``).
"""

from __future__ import annotations

import functools

from torch import nn

from ...options import ChunkOptions
from . import mixers, rotary
from .audit import decoder_layers
from .forward import PackedForward, fusable_reason, refuse_bypass
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

    For decoder-only models whose loss goes through ``self.loss_function`` (Llama, Mistral,
    Qwen2/3, Gemma 1-3, Phi-3, OLMo, Mixtral, ...), or a PEFT model of one, before or after
    wrapping. Only that instance changes: its ``loss_function`` becomes a
    :class:`PackedCausalLMLoss` and its ``forward`` checks every call first (no KV cache or
    all-ones ``attention_mask`` on a packed batch, a token-mean trainer refused). With
    ``fused_linear=True`` a training call with ``labels`` takes the loss from the hidden states
    (:func:`packed_ce.fused_linear_cross_entropy`) and returns ``logits=None``. Calling it again
    replaces the previous installation. Every key of a :class:`collators.PackedCollator` batch
    can be passed to ``model(...)``: attention ignores those it does not use.

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
    elif loss.options.inplace_backward and getattr(target.config, "final_logit_softcapping", None):
        # tanh's backward reads its output, the capped logits: overwritten, every gradient
        # upstream would be silently wrong
        raise ValueError(
            "inplace_backward=True cannot be used with config.final_logit_softcapping; use "
            "fused_linear=True, which applies the softcap inside the fused loss"
        )
    chunk_options = fused_linear_options if fused_linear_options is not None else ChunkOptions()
    installation = Installation(
        loss=loss,
        fused_options=vars(chunk_options).copy() if fused_linear else None,
        forward=PackedForward(target),
        previous_loss_function=target.__dict__.get("_loss_function", MISSING),
        previous_forward=target.__dict__.get("forward", MISSING),
    )
    target.loss_function = loss
    target.forward = installation.forward
    if hasattr(target, "get_decoder"):
        installation.decoder_hook = target.get_decoder().register_forward_pre_hook(
            functools.partial(refuse_bypass, target), with_kwargs=True
        )
    installation.rotary_hooks = rotary.install(target)
    installation.mixers = mixers.install(target, [layer for _, layer in decoder_layers(target)])
    target._packed_ce = installation
    from .other_trainers import refuse_in_other_trainers  # imports transformers.Trainer: seconds

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
    for hook in installation.rotary_hooks:
        hook.remove()
    mixers.uninstall(installation.mixers, [layer for _, layer in decoder_layers(target)])
    if installation.previous_loss_function is MISSING:
        del target._loss_function
    else:
        target._loss_function = installation.previous_loss_function
    del target._packed_ce
    return model
