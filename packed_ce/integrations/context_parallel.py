"""Context parallelism that keeps packed conversations apart: each rank attends over the whole row.

:func:`collators.shard_batch` gives rank ``r`` of ``W`` the zig-zag chunks ``r`` and ``2W - 1 - r`` of
``2W`` chunks of ``C`` tokens. The attention here gathers every rank's keys and values into the
whole row (``T = 2WC``) and lets query token ``q`` see key ``k`` iff both are in the same
conversation (transformers' ``position_ids`` restart rule) and ``k <= q``: the single-process mask.
The gather's backward is a reduce-scatter, so the parameter gradients summed over ranks are the
single process's. On CUDA for long rows flex attention with a block mask (never ``L x T`` scores),
else sdpa with the dense ``(L, T)`` mask (:func:`conversation_mask`).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from collators.columns import (
    ATTENTION_MASK, CU_SEQLENS, CU_SEQ_LENS_Q, INPUT_IDS, LABELS, POSITION_IDS, SEQUENCE_COLUMNS,
)

from ..targets import sequence_ids
from .installation import base_model

_names = itertools.count()
# The context-parallel groups of the models enabled in this process (groups of more than one rank).
_ENABLED: list = []
# Up to this many (query, key) pairs the dense boolean mask (16 MiB) is cheaper than building a
# block mask; flex attention's kernels for fewer than 128 queries (its decoding kernels) also
# fail to compile for some shapes (float32, grouped heads: "No choices to select").
DENSE_MASK_ELEMENTS = 2**24


@dataclass
class _RowLayout:
    """What every layer's attention needs about the row, computed once per forward.

    Attributes:
        local_positions: the ``(1, L)`` ``position_ids`` tensor of the forward (identity-checked
            in the attention, so a stale layout is never used).
        order: ``(T,)`` int64: row token ``t`` is entry ``order[t]`` of the rank-major gather.
        mask: the flex-attention block mask (CUDA, long rows), or the dense ``(L, T)`` bool mask.
    """

    local_positions: torch.Tensor
    order: torch.Tensor
    mask: object


@dataclass
class ContextParallel:
    """What :func:`enable_context_parallel` installed on a model, to use and to undo.

    Attributes:
        group, rank, world_size: the ranks sharing each row (None: the default group).
        attention_name: registered with transformers' attention interface (None for one rank).
        previous_attention: ``config._attn_implementation`` before. hook: lays out the row.
    """

    group: object
    rank: int
    world_size: int
    attention_name: str | None = None
    previous_attention: str | None = None
    hook: object = None
    layout: _RowLayout | None = field(default=None, repr=False)


def conversation_mask(documents: torch.Tensor, queries: torch.Tensor):
    """The mask rule ``(b, h, q, k) -> bool``: same conversation and not later.

    Args:
        documents: ``(T,)`` integer conversation id of each row token.
        queries: ``(L,)`` int64 row index of each local query.

    Elementwise on broadcast indices: flex attention's ``mask_mod`` and the dense mask alike.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        row = queries[q_idx]
        return (documents[row] == documents[kv_idx]) & (kv_idx <= row)

    return mask_mod


