"""What a loss call is configured with, declared once.

- :class:`LossOptions`: every non-tensor option of :func:`packed_ce.cross_entropy` (and of
  :func:`packed_ce.fused_linear_cross_entropy`), validated once when it is built.
- :class:`ChunkOptions`: the options that only the fused LM head + loss has.
- :class:`Boundaries`: the per-call tensors that go with the labels (where sequences start, what
  the mean divides by). They change with every batch, so they are arguments, never options.

The public functions take the options as keywords (``cross_entropy(..., is_packed=True)``) or as
an object (``options=LossOptions(is_packed=True)``); :func:`split_keywords` turns keywords into
these objects, so a new option is one field here and nothing else in the call chain.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "triton", "torch")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _finite_float(name: str, value: Any) -> float:
    """``value`` as a Python float; TypeError for a non-number, ValueError for NaN or inf."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


class KernelFloats(NamedTuple):
    """The three float options as the kernels read them (:attr:`LossOptions.kernel_floats`):
    runtime arguments, so a new value does not recompile; ``softcap=0.0`` means none."""

    label_smoothing: float
    z_loss_scale: float
    softcap: float


@dataclass(frozen=True)
class LossOptions:
    """The options of the packed cross entropy: validated once, then read by every layer.

    Attributes:
        is_packed: weight a target of sequence ``s`` by ``1 / n_s`` (``n_s`` = targets in ``s``),
            so "mean" is the mean over sequences of their mean token loss; needs ``cu_seqlens``
            or ``position_ids``. The weights and the normaliser ``D``: :mod:`packed_ce.targets`.
        shift: ``labels`` are aligned with the inputs (transformers' causal-LM convention): the
            target of ``logits[t]`` is ``labels[t+1]`` if ``t+1`` is in the same sequence (or
            row, without boundaries), else none. Never crosses a sequence boundary.
        ignore_index: label value that is not a target (0 loss, 0 gradient).
        reduction: "mean" (``sum / D``, ``D`` = ``num_items_in_batch`` or
            :func:`packed_ce.count_normaliser`; ``D == 0`` gives loss 0 and zero gradients),
            "sum", or "none" (per token, ``labels``-shaped, summing to "sum").
        label_smoothing: ``eps`` in ``[0, 1]``, PyTorch's meaning.
        z_loss_scale: weight (``>= 0``) of ``lse**2`` in each token's loss.
        softcap: None, or ``c > 0``: logits pass through ``c * tanh(x / c)`` first.
        return_z_loss: also return the z-term, reduced like the loss, detached (for logging;
            it is already included in the loss).
        return_token_stats: also return a :class:`packed_ce.TokenStats`: the sums, over the
            rows with a target, of each row's softmax entropy and top-1 hit, and their number,
            from the loss's own read of the logits (no second pass), detached, whatever the
            reduction.
        return_seq_losses: also return a :class:`packed_ce.SequenceLosses`: each sequence's
            share of the loss (``sum_t coef_t l_t`` over its targets, which add up to the loss)
            and of the weight (``sum_t coef_t``), from the same pass as the loss, detached; their
            ratio is the sequence's mean token loss (for a loss per data source, say).
        inplace_backward: the kernel may write the gradient into the storage of ``logits``,
            which then no longer hold the logits (saves one ``(N, V)`` buffer). With False the
            input is never modified. No effect on the fused loss, whose logits are internal.
        backend: "triton" (the kernel; on CPU tensors through the Triton interpreter when
            ``TRITON_INTERPRET=1``), "torch" (the PyTorch reference), or "auto" (the kernel on
            CUDA, the reference elsewhere).
        validate: check the values (label range, the contents of ``cu_seqlens``,
            ``seq_targets``, ``seq_weights`` and of a tensor ``num_items_in_batch``); a bad one
            raises a ValueError naming it, inside the call or at the next one
            (:func:`packed_ce.check_pending` says when). With False nothing is checked and only
            memory safety is promised (no out-of-bounds access, no device assert, no hang): the
            result of a call with invalid values is unspecified, and may differ by backend.

    Raises:
        TypeError / ValueError naming the field, for a wrong type, an unknown name, a value out
        of range, or a NaN/infinite float.

    Example:
        >>> options = LossOptions(is_packed=True, shift=True, softcap=30)
        >>> options.softcap, options.reduction
        (30.0, 'mean')
        >>> LossOptions(label_smoothing=float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: label_smoothing must be finite, got nan
    """

    is_packed: bool = False
    shift: bool = False
    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss_scale: float = 0.0
    softcap: float | None = None
    return_z_loss: bool = False
    return_token_stats: bool = False
    return_seq_losses: bool = False
    inplace_backward: bool = False
    backend: str = "auto"
    validate: bool = True

    def __post_init__(self):
        for name in ("is_packed", "shift", "return_z_loss", "inplace_backward", "validate"):
            _check_bool(name, getattr(self, name))
        _check_bool("return_token_stats", self.return_token_stats)
        _check_bool("return_seq_losses", self.return_seq_losses)
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise TypeError(f"ignore_index must be an int, got {self.ignore_index!r}")
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {REDUCTIONS}, got {self.reduction!r}")
        if self.backend not in BACKENDS:
            raise ValueError(
                f"backend must be 'auto', 'triton' or 'torch', got {self.backend!r}"
            )
        label_smoothing = _finite_float("label_smoothing", self.label_smoothing)
        if not 0.0 <= label_smoothing <= 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
        z_loss_scale = _finite_float("z_loss_scale", self.z_loss_scale)
        if z_loss_scale < 0.0:
            raise ValueError(f"z_loss_scale must be >= 0, got {z_loss_scale}")
        softcap = self.softcap
        if softcap is not None:
            softcap = _finite_float("softcap", softcap)
            if not softcap > 0.0:
                raise ValueError(f"softcap must be None or > 0, got {softcap}")
        # stored as Python floats: every backend then reads the same value
        object.__setattr__(self, "label_smoothing", label_smoothing)
        object.__setattr__(self, "z_loss_scale", z_loss_scale)
        object.__setattr__(self, "softcap", softcap)

    @property
    def kernel_floats(self) -> KernelFloats:
        """``label_smoothing``, ``z_loss_scale`` and ``softcap`` (0.0 for None) for the kernels."""
        softcap = 0.0 if self.softcap is None else self.softcap
        return KernelFloats(self.label_smoothing, self.z_loss_scale, softcap)


