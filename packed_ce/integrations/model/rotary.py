"""Rotary embeddings whose frequencies depend on the call, computed per conversation when packed.

transformers' ``dynamic_rope_update`` picks a rotary embedding's frequencies from the longest
position of the call, ``max(position_ids) + 1``: rope types ``"longrope"`` (Phi-3/3.5/4-mini: the
long factors past ``original_max_position_embeddings``) and ``"dynamic"`` (NTK scaling past the
trained length). Packed, that is the longest conversation of the row, so a short conversation
beside a long one got other frequencies than alone. :func:`install` puts a forward hook on every
such module that, on a packed call (``position_ids`` restarting inside a row), recomputes the
embeddings per conversation length ``L``: the module's own forward on the positions of the
conversations of length ``L``, whose longest position is ``L - 1``, as each is alone. Lengths go in
ascending order after a call on one position, so that ``"dynamic"`` starts from its trained
frequencies and grows as for each conversation alone in a fresh model (its cache otherwise keeps the
longest length it saw). A padded call (an ``attention_mask`` with padding, no ``position_ids``)
has one row's positions for every row, so each row took the longest row's frequencies: such a
call gets each row's own positions (:func:`with_row_positions`), its padding a conversation of its
own.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from packed_ce.layout import PackedLayout


def batch_dependent(module: nn.Module) -> bool:
    """Whether ``module`` is a rotary embedding whose forward chooses its frequencies from the
    call's longest position (transformers' ``dynamic_rope_update`` condition, per layer type).
    """
    rope_type = getattr(module, "rope_type", None)
    types = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return any(isinstance(t, str) and ("dynamic" in t or t == "longrope") for t in types)


def install(model: nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
    """Hooks :func:`per_conversation` on every batch-dependent rotary embedding of ``model``."""
    return [
        module.register_forward_hook(per_conversation, with_kwargs=True)
        for module in model.modules()
        if batch_dependent(module)
    ]


def with_row_positions(kwargs: dict) -> dict:
    """A padded call's keywords with ``position_ids`` ``(B, T)``: each row's real tokens counted
    from 0 (left padding too), each padding token at 0, a conversation of one token.
    """
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or not isinstance(mask, torch.Tensor):
        return kwargs
    if mask.dim() != 2 or bool(mask.all()):
        return kwargs
    real = mask.to(torch.int64)
    return {**kwargs, "position_ids": ((real.cumsum(-1) - 1) * real).clamp_min(0)}


def per_conversation(module: nn.Module, args: tuple, kwargs: dict, output):
    """The forward hook: ``output`` recomputed per conversation length on a packed call (a row
    holding more than one conversation), else None (the call's own output stands).

    Every packed call starts from the trained frequencies, whatever an earlier call left on the
    module (a call whose conversations all have one length took the frequencies of the last
    call's longest conversation: 7.4e-3 in the logits of a tiny Llama with ``"dynamic"``).
    """
    bound = _signature(type(module)).bind(module, *args, **kwargs).arguments
    x, position_ids = bound.get("x"), bound.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    if not isinstance(output, (tuple, list)) or not all(
        isinstance(t, torch.Tensor) and t.shape[:2] == position_ids.shape for t in output
    ):
        return None
    layout = PackedLayout.of_call({"position_ids": position_ids}, tuple(position_ids.shape))
    if not layout.packed:
        return None
    # each token's conversation's max(position) + 1: what dynamic_rope_update reads alone
    conversation = layout.token_conversation.reshape(-1)
    longest = torch.zeros(layout.num_conversations, dtype=torch.int64, device=layout.device)
    longest.scatter_reduce_(0, conversation, position_ids.reshape(-1).to(torch.int64), "amax")
    lengths = (longest[conversation] + 1).view(position_ids.shape)
    extra = {key: value for key, value in bound.items() if key not in ("self", "x", "position_ids")}
    module.forward(x, position_ids[:1, :1] * 0, **extra)  # "dynamic": back to trained frequencies
    tables = [t.clone() for t in output]
    for length in torch.unique(lengths).tolist():  # ascending, as for each alone in a fresh model
        chosen = lengths == length
        pieces = module.forward(x, position_ids[chosen][None], **extra)  # (1, n, D) each
        for table, piece in zip(tables, pieces):
            table[chosen] = piece[0]
    return type(output)(tables)


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)
