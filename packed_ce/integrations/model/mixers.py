"""Token mixing that is not attention, kept within each packed conversation.

A hybrid family's short convolutions, gated delta rules and state-space scans (:data:`MIXERS`)
read the tokens before each position in the row, whatever the attention mask says: packed, a
conversation started from the state of the one before. Each such module's ``forward`` is replaced
(undoably, by :func:`install`) with a :class:`PerConversation` that finds the call's conversations
and

- with the kernels that take the boundaries installed (:data:`MIXERS`), on CUDA, one row: runs
  the row whole, the call carrying ``seq_idx`` and ``cu_seq_lens_q`` (the packed forward adds them
  from the batch's boundaries, ``guards.py``);
- else (the CPU, a GPU without those kernels, a kernel that takes no boundary): runs the module
  on each conversation alone, its per-token inputs sliced, and puts the outputs back in the row.
  A mixer's output at a token depends on the tokens of its row up to it only, so this is every
  conversation alone, exactly;
- under context parallelism: gathers its per-token inputs from the ranks, runs the row's
  conversations as above and keeps this rank's tokens (the gather's backward sums the ranks'
  gradients, as for keys and values).

The conversations come from the mixer call's arguments (``seq_idx``, ``position_ids``, the row
layout), else from the enclosing decoder layer's call, which hooks on the decoder layers record
(Jamba's layers call their mixer without keywords; transformers' gradient checkpointing recomputes
a layer outside its hooks, so such a layer is refused checkpointed). Each boundary tensor's spans
are read to the host once and kept on it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import threading

import torch
from torch import nn

from ...columns import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    ROW_LAYOUT,
)
from ...targets import position_restarts
from .families import MIXERS

SEQ_IDX = "seq_idx"  # (B, T) int32: the conversation of each token (transformers' keyword)
# Keywords that tell a whole row's mixer where conversations start: dropped from a call on one
# conversation, which has none inside.
BOUNDARY_KEYS = (SEQ_IDX, CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K, CU_SEQLENS)

# Where a mixer call's conversations are found, in this order: the row layout (context
# parallelism), the conversation of each token, transformers' position_ids.
KINDS = (("layout", ROW_LAYOUT), ("index", SEQ_IDX), ("positions", POSITION_IDS))
# The innermost decoder layer call of this thread: its seq_idx, position_ids and row layout.
_layers = threading.local()
# The attribute a boundary tensor keeps its conversations in, ((start, end) per conversation, per
# row), read to the host once: it lives and dies with the tensor (a cache keyed by id() handed a
# new tensor the spans of a dead one, and a WeakKeyDictionary compares tensors by value).
SPANS_ATTRIBUTE = "_packed_ce_spans"


def mixers_of(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that mix tokens other than by attention (:data:`MIXERS`)."""
    return [module for module in model.modules() if type(module).__name__ in MIXERS]


def install(model: nn.Module, layers: list[nn.Module]) -> list:
    """Runs every mixer of ``model`` per conversation; records the decoder ``layers``' calls.

    Returns:
        What :func:`uninstall` takes: the mixers and the layers' hook handles (empty when ``model``
        has no mixer).
    """
    mixers = mixers_of(model)
    if not mixers:
        return []
    for mixer in mixers:
        mixer.forward = PerConversation(mixer)
    hooks = []
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(_enter_layer, with_kwargs=True))
        hooks.append(layer.register_forward_hook(_leave_layer, always_call=True))
    return [*mixers, *hooks]


def uninstall(installed: list) -> None:
    """Undoes :func:`install`: the mixers' own forward, no layer hook."""
    for item in installed:
        if isinstance(item, nn.Module):
            del item.forward
        else:
            item.remove()


