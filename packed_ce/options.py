"""What a loss call is configured with, declared once: :class:`LossOptions` (validated when
built), :class:`ChunkOptions` (the fused head's own) and :class:`Boundaries` (the per-call
tensors). :func:`split_keywords` turns keywords into the objects, so a new option is one field
here.
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
    runtime arguments, so a new value does not recompile; ``softcap=0.0`` means none.
    """

    label_smoothing: float
    z_loss_scale: float
    softcap: float


@dataclass(frozen=True)
class LossOptions:
    """The options of the packed cross entropy: validated once, then read by every layer.

    Attributes:
        is_packed: weight a target of sequence ``s`` by ``1 / n_s``: "mean" is the mean over
            sequences of their mean token loss; needs ``cu_seqlens`` or ``position_ids``.
        shift: ``labels`` aligned with the inputs: the target of ``logits[t]`` is ``labels[t+1]``
            if ``t+1`` is in the same sequence, else none.
        ignore_index: label value that is not a target (0 loss, 0 gradient).
        reduction: "mean" (``sum / D``; ``D == 0`` gives loss 0 and zero gradients), "sum", or
            "none" (``labels``-shaped, summing to "sum").
        label_smoothing: ``eps`` in ``[0, 1]``, PyTorch's meaning.
        z_loss_scale: weight (``>= 0``) of ``lse**2`` in each token's loss.
        softcap: None, or ``c > 0``: logits pass through ``c * tanh(x / c)`` first.
        return_z_loss: also return the z-term (included in the loss), detached.
        return_token_stats: also return a :class:`packed_ce.TokenStats` from the same pass.
        return_seq_losses: also return a :class:`packed_ce.SequenceLosses` from the same pass.
        inplace_backward: the gradient may be written into the storage of ``logits`` (one
            ``(N, V)`` buffer saved); with False the input is never modified.
        backend: "triton" (on CPU through the interpreter, ``TRITON_INTERPRET=1``), "torch"
            (the reference) or "auto" (the kernel on CUDA, the reference elsewhere).
        validate: check the values (labels, boundaries, weights, a tensor
            ``num_items_in_batch``), raising a ValueError naming the bad one now or at the next
            call (:func:`packed_ce.check_pending`). False promises only memory safety: the result
            of invalid values is unspecified.

    Raises:
        TypeError / ValueError naming the field, for a wrong type, an unknown name, a value out of
            range, or a NaN/infinite float.

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
            raise ValueError(f"backend must be 'auto', 'triton' or 'torch', got {self.backend!r}")
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
        grad_accumulation_dtype: dtype of the running ``dL/dW = sum_c G_c^T X_c``. None: the
            weight's (a bf16 sum is rounded after every chunk, up to ``2**-9`` relative each).
            ``torch.float32``: one rounding, as unfused, for ``V * H * 4`` extra bytes (2 GiB
            at V=128256, H=4096). Never narrower than the weight's dtype.
        chunk_size: rows of logits per chunk; default: at most 256 MiB per chunk.
        drop_ignored_rows: leave rows without a target out of the GEMMs (same result, less
            work, one host wait per call). None: where the wait pays
            (:func:`packed_ce.chunks.drops_rows`: CPU, or ``N * H * V >= 2**40`` on a GPU, where
            GEMMs of ~9 ms dwarf a 0.1-0.6 ms wait), never while tracing or under
            ``torch.cuda.set_sync_debug_mode``. False: never. True: always, except tracing.
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
    """The per-call tensors beside ``logits`` and ``labels`` (the contract's conventions), checked
    by :mod:`packed_ce.validation`, never here.

    Attributes:
        cu_seqlens: ``(S+1,)`` int32/int64, ``0 = c_0 <= ... <= c_S = N``.
        position_ids: instead, ``N`` entries; a sequence starts wherever they do not count up.
        num_items_in_batch: the global ``D`` (an int or a 0-d tensor).
        seq_targets: ``(S,)`` integer, ``>= 1`` and ``>= n_s``: the targets of each sequence's
            whole conversation; a target of ``s`` weighs ``1 / seq_targets[s]`` (``is_packed``).
        seq_weights: ``(S,)`` float, finite, ``>= 0``, no gradient: each conversation's weight.
    """

    cu_seqlens: torch.Tensor | None = None
    position_ids: torch.Tensor | None = None
    num_items_in_batch: int | torch.Tensor | None = None
    seq_targets: torch.Tensor | None = None
    seq_weights: torch.Tensor | None = None

    def tensors(self) -> dict[str, Any]:
        """The per-call tensors given (every field but ``num_items_in_batch`` that is not None)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.name != "num_items_in_batch" and getattr(self, field.name) is not None
        }


LOSS_FIELDS = frozenset(field.name for field in dataclasses.fields(LossOptions))
CHUNK_FIELDS = frozenset(field.name for field in dataclasses.fields(ChunkOptions))
BOUNDARY_FIELDS = frozenset(field.name for field in dataclasses.fields(Boundaries))
# The per-sequence tensors of a call (aligned with cu_seqlens), as a batch carries them under the
# same names: what the packed forward carries to the loss and the layout reads from a batch.
SEQUENCE_FIELDS = tuple(f.name for f in dataclasses.fields(Boundaries) if f.name.startswith("seq_"))


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
