"""The forward :func:`apply_packed_loss` installs: the packed-batch checks, then the model's own
forward, or the loss from the hidden states without the ``(N, V)`` logits.

The checks run inside ``forward`` rather than in a module hook because a PEFT adapter calls the
base model's ``forward`` directly (``self.model.forward(...)``), past the hooks of its
``__call__``: inside ``forward`` they run whoever calls it.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Callable

import torch
from torch import nn

from packed_ce.columns import LABELS, LAYOUT, POSITION_IDS, ROW_LAYOUT, SHIFT_LABELS

from .audit import start_audit
from .families import UNFUSABLE_CONFIG_FIELDS
from .guards import checked_call, refuse_shard, refuse_zero_embedding_tokens
from .installation import CONTEXT_PARALLEL, MISSING, Installation
from .loss import SEQ_LOSSES_KEY, TOKEN_STATS_KEY
from .rotary import with_row_positions
from .vision import decoder_forward, exact_calls


def fusable_reason(model: nn.Module) -> str | None:
    """Why the fused linear cross entropy cannot reproduce ``model``'s loss, or None if it can.

    Args:
        model: a transformers causal LM (the base model, not a PEFT or DDP wrapper).

    Returns:
        None for a plain ``nn.Linear`` head (not a LoRA-wrapped one) with nothing but the final
        softcap after it; else the reason, for a message.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return (
            f"fused_linear=True needs a model whose output embedding is an nn.Linear, got "
            f"{type(head).__name__} on {type(model).__name__}"
        )
    config = model.config
    for field, reason in UNFUSABLE_CONFIG_FIELDS.items():
        if getattr(config, field, None) not in (None, 1, 1.0):
            return f"fused_linear=True cannot reproduce {type(model).__name__}: {reason}"
    if getattr(config, "output_router_logits", False):
        return (
            f"fused_linear=True cannot reproduce {type(model).__name__}: with "
            "config.output_router_logits the loss includes the router's auxiliary loss"
        )
    return None


def _own_forward(model: nn.Module, installation: Installation) -> Callable:
    """The forward the model had before the packed one was installed."""
    if installation.previous_forward is MISSING:
        return type(model).forward.__get__(model)
    return installation.previous_forward


# The packed forwards running in this thread (a depth: a forward may call another model's):
# the decoder's pre-hook tells a pass through the installed forward from one past it by this.
_running = threading.local()


def refuse_bypass(model: nn.Module, decoder: nn.Module, args: tuple, kwargs: dict) -> None:
    """The decoder's forward pre-hook: refuses a training pass that skips the packed loss.

    trl's ``fused_lm_head=True`` wraps the installed forward and runs the decoder and its own token
    mean (past every check around a PEFT adapter). Such a pass is told by what it is: the decoder
    trains with gradients, no packed forward runs in this thread, and ``model.forward`` is no
    longer the installed one.
    """
    if not decoder.training or not torch.is_grad_enabled() or getattr(_running, "depth", 0):
        return
    if model.__dict__.get("forward") is model._packed_ce.forward:
        return
    raise ValueError(
        "this model has the packed loss (apply_packed_loss), but a wrapper of its forward (trl's "
        "fused_lm_head=True) runs its decoder and computes its own token mean without calling "
        "the packed loss: train with packed_ce.integrations.PackedSFTTrainer instead of "
        "trl.SFTTrainer (a decoder called directly for another purpose: under torch.no_grad() "
        "or in eval mode)"
    )


def _plain(tensor: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """``tensor`` as the plain tensor the kernels take, where FSDP2 hands over a ``DTensor``.

    Under FSDP2 around a PEFT model, the head's gathered weight is a ``DTensor`` whose every
    placement is ``Replicate`` while the hidden states are plain (the adapters' dtype casts drop
    the ``DTensor``): the mixed matmul raised "got mixed torch.Tensor and DTensor". Its local
    tensor is then the whole tensor, and ``to_local`` passes the gradient back unchanged. A frozen
    weight still sharded is gathered whole (no gradient to return); a trainable one is refused:
    its gradient would skip FSDP's reduce-scatter.
    """
    if not torch.distributed.is_available():  # a torch built without it has no DTensor
        return tensor
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return tensor
    if all(placement.is_replicate() for placement in tensor.placements):
        return tensor.to_local()
    if not tensor.requires_grad:
        return tensor.full_tensor()
    raise ValueError(
        f"fused_linear=True: the output head's {name} is still sharded (placements "
        f"{tensor.placements}) when the loss reads it, and its gradient would not be reduced "
        "by FSDP: keep the head gathered through the forward (FSDP2: shard it in one group with "
        "the final norm, as accelerate does), or apply_packed_loss(model, fused_linear=False)"
    )


def _fused_linear_forward(model: nn.Module, installation: Installation, kwargs: dict):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from ...fused_linear import fused_linear_call
    from ...options import split_keywords

    kwargs = dict(kwargs)
    labels = kwargs.pop(LABELS)
    want_stats = bool(kwargs.pop(TOKEN_STATS_KEY, False))
    want_seq = bool(kwargs.pop(SEQ_LOSSES_KEY, False))
    kwargs.pop("logits_to_keep", None)  # no logits are kept: there are none
    return_dict = kwargs.pop("return_dict", None)
    shift_labels = kwargs.pop(SHIFT_LABELS, None)
    outputs = decoder_forward(model)(**kwargs)
    hidden = outputs[0]
    head = model.get_output_embeddings()
    targets, boundaries, options = installation.loss.loss_inputs(
        labels, hidden.device, shift_labels, kwargs.get("num_items_in_batch"), kwargs
    )
    keywords = dict(
        softcap=getattr(model.config, "final_logit_softcapping", None),
        return_token_stats=want_stats,
        return_seq_losses=want_seq,
        **installation.fused_options,
    )
    options, chunk_options = split_keywords(keywords, options, chunked=True)
    result = fused_linear_call(
        _plain(hidden, "hidden states"),
        _plain(head.weight, "weight"),
        targets,
        _plain(head.bias, "bias"),
        boundaries,
        options,
        chunk_options,
    )
    loss = installation.loss.keep_metrics(result, want_stats, want_seq)
    output = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )
    return output if return_dict is not False else output.to_tuple()