@dataclass(frozen=True)
class ChunkOptions:
    """The options of :func:`packed_ce.fused_linear_cross_entropy` beyond :class:`LossOptions`.

    Attributes:
        grad_accumulation_dtype: dtype of the running sum ``dL/dW = sum_c G_c^T X_c`` over
            chunks. None (default): the weight's dtype, no memory beyond ``dL/dW`` itself; with
            a bf16 weight the sum is rounded to bf16 after each of the ``ceil(N / chunk_size)``
            chunks (8 significant bits, up to ``2**-9`` relative per rounding) where the unfused
            GEMM rounds once. ``torch.float32``: one rounding at the end, as unfused, for an
            extra ``V * H * 4`` bytes while the forward runs (2 GiB at V=128256, H=4096) and
            twice the accumulator traffic per chunk. Never narrower than the weight's dtype.
        chunk_size: rows of logits per chunk; default at most 256 MiB per chunk (1024 rows
            at V=128256 in bf16; fewer when rows are dropped, whose gathered ``(C, H)`` rows
            and gradient count too). Larger chunks use more memory and run the GEMMs on larger
            tiles.
        drop_ignored_rows: leave the rows without a target (``ignore_index``, the last token of
            each sequence under ``shift``, and every row when ``D == 0``) out of the GEMMs. The
            result is the same (their loss and gradient are 0) and the work shrinks by their
            share, typically the prompts in supervised fine-tuning, but the host waits for the
            device once per call to learn their number. None (default): drop them where that
            wait pays, see :func:`packed_ce.chunks.drops_rows`: on CPU always, on a GPU from
            ``N * H * V >= 2**40`` on (for example 8192 rows, H=2048, V=65536: GEMMs of about
            9 ms on an H100, where the wait costs 0.1-0.6 ms), and never while tracing
            (torch.compile, CUDA-graph capture) or when ``torch.cuda.set_sync_debug_mode``
            asks to hear of host syncs. False: never (no host sync at all). True: always,
            except while tracing.
    """

    grad_accumulation_dtype: torch.dtype | None = None
    chunk_size: int | None = None
    drop_ignored_rows: bool | None = None

    def __post_init__(self):
        dtype = self.grad_accumulation_dtype
        floating = isinstance(dtype, torch.dtype) and dtype.is_floating_point
        if dtype is not None and not floating:
            raise TypeError(
                f"grad_accumulation_dtype must be None or a floating torch.dtype, got {dtype!r}"
            )
        size = self.chunk_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"chunk_size must be None or a positive int, got {size!r}")
        drop = self.drop_ignored_rows
        if drop is not None and not isinstance(drop, bool):
            raise TypeError(f"drop_ignored_rows must be None, True or False, got {drop!r}")


