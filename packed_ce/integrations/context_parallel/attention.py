"""The attention of a context-parallel layer: this rank's queries over the whole row's keys.

Registered once with transformers' attention interface under :data:`ATTENTION_NAME`; it holds no
state: the row's :class:`~.layout.RowLayout` comes with each call (:data:`ROW_LAYOUT`). The keys and
values are gathered together per layer (``gather.py``: rank-major, the mask maps each to its row
token). What a family asks of its attention is done exactly or refused: sliding windows (the
mask), an attention logit softcap (Gemma 2: ``softcap * tanh(s / softcap)`` on each score),
attention sinks (gpt-oss: a per-head logit in the softmax's denominator only), dropout (refused).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from packed_ce.columns import ROW_LAYOUT

from ..model.families import DROPOUT_FIELDS
from .gather import gather_tokens
from .layout import RowLayout

ATTENTION_NAME = "packed_ce_context_parallel"


def gather_row(
    key: torch.Tensor, value: torch.Tensor, layout: RowLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` ``(1, Hkv, L, D)`` of every rank as ``(1, Hkv, T, D)``, rank-major
    (:class:`RowLayout` maps each entry to its row token), in one collective. They are
    ``(1, L, H, D)`` transposed, so the token-major views need no copy.
    """
    local = torch.stack((key[0].transpose(0, 1), value[0].transpose(0, 1)), dim=1)  # (L, 2, H, D)
    gathered = gather_tokens(local, layout.group, layout.rank, layout.world_size)  # (T, 2, Hkv, D)
    return gathered[:, 0].transpose(0, 1)[None], gathered[:, 1].transpose(0, 1)[None]


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with a sink logit per head from attention without:
    ``p_k = e^{s_k} / (Z + e^{sink})`` is ``e^{s_k} / Z`` times
    ``Z / (Z + e^{sink}) = sigmoid(lse - sink)``.

    Args:
        out: ``(1, Hq, L, D)`` attention output without sinks. lse: ``(1, Hq, L)`` float32,
            natural-log ``logsumexp`` of the scaled scores. sinks: ``(Hq,)``.
    """
    dtype = torch.promote_types(out.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(dtype) - sinks.to(dtype)[None, :, None])
    return (out.to(dtype) * keep[..., None]).to(out.dtype)


def _softcap_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def _dense(query, keys, values, mask, scaling, softcap, sinks) -> torch.Tensor:
    """Short rows and CPU: sdpa with the dense ``(L, T)`` mask; with a softcap or sinks the
    scores themselves, in float32 at least (as transformers' eager attention).
    """
    groups = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(groups, dim=1)
    values = values.repeat_interleave(groups, dim=1)
    if softcap is None and sinks is None:
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling)
    dtype = torch.promote_types(query.dtype, torch.float32)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # (1, Hq, L, T)
    scores = torch.matmul(query.to(dtype), keys.to(dtype).transpose(-1, -2)) * scale
    if softcap is not None:
        scores = _softcap_mod(softcap)(scores, None, None, None, None)
    scores = scores.masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)  # (1, Hq, L); every query sees itself: finite
    out = torch.matmul(torch.exp(scores - lse[..., None]), values.to(dtype)).to(query.dtype)
    return out if sinks is None else _with_sinks(out, lse, sinks)


# flex_attention compiled once per process and shared by every model (eager flex attention
# materialises the (L, T) scores); see trainers/seams.py, GLOBAL_STATE.
_compiled_flex_attention = None


def _flex(query, keys, values, block_mask, scaling, softcap, sinks) -> torch.Tensor:
    """Long rows on CUDA: flex attention with the block mask; the sinks from its logsumexp."""
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex_attention = torch.compile(flex_attention)
    score_mod = None if softcap is None else _softcap_mod(softcap)
    common = dict(score_mod=score_mod, block_mask=block_mask, scale=scaling, enable_gqa=True)
    if sinks is None:
        return _compiled_flex_attention(query, keys, values, **common)
    from torch.nn.attention.flex_attention import AuxRequest

    out, aux = _compiled_flex_attention(
        query, keys, values, return_aux=AuxRequest(lse=True), **common
    )
    return _with_sinks(out, aux.lse, sinks)


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
    keys, values = gather_row(key, value, layout)  # (1, Hkv, T, D) each
    mask = layout.mask(kwargs.get("sliding_window"), query.device)
    compute = _dense if isinstance(mask, torch.Tensor) else _flex
    out = compute(query, keys, values, mask, scaling, kwargs.get("softcap"), kwargs.get("s_aux"))
    return out.transpose(1, 2).contiguous(), None