def with_boundaries(kwargs: dict, shape: tuple[int, int]) -> dict:
    """A packed call's keywords with ``seq_idx`` (and, for one row, ``cu_seq_lens_q/k`` and
    ``max_length_q/k``) from its ``position_ids`` or ``cu_seq_lens_q`` where it lacks them: what
    the mixers' kernels and the decoder layers' calls carry the conversations by.

    Args:
        kwargs: the call's keywords (after the guard). shape: ``(B, T)`` of its tokens.
    """
    if kwargs.get(SEQ_IDX) is not None:
        return kwargs
    rows, width = shape
    positions, cumulative = kwargs.get(POSITION_IDS), kwargs.get(CU_SEQ_LENS_Q)
    if isinstance(positions, torch.Tensor) and positions.shape[-1] == width:
        spans, device = spans_of(positions, rows, restart=True), positions.device
    elif isinstance(cumulative, torch.Tensor) and rows == 1:
        cuts = cumulative.tolist()
        spans, device = [list(zip(cuts[:-1], cuts[1:]))], cumulative.device
    else:
        return kwargs
    if all(len(row) == 1 for row in spans):
        return kwargs
    # (B, T) int32: conversation i over its columns, built per conversation, not per token
    seq_idx = torch.stack(
        [
            torch.repeat_interleave(
                torch.arange(len(row), dtype=torch.int32),
                torch.tensor([end - start for start, end in row]),
            )
            for row in spans
        ]
    ).to(device)
    setattr(seq_idx, SPANS_ATTRIBUTE, spans)
    added = {SEQ_IDX: seq_idx}
    if rows == 1 and cumulative is None:
        cuts = [start for start, _ in spans[0]] + [width]
        cumulative = torch.tensor(cuts, dtype=torch.int32, device=device)
        longest = max(end - start for start, end in spans[0])
        added.update(
            {
                CU_SEQ_LENS_Q: cumulative,
                CU_SEQ_LENS_K: cumulative,
                MAX_LENGTH_Q: longest,
                MAX_LENGTH_K: longest,
            }
        )
    return {**kwargs, **added}


