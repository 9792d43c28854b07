"""The fused forward: a causal LM's loss from its hidden states, without the ``(N, V)`` logits."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from torch import nn

from .loss import TOKEN_STATS_KEY

if TYPE_CHECKING:
    from .transformers import _Installation

# Configuration fields with which a causal LM's forward does more than ``lm_head`` (plus the final
# softcap) between the hidden states and the loss: the fused forward would silently drop it.
_UNFUSABLE_CONFIG_FIELDS = {
    "logit_scale": "the logits are multiplied by config.logit_scale",
    "logits_scaling": "the logits are divided by config.logits_scaling",
}

# What _Installation records for an attribute the model did not have in its own __dict__.
_MISSING = object()


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
