"""The checks of a loss call's tensors: every bad input ends in an error naming the argument.

- Metadata (free, on the host): one table, :data:`TENSOR_RULES`, then the rules that relate
  arguments (:func:`check_labels`, :func:`check_arguments`, :func:`check_linear`).
- Values are not read here: :func:`packed_ce.pending.check_values`, one record
  (:mod:`packed_ce.records`), now or deferred (:func:`packed_ce.check_pending`).

The layers of checks, outermost first; each checks what enters there and nothing twice:

1. a data set before tokenisation (``integrations/trainers/data_checks.py``, over
   :data:`packed_ce.columns.SEQUENCE_COLUMNS`) and each collated example (``collators/checks.py``);
2. a model call (``integrations/model/guards.py``), its first packed call per attention
   implementation (``model/audit.py``, ``model/probe.py``) and, under context parallelism, each
   rank's shard (``integrations/context_parallel/enable.py``);
3. a loss call's options, once when built (:class:`packed_ce.options.LossOptions`), and its
   tensors' metadata (this module);
4. their values (:mod:`packed_ce.pending`, :mod:`packed_ce.records`).

Dimensions: N tokens, V vocabulary, H hidden size, S sequences, B rows and T tokens per row.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .columns import SEQUENCE_COLUMNS
from .options import SEQUENCE_FIELDS, Boundaries

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def allowed_dtypes(backend: str) -> tuple[torch.dtype, ...]:
    """The input dtypes of a resolved backend: the kernel's three, plus float64 for "torch"."""
    return KERNEL_DTYPES if backend == "triton" else REFERENCE_DTYPES


