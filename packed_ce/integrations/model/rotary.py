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


def conversation_lengths(position_ids: torch.Tensor) -> torch.Tensor:
    """``(B, T)`` int64: the length of each token's conversation, ``max(position) + 1`` over it
    (a conversation is where ``position_ids`` run on by one: transformers' rule).
    """
    rows, width = position_ids.shape
    positions = position_ids.to(torch.int64)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    segments = starts.reshape(-1).cumsum(0) - 1  # (B T,) conversation of each token
    longest = torch.zeros(int(segments[-1]) + 1, dtype=torch.int64, device=positions.device)
    longest.scatter_reduce_(0, segments, positions.reshape(-1), reduce="amax")
    return (longest[segments] + 1).view(rows, width)


def per_conversation(module: nn.Module, args: tuple, kwargs: dict, output):
    """The forward hook: ``output`` recomputed per conversation length on a packed call, else
    None (the call's own output stands).
    """
    bound = _signature(type(module)).bind(module, *args, **kwargs).arguments
    x, position_ids = bound.get("x"), bound.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
        return None
    if not isinstance(output, (tuple, list)) or not all(
        isinstance(t, torch.Tensor) and t.shape[:2] == position_ids.shape for t in output
    ):
        return None
    lengths = conversation_lengths(position_ids)
    distinct = torch.unique(lengths).tolist()  # one host sync, as the module's own update makes
    if len(distinct) == 1:
        return None
    extra = {key: value for key, value in bound.items() if key not in ("self", "x", "position_ids")}
    module.forward(x, position_ids[:1, :1] * 0, **extra)  # "dynamic": back to trained frequencies
    tables = [t.clone() for t in output]
    for length in distinct:
        chosen = lengths == length
        pieces = module.forward(x, position_ids[chosen][None], **extra)  # (1, n, D) each
        for table, piece in zip(tables, pieces):
            table[chosen] = piece[0]
    return type(output)(tables)


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)