class _GatherRow(torch.autograd.Function):
    """The tokens of every rank in row order: ``x`` ``(L, H, D)`` of each rank -> ``(T, H, D)``.

    Forward: all-gather (rank-major), then one copy into row order. Backward: back to rank-major,
    reduce-scatter (every rank's queries read each rank's keys and values).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, state: "ContextParallel") -> torch.Tensor:
        ctx.state = state
        ctx.save_for_backward(order)
        x = x.contiguous()
        gathered = x.new_empty((state.world_size * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(gathered, x, group=state.group)
        return gathered.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (order,) = ctx.saved_tensors
        state = ctx.state
        # row order -> rank-major, in a new contiguous buffer: the gradient arrives as a permuted
        # view of (1, H, T, D), a *_like buffer would keep its strides, and NCCL's reduce-scatter
        # splits the raw memory, not the first dimension (the keys' gradients came back mixed).
        # order is a permutation of the T entries: every one is written, none needs zeroing.
        ranked = grad.new_empty(grad.shape).index_copy_(0, order, grad)
        local = grad.shape[0] // state.world_size
        if dist.get_backend(state.group) == "nccl":
            own = grad.new_empty((local, *grad.shape[1:]))
            dist.reduce_scatter_tensor(own, ranked, group=state.group)
        else:  # gloo has no reduce-scatter: sum everything, keep this rank's slice
            dist.all_reduce(ranked, group=state.group)
            own = ranked[state.rank * local : (state.rank + 1) * local]
        return own, None, None  # no gradient for the order or the state


def _gather_row(x: torch.Tensor, state: ContextParallel, order: torch.Tensor) -> torch.Tensor:
    """``x`` ``(1, H, L, D)`` of every rank as the whole row ``(1, H, T, D)``, in row order.

    Keys are ``(1, L, H, D)`` transposed, so the token-major view needs no copy.
    """
    rows = _GatherRow.apply(x[0].transpose(0, 1), order, state)  # (T, H, D)
    return rows.transpose(0, 1)[None]
def _layout_row(state: ContextParallel, position_ids: torch.Tensor) -> _RowLayout:
    """Gathers the row's ``position_ids`` and derives conversations, query rows and the order.

    Args:
        position_ids: ``(1, L)`` integer, this rank's tokens' positions from
            :func:`collators.shard_batch` (``L = 2C``).
    """
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or position_ids.shape[1] % 2:
        raise ValueError(
            "context parallelism needs position_ids of shape (1, 2C) from collators.shard_batch, "
            f"got shape {tuple(position_ids.shape)}"
        )
    world, rank = state.world_size, state.rank
    local = position_ids.shape[1]
    chunk = local // 2
    device = position_ids.device
    gathered = position_ids.new_empty(world * local)  # rank-major
    dist.all_gather_into_tensor(gathered, position_ids[0].contiguous(), group=state.group)
    # rank r holds row chunks r and 2W-1-r: entry (r, half, i) of the gather is row token
    # chunk(r, half) * C + i
    chunk_of = torch.tensor(
        [[r, 2 * world - 1 - r] for r in range(world)], device=device
    )  # (W, 2)
    row_index = (chunk_of[:, :, None] * chunk + torch.arange(chunk, device=device)).reshape(-1)
    order = torch.empty_like(row_index)
    order[row_index] = torch.arange(row_index.numel(), device=device)
    positions = gathered[order]  # (T,) in row order
    documents, _ = sequence_ids(positions, None, positions)  # (T,) conversation of each token
    queries = row_index.reshape(world, local)[rank]  # (L,) row index of each local token
    mask_mod = conversation_mask(documents, queries)
    total = positions.numel()
    if device.type == "cuda" and local * total > DENSE_MASK_ELEMENTS:
        from torch.nn.attention.flex_attention import create_block_mask

        # evaluated block by block: never the (L, T) dense mask
        mask = create_block_mask(mask_mod, None, None, local, total, device=device, _compile=True)
    else:
        # (L, T) bool, for every layer of the forward: each row has its own query token, so
        # none is empty
        mask = mask_mod(None, None, torch.arange(local, device=device)[:, None],
                        torch.arange(total, device=device)[None, :])
    return _RowLayout(position_ids, order, mask)


_compiled_flex_attention = None


def _flex_attention():
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        from torch.nn.attention.flex_attention import flex_attention

        # compiled once per process; eager flex attention materialises the (L, T) scores
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def _make_attention(state: ContextParallel):
    """The attention function registered for one model (transformers' attention interface)."""

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
        layout = state.layout
        if layout is None or kwargs.get(POSITION_IDS) is not layout.local_positions:
            raise RuntimeError(
                "context-parallel attention called outside the decoder's forward that laid out "
                "the row: call the model (or its decoder) with the shard's position_ids"
            )
        keys = _gather_row(key, state, layout.order)  # (1, Hkv, T, D)
        values = _gather_row(value, state, layout.order)
        # no dropout: enable_context_parallel refuses a model with attention dropout
        if isinstance(layout.mask, torch.Tensor):
            groups = query.shape[1] // keys.shape[1]
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=layout.mask, scale=scaling)
        else:
            out = _flex_attention()(
                query, keys, values, block_mask=layout.mask, scale=scaling, enable_gqa=True
            )
        return out.transpose(1, 2).contiguous(), None  # (1, L, Hq, D), no weights

    return attention


