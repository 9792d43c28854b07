"""Argument and value checks of the loss: every bad input ends in an error naming the argument.

Two kinds, at two times:

- :func:`check_tensor`, :func:`check_arguments`, :func:`check_linear`: types, shapes, dtypes and
  devices, read from tensor metadata on the host (free, before anything runs). The non-tensor
  options are checked once, when their :class:`packed_ce.options.LossOptions` is built.
- :func:`check_values`: label range and ``cu_seqlens`` contents, which live on the device (one
  host sync; run after the kernel is queued, skipped while tracing).

Dimensions: N tokens, V vocabulary, H hidden size, S sequences, B rows and T tokens per row.
"""

from __future__ import annotations

import numbers

import torch

from .options import Boundaries

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
LABEL_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def allowed_dtypes(backend: str) -> tuple[torch.dtype, ...]:
    """The input dtypes of a resolved backend: the kernel's three, plus float64 for "torch"."""
    return KERNEL_DTYPES if backend == "triton" else REFERENCE_DTYPES


def is_tracing() -> bool:
    """True under torch.compile or CUDA-graph capture, where a host sync is impossible."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_tensor(name: str, value, *, optional: bool = False) -> None:
    """TypeError unless ``value`` is a tensor (or None when ``optional``)."""
    if optional and value is None:
        return
    if not isinstance(value, torch.Tensor):
        kind = "None or a torch.Tensor" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {kind}, got {type(value).__name__}")


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
    """Checks everything about the tensors that metadata tells (free: no device access).

    Args:
        logits_shape: ``(N, V)`` or ``(B, T, V)``, of the logits (or of ``hidden @ weight.T``).
        logits_dtype, logits_device: theirs.
        labels: ``(N,)`` or ``(B, T)`` integer.
        boundaries: the call's :class:`packed_ce.options.Boundaries`.
        is_packed: the option of that name (it needs boundaries).
        allowed: the logits dtypes of the backend (:func:`allowed_dtypes`).
        name: how the logits are called in messages.
    """
    check_tensor("labels", labels)
    if logits_dtype not in allowed:
        raise TypeError(f"{name} must have dtype in {allowed}, got {logits_dtype}")
    if len(logits_shape) not in (2, 3):
        raise ValueError(f"{name} must be (N, V) or (B, T, V), got shape {tuple(logits_shape)}")
    if logits_shape[-1] < 1:
        raise ValueError(f"{name} must have a vocabulary of V >= 1 classes, got shape {tuple(logits_shape)}")
    if tuple(labels.shape) != tuple(logits_shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(logits_shape[:-1])} to match {name} "
            f"{tuple(logits_shape)}, got {tuple(labels.shape)}"
        )
    check_labels(labels, boundaries, is_packed=is_packed, device=logits_device, name=name)


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
        labels: ``(N,)`` or ``(B, T)`` integer.
        boundaries: the call's :class:`packed_ce.options.Boundaries`.
        is_packed: the option of that name (it needs boundaries).
        device: where the labels and boundaries must be (the logits'), called ``name``.
    """
    check_tensor("labels", labels)
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    logits_device = device
    if labels.device != logits_device:
        raise ValueError(f"labels are on {labels.device} but {name} on {logits_device}")
    cu_seqlens, position_ids = boundaries.cu_seqlens, boundaries.position_ids
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give cu_seqlens or position_ids, not both")
    if is_packed and cu_seqlens is None and position_ids is None:
        raise ValueError(
            "is_packed=True needs the sequence boundaries: pass cu_seqlens or position_ids"
        )
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens)
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D (S+1,), got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.numel() == 1 and labels.numel() > 0:
            raise ValueError(
                f"cu_seqlens must be [0, ..., N={labels.numel()}]: one entry holds no sequence"
            )
        if cu_seqlens.device != logits_device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {name} on {logits_device}")
    if position_ids is not None:
        check_tensor("position_ids", position_ids)
        if position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise TypeError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
        if position_ids.numel() != labels.numel():
            raise ValueError(
                f"position_ids must have one entry per token ({labels.numel()}), "
                f"got shape {tuple(position_ids.shape)}"
            )
        if position_ids.device != logits_device:
            raise ValueError(
                f"position_ids is on {position_ids.device} but {name} on {logits_device}"
            )
    count = boundaries.num_items_in_batch
    check_num_items(count)
    # a CPU count is read wherever the labels are (transformers may pass one); any other device
    # than the labels' is a mistake
    if isinstance(count, torch.Tensor) and count.device not in (logits_device, torch.device("cpu")):
        raise ValueError(f"num_items_in_batch is on {count.device} but {name} on {logits_device}")


