"""Token mixing that is not attention, kept within each packed conversation.

A hybrid family's short convolutions, gated delta rules and state-space scans (:data:`MIXERS`)
read the tokens before each position in the row, whatever the attention mask says: packed, a
conversation started from the state of the one before. Each such module's ``forward`` is replaced
(undoably, by :func:`install`) with a :class:`PerConversation` that reads the call's
:class:`~packed_ce.layout.PackedLayout` and

- where the kernels that keep conversations apart are installed (:class:`families.Mixer`), runs
  the call's rows whole, flattened into one row, in one call: the layout's ``seq_idx`` and
  ``cu_seq_lens_q`` (and the family's own boundary keyword) reach the kernels, the short
  convolution is kept per conversation by ``convolution.py``;
- else runs the module on each conversation alone, its per-token inputs sliced, and puts the
  outputs back in the row (a mixer's output at a token depends on the tokens of its row up to it
  only, so this is every conversation alone, exactly), after one warning naming the packages that
  would run the row whole;
- under context parallelism: gathers its per-token inputs from the ranks, runs the row's
  conversations as above and keeps this rank's tokens (the gather's backward sums the ranks'
  gradients, as for keys and values).

The layout comes with the mixer's own call (transformers hands the model call's keywords on to
the layers and most layers to their mixer), else from the enclosing decoder layer's call, which
hooks on the decoder layers record (Jamba's layers call their mixer without keywords) and, under
gradient checkpointing, where transformers recomputes a layer past its hooks, its checkpointing
function records (:class:`Replayed`). Nothing derived from a call is kept for the next.
"""

from __future__ import annotations

import functools
import inspect
import threading
import warnings

import torch
from torch import nn

from ...columns import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    LAYOUT,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    ROW_LAYOUT,
)
from ...layout import SEQ_IDX, PackedLayout
from . import convolution
from .families import MIXERS

# Keywords that tell a mixer where conversations start: dropped from a call on one conversation,
# which has none inside, and replaced on a whole row's call by the layout's.
# fla's varlen kernels' host copy of cu_seqlens (their chunks laid out without a device sync)
CU_SEQLENS_CPU = "cu_seqlens_cpu"
BOUNDARY_KEYS = (
    SEQ_IDX,
    CU_SEQLENS_CPU,
    CU_SEQ_LENS_Q,
    CU_SEQ_LENS_K,
    MAX_LENGTH_Q,
    MAX_LENGTH_K,
    CU_SEQLENS,
    LAYOUT,
    ROW_LAYOUT,
)
# The innermost decoder layer call of this thread: its arguments by name.
_layers = threading.local()
# transformers' gradient-checkpointing function of a layer (trainers/seams.py lists it).
CHECKPOINT_FUNCTION = "_gradient_checkpointing_func"
# Mixer classes already warned about running per conversation (a warning, once per class).
_warned: set[str] = set()


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
        conv = MIXERS[type(mixer).__name__].conv
        if conv is not None:
            convolution.install(mixer, conv)
    hooks = []
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(_enter_layer, with_kwargs=True))
        hooks.append(layer.register_forward_hook(_leave_layer, always_call=True))
    return [*mixers, *hooks]


def uninstall(installed: list, layers: list[nn.Module]) -> None:
    """Undoes :func:`install`: the mixers' own forward, no layer hook, the ``layers``' own
    checkpointing function.
    """
    for item in installed:
        if isinstance(item, nn.Module):
            del item.forward
        else:
            item.remove()
    for layer in layers:
        own = getattr(layer, CHECKPOINT_FUNCTION, None)
        if isinstance(own, Replayed):
            setattr(layer, CHECKPOINT_FUNCTION, own.own)