def _refusal(model: nn.Module) -> str | None:
    """Why the attention of ``model`` cannot be made context parallel exactly, or None."""
    name = type(model).__name__
    if not getattr(model, "_supports_attention_backend", False):
        return (
            f"{name} does not compute attention through transformers' attention interface, so "
            "context parallelism cannot replace it"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        other = sorted({t for t in layer_types if t != "full_attention"})
    elif getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        other = ["sliding_attention"]
    else:
        other = []
    if other:
        return (
            f"{name} has attention layers of type {other}: context parallelism keeps only "
            "full causal attention within each conversation exact; use a model without sliding "
            "windows (or set config.sliding_window = None if the conversations are shorter)"
        )
    if getattr(config, "attention_dropout", 0.0):
        return (
            f"{name} has config.attention_dropout={config.attention_dropout}: the context-parallel "
            "attention has no dropout; set it to 0.0"
        )
    return None


def enable_context_parallel(model: nn.Module, group=None) -> nn.Module:
    """Makes each rank of ``group`` attend over the whole packed row, within each conversation.

    On rank ``r`` of ``W``, ``model(**collators.shard_batch(batch, r, W), num_items_in_batch=n).loss``
    with ``n = count_num_items(batch)`` is rank ``r``'s share of the one-process loss; the shares
    and the gradients summed over ranks are the one-process ones. Works with
    :func:`apply_packed_loss` (logits or fused), PEFT and gradient checkpointing.

    Args:
        model: a transformers causal LM (or a PEFT model of one) whose attention goes through
            transformers' attention interface, without sliding windows or attention dropout.
        group: the process group whose ranks share each row (default: the world). A group of one
            rank leaves the model as it is.

    Returns:
        ``model``, changed in place (:func:`disable_context_parallel` undoes it).

    Raises:
        ValueError: without an initialised process group, for a model whose attention cannot be
            replaced exactly, or if context parallelism is already enabled on it.

    """
    target = base_model(model)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "enable_context_parallel needs torch.distributed initialised: call "
            "torch.distributed.init_process_group (torchrun sets up the environment)"
        )
    if getattr(target, "_packed_ce_context_parallel", None) is not None:
        raise ValueError("context parallelism is already enabled on this model")
    reason = _refusal(target)
    if reason is not None:
        raise ValueError(reason)
    state = ContextParallel(
        group=group, rank=dist.get_rank(group), world_size=dist.get_world_size(group)
    )
    if state.world_size > 1:
        from transformers import AttentionInterface

        state.attention_name = f"packed_ce_context_parallel_{next(_names)}"
        state.previous_attention = target.config._attn_implementation
        AttentionInterface.register(state.attention_name, _make_attention(state))
        target.set_attn_implementation(state.attention_name)
        state.hook = target.get_decoder().register_forward_pre_hook(
            _lay_out_hook(state), with_kwargs=True
        )
        _ENABLED.append(state)
    target._packed_ce_context_parallel = state
    return model