def prepared(installation: Installation, args: tuple, kwargs: dict) -> dict:
    """A call's keywords as the model's own forward gets them: checked (:func:`checked_call`,
    which lays the call out); a packed call without ``position_ids`` (``cu_seqlens`` only) with
    its conversations' (what transformers' masks and rotary embeddings follow); a hybrid family's
    packed call with the keywords its mixers' kernels read from the layout (``seq_idx``, and for
    one row the varlen keywords); a padded call with each row's own positions where rotary
    embeddings depend on the call.
    """
    kwargs = checked_call(args, kwargs)
    layout = kwargs.get(LAYOUT)
    if layout is not None and layout.packed and kwargs.get(POSITION_IDS) is None:
        if POSITION_IDS in inspect.signature(installation.forward).parameters:
            kwargs = {**kwargs, POSITION_IDS: layout.position_ids}
    if installation.mixers and layout is not None and layout.packed and ROW_LAYOUT not in kwargs:
        kwargs = {**kwargs, **layout.row_keywords()}
    if installation.rotary_hooks:
        kwargs = with_row_positions(kwargs)
    return kwargs


class PackedForward:
    """``model``'s forward on a checked call, with the signature of its own forward; the loss from
    the hidden states where fused.

    The call is made exact or refused (context parallelism's ``prepare``, then
    :func:`checked_call`; the first packed call of each attention implementation also by
    :func:`start_audit`). Fused, training, with ``labels``: the decoder runs and the loss comes
    from :func:`packed_ce.fused_linear_cross_entropy` on its ``(B, T, H)`` hidden states and
    ``lm_head`` (soft-capped by ``final_logit_softcapping``), ``logits=None``; else the model's own
    forward.

    An object holding its model rather than a closure, so that ``copy.deepcopy`` and ``pickle`` of
    the model (EMA and reference models, ``torch.save``) give a model whose forward is its own:
    everything is looked up on ``self.model`` at call time.
    """

    def __init__(self, model: nn.Module):
        self.model = model

    @property
    def __signature__(self) -> inspect.Signature:
        # the model's own parameters, which the Trainer reads to decide which data set columns to
        # keep and whether the model takes loss keywords
        return inspect.signature(type(self.model).forward.__get__(self.model))

    def __call__(self, *args, **kwargs):
        model = self.model
        installation = model._packed_ce
        context_parallel = getattr(model, CONTEXT_PARALLEL, None)  # enable_context_parallel's
        if context_parallel is None:
            refuse_shard(model, kwargs)
        else:
            kwargs = context_parallel.prepare(model, kwargs)
        kwargs = prepared(installation, args, kwargs)
        refuse_zero_embedding_tokens(model, kwargs, context_parallel)
        labels = kwargs.get(LABELS)
        fused = installation.fused_options is not None
        fused = fused and not args and labels is not None and model.training
        _running.depth = getattr(_running, "depth", 0) + 1
        try:
            own = exact_calls(model, _own_forward(model, installation))
            calls = installation.loss.calls
            prepare = functools.partial(prepared, installation)
            with start_audit(model, installation, args, kwargs, own, prepare):
                if fused:  # the loss from the hidden states, past the model's loss_function
                    output = _fused_linear_forward(model, installation, kwargs)
                else:
                    output = own(*args, **kwargs)
            if context_parallel is not None:
                context_parallel.finish(model, kwargs)
        finally:
            _running.depth -= 1
        if labels is not None and not fused and installation.loss.calls == calls:
            raise ValueError(
                f"{type(model).__name__} (model_type={model.config.model_type!r}) computed its "
                "loss without calling its loss_function, so apply_packed_loss cannot change it: "
                "compute the loss from its logits with packed_ce.cross_entropy(..., "
                "is_packed=True, shift=True) and call it without labels"
            )
        return output
