"""The attention of a context-parallel layer: this rank's queries over the whole row's keys.

Registered once with transformers' attention interface under :data:`ATTENTION_NAME`; it holds no
state: the row's :class:`~.layout.RowLayout` comes with each call (:data:`ROW_LAYOUT`). The keys and
values stream around the ranks (``ring.py``): no rank holds the whole row's. What a family asks of
its attention is done exactly or refused: sliding windows (the plan and the masks), an attention
logit softcap (Gemma 2: ``softcap * tanh(s / softcap)`` on each score), attention sinks (gpt-oss:
a per-head logit in the softmax's denominator only), grouped key heads, dropout (refused).
"""

from __future__ import annotations

import torch
from torch import nn

from packed_ce.columns import ROW_LAYOUT

from ..model.families import DROPOUT_FIELDS
from .ring import ring_attention

ATTENTION_NAME = "packed_ce_context_parallel"


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head from attention without:
    ``p_k = e^{s_k} / (Z + e^{sink})`` is ``e^{s_k} / Z`` times
    ``Z / (Z + e^{sink}) = sigmoid(lse - sink)``.

    Args:
        out: ``(1, Hq, L, D)`` attention output without sinks. lse: ``(1, Hq, L)``,
            natural-log ``logsumexp`` of the scaled scores, in out's dtype. sinks: ``(Hq,)``.
    """
    keep = torch.sigmoid(lse - sinks.to(lse.dtype)[None, :, None])
    return out * keep[..., None]


def attention(
    module: nn.Module,
    query: torch.Tensor,  # (B=1, Hq, L, D)
    key: torch.Tensor,  # (1, Hkv, L, D)
    value: torch.Tensor,  # (1, Hkv, L, D)
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The attention function registered as :data:`ATTENTION_NAME` (transformers' interface).

    Returns:
        ``(1, L, Hq, D)`` output in the query's dtype, and no attention weights.

    Raises:
        ValueError: without the row layout (a decoder or layer called past the model's forward),
            with attention dropout in training, or for a non-causal call.
    """
    layout = kwargs.get(ROW_LAYOUT)
    if layout is None:
        raise ValueError(
            f"{type(module).__name__}: context-parallel attention needs the row laid out by the "
            "model's forward: call the model itself with the shard of collators.shard_batch, not "
            "its decoder or a layer"
        )
    if dropout:
        config = getattr(module, "config", None)
        fields = [f"config.{name}" for name in DROPOUT_FIELDS if getattr(config, name, None)]
        raise ValueError(
            f"{type(module).__name__} applies attention dropout p={dropout} in training, which "
            "context-parallel attention does not: set "
            f"{' / '.join(fields) or 'its attention dropout'} to 0.0"
        )
    if kwargs.get("is_causal") is False:
        raise ValueError(
            f"{type(module).__name__} asks for non-causal attention, which context parallelism "
            "does not provide"
        )
    layout.reached.add(module)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window, sinks = kwargs.get("sliding_window"), kwargs.get("s_aux")
    out, lse = ring_attention(query, key, value, layout, window, scale, kwargs.get("softcap"))
    if sinks is not None:
        out = _with_sinks(out, lse, sinks)
    return out.to(query.dtype).transpose(1, 2).contiguous(), None
