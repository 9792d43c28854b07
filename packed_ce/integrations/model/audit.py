"""Packed conversations kept apart in every decoder layer, checked on a model's first packed call.

transformers builds each family's attention mask in that family's own code: most remap it to the
packed ``position_ids`` (block-diagonal per conversation), others build it without them (OPT,
AFMoE, GPT-OSS eager, the BERT and BART families, ...) and let a packed conversation attend to the
one before it. So the first packed call (a sequence boundary inside a row) of each attention
implementation records, by forward pre-hooks on the decoder layers (transformers'
``GradientCheckpointingLayer``), the ``attention_mask`` each layer receives, and reads it as the
attention does at every boundary: the first and the last query of a sequence must see no key of
the sequence before it (fewer than ``2 T`` lookups per row):

- a 4-D tensor: additive float (a key is masked at ``-1e4`` or below) or bool (masked unless it
  reads as the query's own key does: ``False`` for sdpa, ``True`` where a family inverts it);
- a flex-attention ``BlockMask``: its full blocks, and its ``mask_mod`` on its partial blocks;
- ``None`` or a 2-D padding mask, at a layer with attention (a submodule with ``is_causal``,
  transformers' attention contract): causal attention over the whole row, except with flash
  attention, which takes the sequences from the layer call's varlen keywords (``cu_seq_lens_q``,
  ``cu_seq_lens_k``, ``max_length_q``, ``max_length_k``) or, in a single row, its
  ``position_ids``; flash also needs the layer's rotary ``position_embeddings`` to restart (the
  positions no mask shows: absolute position embeddings cannot be checked, and are refused).

A leaking layer raises a ``ValueError`` naming ``config.model_type``, the implementation and the
fix before it runs. A passed audit is remembered per implementation on the installation, and its
hooks are gone after that call: later calls cost one set lookup. Families that are wrong for a
reason no mask shows (recurrent state carried along the row) are refused by name from
``families.py``'s :data:`LEAKY_FAMILIES` (:data:`LEAKY_IMPLEMENTATIONS` where only one
implementation is wrong); its token mixers (:data:`MIXERS`) run per conversation (``mixers.py``);
``tests/test_families.py`` runs every family of transformers and fails when a table or the audit
disagrees with what a family does.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
from collections.abc import Mapping

import torch
from torch import nn

from packed_ce.columns import (
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    LAYOUT,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    ROW_LAYOUT,
)

from .families import LEAKY_FAMILIES, LEAKY_IMPLEMENTATIONS
from .probe import probe

# Additive mask values at or below this mask their key: exp(-1e4) is 0 in every float type.
MASKED_BELOW = -1e4
UNPACKED = (
    "or train unpacked, one conversation per row: PackedSFTTrainer with SFTConfig(packing=False, "
    "padding_free=False), or collators.PaddedCollator with PackedTrainer or your own loop"
)
_NOTHING = contextlib.nullcontext()


def start_audit(model: nn.Module, installation, args: tuple, kwargs: dict, forward, prepare):
    """A context to run a call of ``model`` in: its audit on the first packed call.

    Args:
        model: the transformers model with the packed loss (not a wrapper).
        installation: its :class:`Installation` (``audited``: the implementations checked).
        args, kwargs: the call, as :func:`checked_call` left it (a packed call has no
            ``attention_mask`` and no cache).
        forward, prepare: the model's own forward and ``prepare(args, kwargs)``, the keywords the
            packed forward gives it for a call, for :func:`probe.probe`.

    Returns:
        a no-op context, or on the first packed call of ``config._attn_implementation`` an
        :class:`_Audit` (hooks on the decoder layers while the call runs).

    Raises:
        ValueError: on a packed call of a family of :data:`LEAKY_FAMILIES` or
            :data:`LEAKY_IMPLEMENTATIONS`, of one whose probe shows a leak, or of a model whose
            decoder layers cannot be found.
    """
    implementation = model.config._attn_implementation
    if implementation in installation.audited:
        return _NOTHING
    if kwargs.get(ROW_LAYOUT) is not None:  # context parallelism's: its row layout keeps them apart
        installation.audited.add(implementation)
        return _NOTHING
    starts = _sequence_starts(kwargs)
    if starts is None:
        return _NOTHING
    family = getattr(model.config, "model_type", type(model).__name__)
    if family in LEAKY_FAMILIES:
        raise ValueError(
            f"packed batches are not exact on model_type={family!r}: {LEAKY_FAMILIES[family]}; "
            f"pack nothing with this family, {UNPACKED}"
        )
    if (family, implementation) in LEAKY_IMPLEMENTATIONS:
        raise ValueError(
            f"packed batches are not exact on model_type={family!r} with attn_implementation="
            f"{implementation!r}: {LEAKY_IMPLEMENTATIONS[family, implementation]}; "
            f"{_elsewhere(model)}"
        )
    layers = decoder_layers(model)
    if not layers and getattr(model.config.get_text_config(), "num_hidden_layers", None) == 0:
        installation.audited.add(implementation)  # no layer: no token sees another
        return _NOTHING
    if not layers:
        raise ValueError(
            f"packed batches cannot be checked on model_type={family!r}: it has no decoder layers "
            f"(transformers' GradientCheckpointingLayer) whose attention masks could be read; "
            f"pack nothing with this family, {UNPACKED}"
        )
    # probed before the call: its forwards between this call's forward and its backward would
    # change what a gradient-checkpointed recomputation saves
    leak = probe(model, forward, kwargs, prepare)
    return _Audit(model, installation, layers, starts, kwargs, leak)


# attn_implementation -> the class flag of a family supporting it (eager: every family)
_SUPPORT_FLAGS = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
}


# The implementations that read the mask transformers builds for them from the same arguments: a
# family whose mask leaks in one leaks in all (tests/test_families.py: none is exact with eager and
# refused with sdpa, or the other way round).
_MASKED = ("eager", "sdpa", "flex_attention")


def _elsewhere(model: nn.Module, masks_leak: bool = False) -> str:
    """What to do instead: the other attention implementations the family supports on this
    machine and no table refuses (each checked again on its first packed call), and unpacked
    training. ``masks_leak``: the call's mask leaked, so the implementations of :data:`_MASKED`
    are no way out.
    """
    family = getattr(model.config, "model_type", type(model).__name__)
    current = model.config._attn_implementation
    # flash attention's positions are read from the rotary embeddings (_flash_leak): without
    # them (absolute positions, none) it is refused too
    rotary = any(type(module).__name__.endswith("RotaryEmbedding") for module in model.modules())
    usable = {"eager": True, "sdpa": True, "flex_attention": True}
    usable["flash_attention_2"] = bool(
        rotary and torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None
    )
    others = [
        name
        for name, available in usable.items()
        if available
        and name != current
        and (name == "eager" or getattr(model, _SUPPORT_FLAGS[name], False))
        and (family, name) not in LEAKY_IMPLEMENTATIONS
        and not (masks_leak and name in _MASKED)
    ]
    same = f"{', '.join(_MASKED)} get their masks from the same code, and " if masks_leak else ""
    if not others:
        flash = (
            "flash attention on a GPU may keep them apart"
            if rotary
            else "flash attention is refused without rotary position embeddings"
        )
        return (
            f"{same}no other attention implementation of {family} runs on this machine "
            f"({flash}): pack nothing with it, {UNPACKED}"
        )
    return (
        f"{same}load the model with attn_implementation={' or '.join(map(repr, others))} (its "
        f"first packed call is checked again), {UNPACKED}"
    )


def _sequence_starts(kwargs: dict) -> torch.Tensor | None:
    """``(B, T)`` bool, True at the first token of every conversation that starts after column 0
    (the call's :class:`~packed_ce.layout.PackedLayout`); None for a call that is not packed or
    keeps a cache or a mask (which the guard refuses where they would mix conversations).
    """
    if kwargs.get(ATTENTION_MASK) is not None or kwargs.get("past_key_values") is not None:
        return None
    layout = kwargs.get(LAYOUT)
    if layout is None or not layout.packed:
        return None
    starts = torch.zeros(layout.position_ids.numel() + 1, dtype=torch.bool, device=layout.device)
    starts[layout.cu_seqlens.to(torch.int64)] = True
    starts = starts[:-1].view(layout.shape)
    starts[:, 0] = False
    return starts if bool(starts.any()) else None


def _restarts(positions: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """``shape`` bool: where ``position_ids`` (``(B, T)`` or ``(1, T)``) restart inside a row
    (transformers' rule: ``p[t] != p[t-1] + 1``); all False for positions of another length.
    """
    starts = torch.zeros(shape, dtype=torch.bool, device=positions.device)
    positions = positions.reshape(-1, positions.shape[-1])
    if positions.shape[-1] == shape[1] and positions.shape[0] in (1, shape[0]):
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def _boundary_pairs(starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``(row, query, key)`` triples a mask must hide: the first and the last token of every
    sequence starting inside a row, each with every key of the sequence before it.

    Args:
        starts: ``(B, T)`` bool from :func:`_sequence_starts`.

    Returns:
        ``rows``, ``queries``, ``keys``: ``(P,)`` int64, ``P < 2 B T``.
    """
    columns = torch.arange(starts.shape[1], device=starts.device)
    opens = starts.clone()
    opens[:, 0] = True
    first = torch.where(opens, columns, 0).cummax(1).values  # the first column of my sequence
    before = torch.zeros_like(first)  # ... and of the sequence before it
    before[:, 1:] = torch.where(opens[:, 1:], first[:, :-1], 0)
    before = before.cummax(1).values
    last = torch.ones_like(opens)
    last[:, :-1] = opens[:, 1:]
    rows, queries = ((last & (first > 0)) | starts).nonzero(as_tuple=True)
    low, count = before[rows, queries], (first - before)[rows, queries]
    offsets = torch.arange(int(count.sum()), device=starts.device)
    offsets -= torch.repeat_interleave(count.cumsum(0) - count, count)
    repeat = functools.partial(torch.repeat_interleave, repeats=count)
    return repeat(rows), repeat(queries), repeat(low) + offsets


class _Audit:
    """The pre-hooks of one packed call on the decoder layers (see the module docstring)."""

    def __init__(self, model: nn.Module, installation, layers, starts, kwargs: dict, leak):
        self.model = model
        self.installation = installation
        self.implementation = model.config._attn_implementation
        self.family = getattr(model.config, "model_type", type(model).__name__)
        self.starts = starts
        self.pairs = _boundary_pairs(starts)
        self.positions = isinstance(kwargs.get(POSITION_IDS), torch.Tensor)
        self.leak = leak  # what the probe saw, raised unless a mask names the leak first
        self.hooks = [
            layer.register_forward_pre_hook(functools.partial(self._check, name), with_kwargs=True)
            for name, layer in layers
        ]

    def __enter__(self) -> "_Audit":
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        """Removes the hooks; a call that ran through with every mask exact raises what the probe
        saw (:func:`probe.probe`), or marks the implementation audited.
        """
        for hook in self.hooks:
            hook.remove()
        if error_type is not None:
            return
        if self.leak is not None:
            raise ValueError(
                f"packed batches are not exact on model_type={self.family!r} with "
                f"attn_implementation={self.implementation!r}: {self.leak}; pack nothing with this "
                f"family, {UNPACKED}"
            )
        self.installation.audited.add(self.implementation)

    def _check(self, name: str, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        arguments = _bound_arguments(layer, args, kwargs)
        mask = arguments.get(ATTENTION_MASK)
        if mask is None or _padding(mask):  # Zamba's hybrid layers: the 4-D mask beside it
            mask = arguments.get("causal_mask", mask)
        if mask is None or _padding(mask):
            if not any(hasattr(module, "is_causal") for module in layer.modules()):
                return  # no attention: a recurrent layer's state is LEAKY_FAMILIES' matter
            if "flash" in self.implementation:
                leak = _flash_leak(arguments, self.starts)
            else:
                leak = "no mask (causal attention over the whole row)"
        else:
            leak = _mask_leak(mask, self.pairs, self.starts.shape)
        if leak is None:
            return
        hint = (
            ""
            if self.positions
            else (
                " (this call has no position_ids, so positions run on across the row: pass "
                "collators.PackedCollator's, which restart at 0 for every conversation)"
            )
        )
        raise ValueError(
            f"packed batches are not exact on model_type={self.family!r} with "
            f"attn_implementation={self.implementation!r}: decoder layer {name!r} gets {leak}, so "
            f"a packed conversation attends to the one before it{hint}; "
            f"{_elsewhere(self.model, masks_leak='flash' not in self.implementation)}"
        )


def _padding(mask) -> bool:
    """A tensor of fewer than 4 dimensions: a padding mask, which separates no sequences."""
    return isinstance(mask, torch.Tensor) and mask.dim() < 4


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost ``GradientCheckpointingLayer`` modules of the decoder (of the whole model
    where ``get_decoder`` finds none: some families' returns their head).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    roots = [model.get_decoder()] if hasattr(model, "get_decoder") else []
    for root in roots + [model]:
        layers: list[tuple[str, nn.Module]] = []
        for name, module in root.named_modules():
            inside = any(name.startswith(f"{outer}.") for outer, _ in layers)
            if isinstance(module, GradientCheckpointingLayer) and not inside:
                layers.append((name, module))
        if layers:
            return layers
    return []


def _bound_arguments(layer: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The layer call's arguments by parameter name, its ``**kwargs`` merged in."""
    signature = inspect.signature(layer.forward)
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return dict(kwargs)
    arguments = {}
    for key, value in bound.items():
        if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(value)
        else:
            arguments[key] = value
    return arguments


def _mask_leak(mask, pairs, shape: tuple[int, int]) -> str | None:
    """What in ``mask`` (4-D, ``BlockMask`` or a mapping of them) lets a boundary query see the
    sequence before it, as the attention reads it; None when every pair is masked.
    """
    from torch.nn.attention.flex_attention import BlockMask

    rows, queries, keys = pairs
    if isinstance(mask, Mapping):  # one per kind of mixing (ZAYA): the attention masks are read
        masks = [m for m in mask.values() if m is not None and not _padding(m)]
        leaks = [_mask_leak(value, pairs, shape) for value in masks]
        return next((leak for leak in leaks if leak is not None), None)
    if isinstance(mask, BlockMask):
        visible = _block_mask_visible(mask, rows, queries, keys)
    elif isinstance(mask, torch.Tensor) and mask.dim() == 4:
        if tuple(mask.shape[-2:]) != (shape[1], shape[1]) or mask.shape[0] not in (1, shape[0]):
            return f"a mask of shape {tuple(mask.shape)} for rows of {shape[1]} tokens"
        device = mask.device
        batch = rows.to(device) if mask.shape[0] > 1 else 0
        values = mask[batch, :, queries.to(device), keys.to(device)]  # (P, heads)
        if values.dtype == torch.bool:
            visible = values == mask[batch, :, queries.to(device), queries.to(device)]
        else:
            visible = values > MASKED_BELOW
    else:
        return f"an attention mask of type {type(mask).__name__} that cannot be read"
    seen = visible.any(1).nonzero()
    if not len(seen):
        return None
    pair = int(seen[0, 0])
    return (
        f"a mask that lets query {int(queries[pair])} of row {int(rows[pair])} see key "
        f"{int(keys[pair])} of the sequence before"
    )


def _block_mask_visible(mask, rows, queries, keys) -> torch.Tensor:
    """``(P, H)`` bool: each pair attended under a flex ``BlockMask`` (in a full block, or in a
    partial block where ``mask_mod`` allows it).
    """
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    device = mask.kv_num_blocks.device
    rows, queries, keys = rows.to(device), queries.to(device), keys.to(device)
    batch = rows if mask.kv_num_blocks.shape[0] > 1 else torch.zeros_like(rows)
    query_blocks, key_blocks = queries // mask.BLOCK_SIZE[0], keys // mask.BLOCK_SIZE[1]

    def listed(counts, indices, head):  # the key block is among the query block's first counts
        if counts is None:
            return torch.zeros_like(rows, dtype=torch.bool)
        blocks = indices[batch, head, query_blocks]  # (P, max blocks)
        slots = torch.arange(blocks.shape[1], device=device)
        used = slots < counts[batch, head, query_blocks][:, None]
        return ((blocks == key_blocks[:, None]) & used).any(1)

    heads = []
    for head in range(mask.kv_num_blocks.shape[1]):
        with TransformGetItemToIndex():  # how flex itself evaluates a mask_mod on index tensors
            allowed = torch.vmap(mask.mask_mod)(batch, torch.full_like(rows, head), queries, keys)
        partial = listed(mask.kv_num_blocks, mask.kv_indices, head) & allowed
        heads.append(partial | listed(mask.full_kv_num_blocks, mask.full_kv_indices, head))
    return torch.stack(heads, 1)


def _flash_leak(arguments: dict, starts: torch.Tensor) -> str | None:
    """Why flash attention at this layer is not every conversation alone, or None.

    Its sequences come from the layer call's varlen keywords, else from the ``position_ids`` of
    a single row. No mask shows the positions: they are read from the rotary
    ``position_embeddings`` the layer gets, which must be those of position 0 at every start (a
    family with absolute position embeddings adds them before the layers, where none can tell).
    """
    varlen = (CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K)
    if all(arguments.get(key) is not None for key in varlen):
        found = torch.zeros(starts.numel(), dtype=torch.bool, device=starts.device)
        cu = arguments[CU_SEQ_LENS_Q].to(device=starts.device, dtype=torch.int64)
        found[cu[(cu > 0) & (cu < starts.numel())]] = True
        split = found.view(starts.shape)
        what = "cu_seq_lens_q that do not split every sequence"
    elif isinstance(arguments.get(POSITION_IDS), torch.Tensor) and starts.shape[0] == 1:
        split = _restarts(arguments[POSITION_IDS].to(starts.device), starts.shape)
        what = "position_ids that do not restart at every sequence"
    else:
        return "neither varlen keywords nor the position_ids of a single row"
    if bool((starts & ~split).any()):
        return what
    rotary = arguments.get("position_embeddings")
    if not (
        isinstance(rotary, (tuple, list))
        and rotary
        and all(
            isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-2] == starts.shape[1]
            for t in rotary
        )
    ):
        return "no rotary position_embeddings to check its positions by"
    rows, columns = starts.nonzero(as_tuple=True)
    for table in rotary:  # (B or 1, T, D)
        batch = rows.to(table.device) if table.shape[0] > 1 else 0
        at_start = table[batch, columns.to(table.device)]
        if not torch.equal(at_start, table[batch, 0].expand_as(at_start)):
            return "rotary position_embeddings that do not restart at every sequence"
    return None