def check_num_items(num_items_in_batch) -> None:
    """``num_items_in_batch`` is None, an int ``>= 0`` or a one-element tensor.

    A Python number is checked here, always (a float, bool, NaN or inf is refused: the count is
    an integer); a tensor's value lives on the device and is checked by :func:`check_values`.
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
    elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, numbers.Integral):
        raise TypeError(
            "num_items_in_batch must be an int or a 0-d tensor, "
            f"got {type(num_items_in_batch).__name__}"
        )
    elif num_items_in_batch < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {num_items_in_batch}")


def check_first_order(what: str, fix: str) -> None:
    """RuntimeError inside a backward run with ``create_graph=True`` (grad mode is on there).

    The kernels' gradients are computed outside autograd and carry no graph: a gradient of the
    gradient would silently be missing, so it is refused at the first backward instead.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{what} gives first-order gradients only (its backward builds no graph), so "
            f"create_graph=True cannot give a higher-order gradient: use {fix} for that"
        )


def check_linear(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    allowed: tuple[torch.dtype, ...],
) -> None:
    """The LM head's inputs: ``hidden`` ``(N, H)``/``(B, T, H)``, ``weight`` ``(V, H)``, ``bias``
    ``(V,)`` or None, one dtype among ``allowed``, one device."""
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


def check_values(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None,
    num_items_in_batch: int | torch.Tensor | None = None,
) -> None:
    """Checks label range, ``cu_seqlens`` contents and a tensor ``num_items_in_batch``'s value
    (finite, ``>= 0``): one host sync on CUDA, one bool read.

    Skipped while tracing (torch.compile, CUDA-graph capture), where no sync is possible, and
    with ``validate=False``. Both backends then give the same defined result on bad values: an
    out-of-range label gives a NaN loss, ``cu_seqlens`` is read as :func:`clamp_cu_seqlens`
    makes it, and a negative or non-finite ``num_items_in_batch`` gives a NaN loss.
    """
    if is_tracing() or labels.device.type == "meta":  # meta tensors have no values to check
        return
    # In int64: compared in a narrow dtype, V and ignore_index would wrap (uint8: 300 -> 44,
    # -100 -> 156), refusing valid labels and passing invalid ones.
    labels = labels.to(torch.int64)
    bad_label = ((labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))).any()
    flags = [bad_label]
    if cu_seqlens is not None:
        n = labels.numel()
        flags += [
            cu_seqlens[0] != 0,
            cu_seqlens[-1] != n,
            (cu_seqlens[1:] < cu_seqlens[:-1]).any(),
        ]
    count = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
    if count is not None:
        count = count.reshape(()).to(device=labels.device, dtype=torch.float64)
        flags.append(~torch.isfinite(count) | (count < 0))
    # One transfer for all the checks; the detailed message is computed only on failure.
    failed = torch.stack(flags).cpu().tolist()
    if not any(failed):
        return
    if failed[0]:
        bad = labels[(labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))]
        raise ValueError(
            f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"found {bad.numel()} bad values, e.g. {bad[:5].tolist()}"
        )
    if count is not None and failed[-1]:
        raise ValueError(
            f"num_items_in_batch must be finite and >= 0, got {count.item()}: pass the number of "
            "targets (or sequences with a target) of the optimiser step"
        )
    cu = cu_seqlens.tolist()
    if failed[1]:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if failed[2]:
        raise ValueError(f"cu_seqlens must end at N={labels.numel()}, got {cu[-1]}")
    more = "..." if len(cu) > 16 else ""
    raise ValueError(f"cu_seqlens must be non-decreasing, got {cu[:16]}{more}")


def clamp_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``cu_seqlens`` made well formed, the way every backend reads it.

    A valid ``cu_seqlens`` comes back equal. A malformed one (possible only where
    :func:`check_values` was skipped) is clamped to ``[0, N]``, made non-decreasing by a running
    maximum, and its first and last entries set to 0 and ``N``, so both backends compute the
    same loss on it. A few tiny launches on ``(S+1,)`` values, no host sync.

    Args:
        cu_seqlens: ``(S+1,)`` int32/int64 with ``S + 1 >= 2`` unless ``num_tokens == 0``.
        num_tokens: ``N``.

    Returns:
        ``(S+1,)`` tensor of ``cu_seqlens``' dtype and device.

    Example:
        >>> clamp_cu_seqlens(torch.tensor([2, 5, 3, 9]), 6)
        tensor([0, 5, 5, 6])
    """
    clamped = torch.cummax(cu_seqlens.clamp(0, num_tokens), dim=0).values
    clamped[0] = 0
    if clamped.numel() > 1:
        clamped[-1] = num_tokens
    return clamped