def _enter_layer(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    stack = getattr(_layers, "stack", None)
    if stack is None:
        stack = _layers.stack = []
    stack.append((layer, _bound(type(layer).forward, layer, args, kwargs)))


def _leave_layer(layer: nn.Module, args: tuple, output) -> None:
    _layers.stack.pop()


def _call_boundaries(module: nn.Module, bound: dict) -> tuple[str | None, object]:
    """Where a mixer call's conversations come from: ``("layout", RowLayout)`` under context
    parallelism, ``("index", seq_idx)``, ``("positions", position_ids)``, or ``(None, None)``;
    the call's own arguments first, then its decoder layer's call.

    Raises:
        ValueError: for boundaries only the layer's call carries, in a gradient-checkpointed layer:
            transformers recomputes its forward in the backward outside every module hook, where
            they could not be found again.
    """
    sources = [(None, bound)]
    if getattr(_layers, "stack", None):
        sources.append(_layers.stack[-1])
    for layer, arguments in sources:
        found = next(
            ((kind, arguments[key]) for kind, key in KINDS if arguments.get(key) is not None),
            None,
        )
        if found is None:
            continue
        if layer is not None and layer.training and getattr(layer, "gradient_checkpointing", False):
            raise ValueError(
                f"{type(module).__name__} is called without the batch's boundaries by its "
                f"{type(layer).__name__}, which gradient checkpointing recomputes where they "
                "cannot be found again: train this family packed without gradient checkpointing, "
                "or unpacked with it"
            )
        return found
    return None, None


class PerConversation:
    """A mixer's forward that keeps each conversation of a packed row to itself (module docstring).

    An object holding its module, not a closure: ``copy.deepcopy`` and ``pickle`` of the model
    keep it, bound to the copy's module.
    """

    def __init__(self, module: nn.Module):
        self.module = module

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def __call__(self, *args, **kwargs):
        module = self.module
        own = type(module).forward.__get__(module)
        bound = _bound(type(module).forward, module, args, kwargs)
        hidden = next(v for v in bound.values() if isinstance(v, torch.Tensor))
        kind, boundaries = _call_boundaries(module, bound)
        if kind == "layout":
            return self._gathered(own, bound, hidden, boundaries)
        if kind is None or hidden.dim() < 2:
            return own(*args, **kwargs)
        spans = spans_of(boundaries, hidden.shape[0], restart=kind == "positions")
        if all(len(row) == 1 for row in spans):
            return own(*args, **kwargs)  # one conversation per row: nothing to keep apart
        if _kernels_ready(module, hidden, bound):
            return own(*args, **kwargs)
        return _each_conversation(own, bound, hidden.shape[:2], spans)

    def _gathered(self, own, bound: dict, hidden: torch.Tensor, layout):
        """Context parallelism: the row's per-token inputs from every rank, each conversation
        alone, this rank's tokens of the output.
        """
        streamed = layout.streamed_mixer(self.module, bound)  # the state passed, where it can be
        if streamed is not None:
            return streamed
        local = hidden.shape[1]
        row = {}
        for key, value in bound.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == local:
                # (1, L, ...) -> (1, T, ...) in row order
                row[key] = layout.in_row_order(value[0])[None]
            elif key != ROW_LAYOUT:
                row[key] = value
        output = _each_conversation(own, row, (1, layout.order.numel()), [layout.conversations()])
        return _map_output(output, lambda table: table[:, layout.queries])


def _bound(function, module: nn.Module, args: tuple, kwargs: dict) -> dict:
    """The call's arguments by name (``**kwargs`` merged in), ``self`` left out."""
    signature = _signature(function)
    arguments = signature.bind(module, *args, **kwargs).arguments
    bound = {}
    for name, value in list(arguments.items())[1:]:
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(value)
        elif signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise TypeError(f"{type(module).__name__}: positional *args cannot be sliced")
        else:
            bound[name] = value
    return bound


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def spans_of(boundaries: torch.Tensor, rows: int, *, restart: bool) -> list[list[tuple[int, int]]]:
    """Each row's conversations as ``(start, end)`` columns, from ``(B or 1, T)`` boundaries:
    ``position_ids`` (``restart``: transformers' rule) or a conversation index (``seq_idx``, a
    conversation of the gathered row: a new one where it changes).
    """
    found = getattr(boundaries, SPANS_ATTRIBUTE, None)
    if found is None:
        values = boundaries.reshape(-1, boundaries.shape[-1])
        if restart:
            starts = position_restarts(values).view(values.shape)
        else:
            starts = torch.ones_like(values, dtype=torch.bool)
            starts[:, 1:] = values[:, 1:] != values[:, :-1]
        # the one copy to the host: (row, column) of each start, not the (B, T) flags
        cuts = [[] for _ in range(starts.shape[0])]
        for row, column in torch.stack(starts.nonzero(as_tuple=True), dim=1).tolist():
            cuts[row].append(column)  # each row's first column is a start
        width = starts.shape[1]
        found = [list(zip(row, row[1:] + [width])) for row in cuts]
        setattr(boundaries, SPANS_ATTRIBUTE, found)
    return found * rows if len(found) == 1 and rows > 1 else found


def _kernels_ready(module: nn.Module, hidden: torch.Tensor, bound: dict) -> bool:
    """Whether the installed kernels keep this call's conversations apart by themselves."""
    kernels = MIXERS[type(module).__name__]
    return (
        bool(kernels)
        and hidden.is_cuda
        and hidden.shape[0] == 1
        and bound.get(SEQ_IDX) is not None
        and bound.get(CU_SEQ_LENS_Q) is not None
        and all(importlib.util.find_spec(name) is not None for name in kernels)
    )


def _each_conversation(own, bound: dict, shape: tuple, spans) -> object:
    """``own`` on every conversation alone (its per-token inputs sliced, no boundary keyword),
    the outputs back in the row's layout.
    """
    rows, width = shape
    pieces = []
    for row, row_spans in enumerate(spans):
        for start, end in row_spans:
            call = {
                key: _slice(value, row, start, end, rows, width)
                for key, value in bound.items()
                if key not in BOUNDARY_KEYS and key != ROW_LAYOUT
            }
            pieces.append((row, own(**call)))
    by_row = [[output for r, output in pieces if r == row] for row in range(rows)]
    return _concatenate(by_row)


def _slice(value, row: int, start: int, end: int, rows: int, width: int):
    """A per-token argument cut to one conversation: ``(B, T, ...)`` (or ``(1, T, ...)``) to
    ``(1, end - start, ...)``, a ``(B, H, T, T)`` mask to its block; others as they are.
    """
    if isinstance(value, (tuple, list)):
        return type(value)(_slice(item, row, start, end, rows, width) for item in value)
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return value
    own_row = slice(row, row + 1) if value.shape[0] == rows else slice(0, 1)
    if value.dim() == 4 and tuple(value.shape[-2:]) == (width, width):
        return value[own_row, :, start:end, start:end]
    if value.shape[1] == width and value.shape[0] in (rows, 1):
        return value[own_row, start:end]
    return value


def _concatenate(by_row: list[list]):
    """The outputs of each row's conversations joined along the tokens, the rows stacked."""
    first = by_row[0][0]
    if isinstance(first, torch.Tensor):
        return torch.cat([torch.cat(outputs, dim=1) for outputs in by_row], dim=0)
    if isinstance(first, (tuple, list)):
        parts = [
            _concatenate([[output[i] for output in outputs] for outputs in by_row])
            for i in range(len(first))
        ]
        return type(first)(parts)
    if first is None:
        return None
    raise TypeError(
        f"a mixer's output of type {type(first).__name__} cannot be joined per conversation"
    )


def _map_output(output, keep):
    if isinstance(output, torch.Tensor):
        return keep(output)
    if isinstance(output, (tuple, list)):
        return type(output)(_map_output(item, keep) for item in output)
    return output