def _lay_out_hook(state: ContextParallel):
    def hook(decoder: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get(ATTENTION_MASK) is not None:
            raise ValueError(
                "a context-parallel call takes no attention_mask: conversations are found from "
                "position_ids (pass the batch of collators.shard_batch as it is)"
            )
        position_ids = kwargs.get(POSITION_IDS)
        if position_ids is None:
            raise ValueError(
                "a context-parallel call needs the position_ids of collators.shard_batch: they "
                "find the conversations of the whole row"
            )
        state.layout = _layout_row(state, position_ids)

    return hook


def disable_context_parallel(model: nn.Module) -> nn.Module:
    """Undoes :func:`enable_context_parallel`: the model's attention is its own again.

    Raises:
        ValueError: if context parallelism is not enabled on ``model``.
    """
    target = base_model(model)
    state = getattr(target, "_packed_ce_context_parallel", None)
    if state is None:
        raise ValueError(f"context parallelism is not enabled on this {type(model).__name__}")
    if state.attention_name is not None:
        from transformers import AttentionInterface

        target.set_attn_implementation(state.previous_attention)
        state.hook.remove()
        AttentionInterface._global_mapping.pop(state.attention_name, None)
        _ENABLED.remove(state)
    del target._packed_ce_context_parallel
    return model


def ranks_per_row(group=None) -> int:
    """How many ranks of ``group`` (default: the world) hold each packed row.

    A sum over ``group`` counts each row that many times (:func:`count_num_items` divides by it).

    Raises:
        ValueError: if models with groups of different sizes are enabled at once.
    """
    inside = set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    sizes = {
        state.world_size
        for state in _ENABLED
        if set(dist.get_process_group_ranks(state.group or dist.group.WORLD)) <= inside
    }
    if len(sizes) > 1:
        raise ValueError(
            f"context parallelism is enabled with groups of {sorted(sizes)} ranks: count the "
            "rows with count_num_items(..., all_reduce=False) and sum them yourself"
        )
    return sizes.pop() if sizes else 1


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """What :func:`enable_context_parallel` installed on ``model`` (or the model it wraps)."""
    return getattr(base_model(model), "_packed_ce_context_parallel", None)


def shard_for_rank(batch: Mapping, rank: int, world_size: int, *, ignore_index: int = -100) -> dict:
    """One context-parallel rank's share of a one-row batch from any packing collator.

    The row is padded to a multiple of ``2 * world_size`` (a segment without target or weight), its
    boundaries read from ``cu_seqlens``, ``cu_seq_lens_q`` or ``position_ids``, and
    :func:`collators.shard_batch` cuts it; whole-row keys (``max_seqlen``, varlen) are left out.

    Args:
        batch: ``input_ids`` and ``labels`` ``(1, T)`` (labels aligned with ``input_ids``), the
            boundaries, and optionally ``seq_targets``, ``seq_weights`` ``(S,)`` and
            ``seq_sources`` (list of S).
        rank, world_size: this rank within the context-parallel group, and its size.

    Raises:
        ValueError: for a batch of several rows (padded, not packed) or with an
            ``attention_mask``: context parallelism needs the conversations in one row.
    """
    from collators import shard_batch

    input_ids, labels = batch[INPUT_IDS], batch[LABELS]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or batch.get(ATTENTION_MASK) is not None:
        raise ValueError(
            "context parallelism needs one packed row per batch (PackedCollator, or trl's "
            f"padding_free=True), got input_ids of shape {tuple(input_ids.shape)}"
            + (" and an attention_mask" if batch.get(ATTENTION_MASK) is not None else "")
        )
    length = input_ids.shape[1]
    device = input_ids.device
    cu_seqlens = batch.get(CU_SEQLENS)
    if cu_seqlens is None:
        cu_seqlens = batch.get(CU_SEQ_LENS_Q)
    if cu_seqlens is None:  # the restarts of position_ids (one sequence without them)
        sequence, _ = sequence_ids(labels, None, batch.get(POSITION_IDS))
        cu_seqlens = F.pad(torch.bincount(sequence).cumsum(0), (1, 0))
    cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int64)
    multiple = 2 * world_size
    padding = -length % multiple
    row = {INPUT_IDS: input_ids, LABELS: labels, CU_SEQLENS: cu_seqlens}
    for column in SEQUENCE_COLUMNS:
        if batch.get(column.key) is not None:
            row[column.key] = batch[column.key]
    if padding:
        row[INPUT_IDS] = F.pad(input_ids, (0, padding), value=0)
        row[LABELS] = F.pad(labels, (0, padding), value=ignore_index)
        row[CU_SEQLENS] = torch.cat((cu_seqlens, cu_seqlens.new_tensor([length + padding])))
        for column in SEQUENCE_COLUMNS:
            if column.key in row:
                row[column.key] = column.padded(row[column.key])
    return shard_batch(row, rank, world_size, ignore_index=ignore_index)