def whole_row(module: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether the installed kernels keep a packed call of ``module`` apart by themselves."""
    kernels = MIXERS[type(module).__name__].kernels
    if kernels is None:
        return False
    return not kernels or (hidden.is_cuda and all(map(convolution.installed, kernels)))


def _enter_layer(layer: nn.Module, args: tuple, kwargs: dict) -> None:
    _push(layer, _bound(type(layer).forward, layer, args, kwargs))
    own = getattr(layer, CHECKPOINT_FUNCTION, None)
    if own is not None and not isinstance(own, Replayed):
        setattr(layer, CHECKPOINT_FUNCTION, Replayed(layer, own))


def _leave_layer(layer: nn.Module, args: tuple, output) -> None:
    _layers.stack.pop()


def _push(layer: nn.Module, arguments: dict) -> None:
    stack = getattr(_layers, "stack", None)
    if stack is None:
        stack = _layers.stack = []
    stack.append((layer, arguments))


class Replayed:
    """A decoder layer's gradient-checkpointing function whose recomputation records the layer's
    call as its hooks do: transformers recomputes a checkpointed layer's ``forward`` in the
    backward, past the module hooks, with the keywords of the call (``partial(forward, self,
    **kwargs)``), where a mixer called without keywords (Jamba's) finds the row's layout.
    Installed by the layer's pre-hook (transformers sets the function when checkpointing is
    enabled, before or after :func:`install`), removed by :func:`uninstall`.
    """

    def __init__(self, layer: nn.Module, own):
        self.layer, self.own = layer, own

    def __call__(self, function, *args, **kwargs):
        return self.own(functools.partial(_replay, self.layer, function), *args, **kwargs)


def _replay(layer: nn.Module, function, *args):
    """``function(*args)`` (a checkpointed layer call) with the layer's keywords recorded, unless
    its hook recorded the call already (the forward, not a recomputation).
    """
    stack = getattr(_layers, "stack", None)
    if stack and stack[-1][0] is layer:
        return function(*args)
    _push(layer, dict(getattr(function, "keywords", None) or {}))
    try:
        return function(*args)
    finally:
        _layers.stack.pop()


def _layouts_in(arguments: dict, shape: tuple[int, int]):
    """``("row", RowLayout)``, ``("packed", PackedLayout)`` or None from a call's arguments (a
    layer's ``position_ids`` give a layout of their own).
    """
    if arguments.get(ROW_LAYOUT) is not None:
        return "row", arguments[ROW_LAYOUT]
    if arguments.get(LAYOUT) is not None:
        return "packed", arguments[LAYOUT]
    if isinstance(arguments.get(POSITION_IDS), torch.Tensor):
        layout = PackedLayout.of_call({POSITION_IDS: arguments[POSITION_IDS]}, shape)
        return None if layout is None else ("packed", layout)
    return None


def _call_layout(module: nn.Module, bound: dict, shape: tuple[int, int]):
    """Where a mixer call's conversations come from (:func:`_layouts_in`): its own arguments, then
    its decoder layer's call (recorded by the hooks, or by :class:`Replayed` in a recomputation).

    Raises:
        ValueError: for a packed row found only in a gradient-checkpointed layer's
            ``position_ids``, which a recomputation could not find again.
    """
    found = _layouts_in(bound, shape)
    if found is not None:
        return found
    if getattr(_layers, "stack", None):
        layer, arguments = _layers.stack[-1]
        found = _layouts_in(arguments, shape)
        handed = arguments.get(LAYOUT) is not None or arguments.get(ROW_LAYOUT) is not None
        if (
            found is not None
            and not handed
            and found[1].packed
            and layer.training
            and getattr(layer, "gradient_checkpointing", False)
        ):
            raise ValueError(
                f"{type(module).__name__} is called without the batch's boundaries by its "
                f"{type(layer).__name__}, which gradient checkpointing recomputes where they "
                "cannot be found again: train this family packed without gradient checkpointing, "
                "or unpacked with it"
            )
        return found
    return None


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
        if hidden.dim() < 2:
            return own(*args, **kwargs)
        found = _call_layout(module, bound, tuple(hidden.shape[:2]))
        if found is None:
            return own(*args, **kwargs)
        kind, layout = found
        if kind == "row":
            return self._gathered(own, bound, hidden, layout)
        if not layout.packed:
            return own(*args, **kwargs)  # one conversation per row: nothing to keep apart
        if whole_row(module, hidden):
            return _whole_row(own, bound, layout, MIXERS[type(module).__name__].boundary_keyword)
        _warn_once(module)
        return _each_conversation(own, bound, layout.shape, layout.spans)

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


def _warn_once(module: nn.Module) -> None:
    name = type(module).__name__
    if name in _warned:
        return
    _warned.add(name)
    kernels = MIXERS[name].kernels
    fast = (
        f"on a CUDA device with {' and '.join(kernels)} installed the row runs whole"
        if kernels
        else "no installed kernel takes a conversation boundary for it"
    )
    warnings.warn(
        f"{name} runs each conversation of a packed row alone (exact, slower than the whole "
        f"row): {fast}",
        stacklevel=3,
    )


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


def _whole_row(own, bound: dict, layout: PackedLayout, boundary_keyword: str | None):
    """``own`` on the call's rows flattened into one ``(1, B T)`` row with the layout's varlen
    keywords (and ``cu_seqlens`` under ``boundary_keyword``), the output back to ``(B, T, ...)``.
    """
    rows, width = layout.shape
    call = {
        key: _flat(value, rows, width) for key, value in bound.items() if key not in BOUNDARY_KEYS
    }
    call.update(layout.flat_keywords())
    call[CU_SEQLENS_CPU] = layout.host_cu_seqlens_tensor  # fla: no device read per layer
    if boundary_keyword is not None:
        call[boundary_keyword] = layout.cu_seqlens
    accepted = _signature(type(own.__self__).forward).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        call = {key: value for key, value in call.items() if key in accepted}  # LFM2 in 5.17
    output = own(**call)
    if rows == 1:
        return output
    return _map_output(output, lambda table: _unflat(table, rows, width))


def _flat(value, rows: int, width: int):
    """A per-token ``(B, T, ...)`` argument as ``(1, B T, ...)``; others as they are."""
    if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[:2] == (rows, width):
        return value.reshape(1, rows * width, *value.shape[2:])
    return value


def _unflat(value: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    if value.dim() >= 2 and value.shape[:2] == (1, rows * width):
        return value.reshape(rows, width, *value.shape[2:])
    return value


def _each_conversation(own, bound: dict, shape: tuple, spans) -> object:
    """``own`` on every conversation alone (its per-token inputs sliced, no boundary keyword),
    the outputs back in the row's layout.
    """
    rows, width = shape
    by_row = []
    for row, row_spans in enumerate(spans):
        outputs = []
        for start, end in row_spans:
            call = {
                key: _slice(value, row, start, end, rows, width)
                for key, value in bound.items()
                if key not in BOUNDARY_KEYS
            }
            outputs.append((end - start, own(**call)))
        by_row.append(outputs)
    return _join(by_row)


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


def _join(by_row: list[list[tuple[int, object]]]):
    """Each row's conversation outputs joined along the tokens, the rows stacked.

    A per-token output (``(1, L, ...)`` for a conversation of ``L`` tokens) is joined; any other
    (a conversation's final recurrent state, as MiniMax's lightning attention returns beside its
    output) describes one conversation, not the row: None.
    """
    first = by_row[0][0][1]
    if isinstance(first, (tuple, list)):
        parts = [
            _join([[(length, output[i]) for length, output in outputs] for outputs in by_row])
            for i in range(len(first))
        ]
        return type(first)(parts)
    per_token = all(
        isinstance(output, torch.Tensor) and output.dim() >= 2 and output.shape[1] == length
        for outputs in by_row
        for length, output in outputs
    )
    if not per_token:
        if first is None or isinstance(first, torch.Tensor):
            return None
        raise TypeError(
            f"a mixer's output of type {type(first).__name__} cannot be joined per conversation"
        )
    return torch.cat(
        [torch.cat([output for _, output in outputs], dim=1) for outputs in by_row], dim=0
    )


def _map_output(output, keep):
    if isinstance(output, torch.Tensor):
        return keep(output)
    if isinstance(output, (tuple, list)):
        return type(output)(_map_output(item, keep) for item in output)
    return output