def check_tensor(name: str, value, *, optional: bool = False) -> None:
    """TypeError unless ``value`` is a tensor (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, torch.Tensor):
        kind = "None or a torch.Tensor" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")


def checked_boundaries(
    cu_seqlens=None, position_ids=None, num_items_in_batch=None, seq_targets=None, seq_weights=None
) -> Boundaries:
    """The call's :class:`Boundaries`, each tensor argument type-checked where it enters (the
    public functions and modules; a model call's guard checks what the model reads first).
    """
    tensors = dict(
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        seq_targets=seq_targets,
        seq_weights=seq_weights,
    )
    for name, value in tensors.items():
        if value is not None:
            check_tensor(name, value)
    return Boundaries(num_items_in_batch=num_items_in_batch, **tensors)


# --- metadata: one table, then the rules that relate arguments -------------------------------


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


# family -> (accepts the dtype, what the message asks for)
DTYPE_FAMILIES = {
    "label": (lambda dtype: dtype in LABEL_DTYPES, "an integer tensor"),
    "integer": (_is_integer, "an integer tensor"),
    "offset": (lambda dtype: dtype in (torch.int32, torch.int64), "int32 or int64"),
    "float": (lambda dtype: dtype.is_floating_point, "a float tensor"),
}


def _shape_error(rule: str, name: str, tensor: torch.Tensor, tokens: int, sequences: int):
    """The message of a tensor that breaks its shape ``rule``, or None."""
    shape = tuple(tensor.shape)
    if rule == "boundaries" and (tensor.dim() != 1 or tensor.numel() < 1):
        return f"{name} must be 1-D (S+1,), got shape {shape}"
    if rule == "per_token" and tensor.numel() != tokens:
        return f"{name} must have one entry per token ({tokens}), got shape {shape}"
    if rule == "per_sequence" and shape != (sequences,):
        return (
            f"{name} must have shape (S,) = ({sequences},), one entry per sequence of "
            f"cu_seqlens, got {shape}"
        )
    return None


@dataclass(frozen=True)
class TensorRule:
    """What an argument's metadata must be.

    Attributes:
        dtypes: a key of :data:`DTYPE_FAMILIES`.
        shape: None (checked against the logits by :func:`check_arguments`), "boundaries"
            ``(S+1,)``, "per_token" (``N`` entries, any shape) or "per_sequence" ``(S,)``.
        partner: the argument it is aligned with and cannot go without.
    """

    dtypes: str
    shape: str | None = None
    partner: str | None = None


TENSOR_RULES = {
    "labels": TensorRule("label"),
    "cu_seqlens": TensorRule("offset", "boundaries"),
    "position_ids": TensorRule("integer", "per_token"),
    # the per-sequence tensors (options.SEQUENCE_FIELDS), of the kind the column table gives
    # their batch values (SEQUENCE_COLUMNS): seq_targets integer, seq_weights float
    **{
        column.key: TensorRule(
            "float" if np.dtype(column.dtype).kind == "f" else "integer",
            "per_sequence",
            partner="cu_seqlens",
        )
        for column in SEQUENCE_COLUMNS
        if column.key in SEQUENCE_FIELDS
    },
}


def _check_rule(name: str, tensors: dict, *, device: torch.device, device_name: str) -> None:
    """One row of :data:`TENSOR_RULES` for ``tensors[name]``, a tensor (skipped when it is None)."""
    tensor, rule = tensors[name], TENSOR_RULES[name]
    if tensor is None:
        return
    if rule.partner is not None and tensors[rule.partner] is None:
        raise ValueError(
            f"{name} needs {rule.partner}: its entries are aligned with the sequences of "
            f"{rule.partner} (PackedCollator and collators.shard_batch return both)"
        )
    accepts, wanted = DTYPE_FAMILIES[rule.dtypes]
    if not accepts(tensor.dtype):
        raise TypeError(f"{name} must be {wanted}, got {tensor.dtype}")
    if rule.shape is not None:
        cu_seqlens = tensors["cu_seqlens"]
        sequences = cu_seqlens.numel() - 1 if cu_seqlens is not None else 0
        error = _shape_error(rule.shape, name, tensor, tensors["labels"].numel(), sequences)
        if error:
            raise ValueError(error)
    if tensor.device != device:
        verb = "are" if name == "labels" else "is"
        raise ValueError(f"{name} {verb} on {tensor.device} but {device_name} on {device}")


def check_labels(
    labels: torch.Tensor,
    boundaries: Boundaries,
    *,
    is_packed: bool,
    device: torch.device,
    name: str = "logits",
) -> None:
    """The labels and the per-call tensors beside them, from metadata (free).

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer, already type-checked by the caller.
        boundaries: the call's :class:`packed_ce.options.Boundaries`, type-checked where they
            entered (:func:`checked_boundaries`).
        is_packed: the option of that name (it needs boundaries).
        device: where the labels and boundaries must be (the logits'), called ``name``.
    """
    tensors = dict(
        labels=labels,
        cu_seqlens=boundaries.cu_seqlens,
        position_ids=boundaries.position_ids,
        seq_targets=boundaries.seq_targets,
        seq_weights=boundaries.seq_weights,
    )
    _check_rule("labels", tensors, device=device, device_name=name)
    cu_seqlens, position_ids = boundaries.cu_seqlens, boundaries.position_ids
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give cu_seqlens or position_ids, not both")
    if is_packed and cu_seqlens is None and position_ids is None:
        raise ValueError(
            "is_packed=True needs the sequence boundaries: pass cu_seqlens or position_ids"
        )
    for argument in ("cu_seqlens", "position_ids", "seq_targets", "seq_weights"):
        _check_rule(argument, tensors, device=device, device_name=name)
    if cu_seqlens is not None and cu_seqlens.numel() == 1 and labels.numel() > 0:
        raise ValueError(
            f"cu_seqlens must be [0, ..., N={labels.numel()}]: one entry holds no sequence"
        )
    count = boundaries.num_items_in_batch
    check_num_items(count)
    # a CPU count is read wherever the labels are (transformers may pass one); any other device
    # than the labels' is a mistake
    if isinstance(count, torch.Tensor) and count.device not in (device, torch.device("cpu")):
        raise ValueError(f"num_items_in_batch is on {count.device} but {name} on {device}")
    if boundaries.seq_targets is not None and not is_packed:
        raise ValueError(
            "seq_targets weighs each target by its conversation (is_packed=True); with "
            "is_packed=False every target weighs 1 wherever its conversation was cut: "
            "pass is_packed=True or drop seq_targets"
        )
    if boundaries.seq_weights is not None and boundaries.seq_weights.requires_grad:
        raise ValueError(
            "seq_weights must not require a gradient: the loss treats weights as data "
            "(pass seq_weights.detach())"
        )


def check_arguments(
    logits_shape: torch.Size,
    logits_dtype: torch.dtype,
    logits_device: torch.device,
    labels: torch.Tensor,
    boundaries: Boundaries,
    *,
    is_packed: bool,
    allowed: tuple[torch.dtype, ...],
    name: str = "logits",
) -> None:
    """Everything metadata tells about a call's tensors: the logits ``(N, V)`` / ``(B, T, V)``
    (or ``hidden @ weight.T``, called ``name``) of a dtype in ``allowed``, then
    :func:`check_labels`.
    """
    check_tensor("labels", labels)
    if logits_dtype not in allowed:
        raise TypeError(f"{name} must have dtype in {allowed}, got {logits_dtype}")
    if len(logits_shape) not in (2, 3):
        raise ValueError(f"{name} must be (N, V) or (B, T, V), got shape {tuple(logits_shape)}")
    if logits_shape[-1] < 1:
        raise ValueError(
            f"{name} must have a vocabulary of V >= 1 classes, got shape {tuple(logits_shape)}"
        )
    if tuple(labels.shape) != tuple(logits_shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(logits_shape[:-1])} to match {name} "
            f"{tuple(logits_shape)}, got {tuple(labels.shape)}"
        )
    check_labels(labels, boundaries, is_packed=is_packed, device=logits_device, name=name)


def check_num_items(num_items_in_batch) -> None:
    """``num_items_in_batch`` is None, an int ``>= 0`` or a one-element tensor.

    A Python number is checked here, always (a float, bool, NaN or inf is refused: the count is
    an integer); a tensor's value lives on the device and is checked by
    :func:`packed_ce.pending.check_values`.
    """
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                "num_items_in_batch must be an int or a 0-d tensor, "
                f"got shape {tuple(num_items_in_batch.shape)}"
            )
        if num_items_in_batch.dtype == torch.bool or num_items_in_batch.is_complex():
            raise TypeError(
                f"num_items_in_batch must be a real tensor, got {num_items_in_batch.dtype}"
            )
    elif isinstance(num_items_in_batch, bool) or not isinstance(
        num_items_in_batch, numbers.Integral
    ):
        raise TypeError(
            "num_items_in_batch must be an int or a 0-d tensor, "
            f"got {type(num_items_in_batch).__name__}"
        )
    elif num_items_in_batch < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {num_items_in_batch}")


def check_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    allowed: tuple[torch.dtype, ...],
) -> None:
    """The LM head's inputs: ``hidden`` ``(N, H)``/``(B, T, H)``, ``weight`` ``(V, H)``, ``bias``
    ``(V,)`` or None, one dtype among ``allowed``, one device.
    """
    if hidden.dtype not in allowed:
        raise TypeError(f"hidden must have dtype in {allowed}, got {hidden.dtype}")
    if hidden.dim() not in (2, 3):
        raise ValueError(f"hidden must be (N, H) or (B, T, H), got shape {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H) with H={hidden.shape[-1]} as in hidden, "
            f"got shape {tuple(weight.shape)}"
        )
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is None:
            continue
        if tensor.dtype != hidden.dtype:
            raise TypeError(
                f"{name} must have the dtype of hidden ({hidden.dtype}), got {tensor.dtype}"
            )
        if tensor.device != hidden.device:
            raise ValueError(f"{name} is on {tensor.device} but hidden on {hidden.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be (V,) = ({weight.shape[0]},), got shape {tuple(bias.shape)}")
