"""What :func:`apply_packed_loss` changes on a model, and how to find it again.

It lives on the transformers model (``model._packed_ce``), found through DDP / FSDP and PEFT
wrappers.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .loss import PackedCausalLMLoss

# Where enable_context_parallel keeps its state on the model: the one hook through which the packed
# forward reaches context parallelism (its ``prepare`` before the model's own forward, ``finish``
# after), without importing it.
CONTEXT_PARALLEL = "_packed_ce_context_parallel"


class _Missing(enum.Enum):
    """What Installation records for an attribute the model did not have in its own __dict__: an
    enum member, so that ``copy.deepcopy`` and ``pickle`` of a model keep it the same object (a
    plain ``object()`` sentinel became another one in the copy, which then called it).
    """

    MISSING = "missing"


MISSING = _Missing.MISSING


@dataclass
class Installation:
    """What :func:`apply_packed_loss` changed on a model, so that it can be undone exactly.

    Attributes:
        loss: the model's loss function now.
        fused_options: keywords of :func:`packed_ce.fused_linear_cross_entropy` when the loss is
            computed from the hidden states; None when it runs on the model's logits.
        forward: the forward installed on the model (the packed-batch checks, then the model's
            own forward or the fused one).
        previous_loss_function, previous_forward: the model's own attributes before, or
            :data:`MISSING`.
        decoder_hook: the decoder's pre-hook that refuses a training pass past the installed
            forward (:func:`refuse_bypass`).
        rotary_hooks: the forward hooks that compute batch-dependent rotary embeddings per
            conversation (``rotary.py``).
        mixers: the token mixers run per conversation and the decoder layers' hooks
            (``mixers.py``); empty for a family without mixers.
        audited: the attention implementations whose first packed call kept every conversation
            apart (``audit.py``).
    """

    loss: PackedCausalLMLoss
    fused_options: dict[str, Any] | None
    forward: Callable
    previous_loss_function: Any
    previous_forward: Any
    decoder_hook: torch.utils.hooks.RemovableHandle | None = None
    rotary_hooks: list[torch.utils.hooks.RemovableHandle] = field(default_factory=list)
    mixers: list = field(default_factory=list)
    audited: set[str] = field(default_factory=set)


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside data-parallel wrappers and a PEFT adapter."""
    model = getattr(model, "module", model)  # DDP, FSDP1
    if "peft" in sys.modules:
        from peft import PeftModel

        if isinstance(model, PeftModel):
            return model.get_base_model()
    return model


def installation_of(model: nn.Module) -> Installation | None:
    """What :func:`apply_packed_loss` installed on ``model`` (or the model it wraps), or None."""
    return getattr(base_model(model), "_packed_ce", None)


def packed_loss_of(model: nn.Module) -> PackedCausalLMLoss | None:
    """The :class:`PackedCausalLMLoss` installed on ``model`` (or the model it wraps), or None."""
    installation = installation_of(model)
    return None if installation is None else installation.loss