@dataclass(frozen=True)
class Boundaries:
    """The per-call tensors beside ``logits`` and ``labels``; see the contract's conventions.

    Checked against the labels by :func:`packed_ce.validation.check_arguments` (types, shapes,
    devices) and :func:`packed_ce.validation.check_values` (contents), never here: they change
    with every batch and may live on the GPU.

    Attributes:
        cu_seqlens: ``(S+1,)`` int32/int64 on the labels' device, ``0 = c_0 <= ... <= c_S = N``;
            sequence ``s`` is tokens ``[c_s, c_{s+1})`` of the flattened ``N = B*T`` tokens.
        position_ids: instead of ``cu_seqlens``, ``N`` entries; a sequence starts at token 0 of
            each row and wherever ``position_ids[t] != position_ids[t-1] + 1``.
        num_items_in_batch: the global ``D`` (an int or a 0-d tensor) when one optimiser step
            spans several micro-batches or processes.
        seq_targets: ``(S,)`` integer, aligned with ``cu_seqlens`` (which it needs): the number
            of targets of the whole conversation each sequence belongs to (a conversation split
            across rows or context-parallel ranks), ``>= 1`` and ``>=`` the sequence's own
            count. Only with ``is_packed=True``: a target of ``s`` weighs
            ``1 / seq_targets[s]`` instead of ``1 / n_s``.
        seq_weights: ``(S,)`` float, aligned with ``cu_seqlens`` (which it needs), finite and
            ``>= 0``: each sequence's conversation weight, multiplying ``w_t`` of its targets.
            Data, not a parameter: it must not require a gradient.
    """

    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    num_items_in_batch: int | torch.Tensor | None = None
    seq_targets: torch.Tensor | None = None
    seq_weights: torch.Tensor | None = None


LOSS_FIELDS = frozenset(field.name for field in dataclasses.fields(LossOptions))
CHUNK_FIELDS = frozenset(field.name for field in dataclasses.fields(ChunkOptions))
BOUNDARY_FIELDS = frozenset(field.name for field in dataclasses.fields(Boundaries))


def split_keywords(
    keywords: Mapping[str, Any],
    options: LossOptions | None = None,
    *,
    chunked: bool = False,
    chunk_options: ChunkOptions | None = None,
) -> tuple[LossOptions, ChunkOptions | None]:
    """The option objects of a call's keywords, layered over ``options`` / ``chunk_options``.

    Args:
        keywords: fields of :class:`LossOptions` (and of :class:`ChunkOptions` if ``chunked``).
        options, chunk_options: objects the keywords override (defaults when None).
        chunked: accept the fields of :class:`ChunkOptions` too.

    Returns:
        ``(LossOptions, ChunkOptions)``; the second is None unless ``chunked``.

    Raises:
        TypeError naming an unknown keyword, and whatever the objects' validation raises.
    """
    allowed = LOSS_FIELDS | CHUNK_FIELDS if chunked else LOSS_FIELDS
    unknown = sorted(set(keywords) - allowed)
    if unknown:
        tensors = set(unknown) & (BOUNDARY_FIELDS | {"bias"})
        what = "a per-call tensor (a module takes it in forward), " if tensors else ""
        raise TypeError(
            f"{', '.join(unknown)}: {what}not an option; the options are {sorted(allowed)}"
        )
    objects = (("options", options, LossOptions), ("chunk_options", chunk_options, ChunkOptions))
    for name, value, kind in objects:
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    loss = {k: v for k, v in keywords.items() if k in LOSS_FIELDS}
    options = options if options is not None else LossOptions()
    options = dataclasses.replace(options, **loss) if loss else options
    if not chunked:
        return options, None
    chunk = {k: v for k, v in keywords.items() if k in CHUNK_FIELDS}
    chunk_options = chunk_options if chunk_options is not None else ChunkOptions()
    return options, dataclasses.replace(chunk_options, **chunk) if chunk else chunk_options


def changed_fields(*objects) -> str:
    """``"name=value, ..."`` for the fields that differ from their defaults (a module's repr)."""
    parts = []
    for obj in objects:
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            if value != field.default:
                parts.append(f"{field.name}={value!r}")
    return ", ".join(parts)
