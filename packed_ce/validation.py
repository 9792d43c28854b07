"""Argument and value checks of the loss: every bad input ends in an error naming the argument.

Two kinds, at two times:

- :func:`check_tensor`, :func:`check_arguments`, :func:`check_linear`: types, shapes, dtypes and
  devices, read from tensor metadata on the host (free, before anything runs). The non-tensor
  options are checked once, when their :class:`packed_ce.options.LossOptions` is built.
- :func:`check_values`: label range, ``cu_seqlens``, ``seq_targets`` and ``seq_weights``
  contents, which live on the device (one host sync; run after the kernel is queued, skipped
  while tracing).

Dimensions: N tokens, V vocabulary, H hidden size, S sequences, B rows and T tokens per row.
"""

from __future__ import annotations

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
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"labels must be an integer tensor, got {labels.dtype}")
    if len(logits_shape) not in (2, 3):
        raise ValueError(f"{name} must be (N, V) or (B, T, V), got shape {tuple(logits_shape)}")
    if tuple(labels.shape) != tuple(logits_shape[:-1]):
        raise ValueError(
            f"labels must have shape {tuple(logits_shape[:-1])} to match {name} "
            f"{tuple(logits_shape)}, got {tuple(labels.shape)}"
        )
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
    check_num_items(boundaries.num_items_in_batch)
    check_per_sequence(boundaries, is_packed=is_packed, device=logits_device, name=name)


def check_per_sequence(
    boundaries: Boundaries, *, is_packed: bool, device: torch.device, name: str = "logits"
) -> None:
    """``seq_targets`` ``(S,)`` integer and ``seq_weights`` ``(S,)`` float: types, shapes,
    devices, and the boundaries they are aligned with (``cu_seqlens``, never ``position_ids``,
    whose number of sequences only the data tell)."""
    cu_seqlens = boundaries.cu_seqlens
    seq_targets, seq_weights = boundaries.seq_targets, boundaries.seq_weights
    for arg, tensor in (("seq_targets", seq_targets), ("seq_weights", seq_weights)):
        if tensor is None:
            continue
        check_tensor(arg, tensor)
        if cu_seqlens is None:
            raise ValueError(
                f"{arg} needs cu_seqlens: its entries are aligned with the sequences of "
                "cu_seqlens (PackedCollator and collators.shard_batch return both)"
            )
        sequences = cu_seqlens.numel() - 1
        if tuple(tensor.shape) != (sequences,):
            raise ValueError(
                f"{arg} must have shape (S,) = ({sequences},), one entry per sequence of "
                f"cu_seqlens, got {tuple(tensor.shape)}"
            )
        if tensor.device != device:
            raise ValueError(f"{arg} is on {tensor.device} but {name} on {device}")
    if seq_targets is not None:
        if seq_targets.dtype.is_floating_point or seq_targets.dtype.is_complex or (
            seq_targets.dtype == torch.bool
        ):
            raise TypeError(f"seq_targets must be an integer tensor, got {seq_targets.dtype}")
        if not is_packed:
            raise ValueError(
                "seq_targets weighs each target by its conversation (is_packed=True); with "
                "is_packed=False every target weighs 1 wherever its conversation was cut: "
                "pass is_packed=True or drop seq_targets"
            )
    if seq_weights is not None:
        if not seq_weights.dtype.is_floating_point:
            raise TypeError(f"seq_weights must be a float tensor, got {seq_weights.dtype}")
        if seq_weights.requires_grad:
            raise ValueError(
                "seq_weights must not require a gradient: the loss treats weights as data "
                "(pass seq_weights.detach())"
            )


def check_num_items(num_items_in_batch) -> None:
    """``num_items_in_batch`` is None, an int ``>= 0`` or a one-element tensor."""
    if num_items_in_batch is None:
        return
    if isinstance(num_items_in_batch, torch.Tensor):
        if num_items_in_batch.numel() != 1:
            raise ValueError(
                "num_items_in_batch must be an int or a 0-d tensor, "
                f"got shape {tuple(num_items_in_batch.shape)}"
            )
    elif isinstance(num_items_in_batch, bool) or not isinstance(num_items_in_batch, int):
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


def own_targets(
    labels: torch.Tensor, cu_seqlens: torch.Tensor, *, shift: bool, ignore_index: int
) -> torch.Tensor:
    """``n_s``, the targets of each sequence ``[c_s, c_{s+1})``: ``(S,)`` int64.

    From a prefix count, independently of :mod:`packed_ce.targets`: under ``shift`` the targets
    of ``s`` are ``labels[c_s + 1 : c_{s+1}]``, else ``labels[c_s : c_{s+1}]``. Indices are
    clamped to ``[0, N]``, so a malformed ``cu_seqlens`` (reported by :func:`check_values` in
    the same transfer) reads nothing out of range.
    """
    has_target = (labels.reshape(-1) != ignore_index).to(torch.int64)
    prefix = torch.nn.functional.pad(torch.cumsum(has_target, 0), (1, 0))  # (N+1,)
    bounds = cu_seqlens.to(torch.int64).clamp(0, has_target.numel())
    end = bounds[1:].clamp(min=bounds[:-1])
    start = torch.minimum(bounds[:-1] + int(shift), end)
    return prefix[end] - prefix[start]


def check_values(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None,
    *,
    shift: bool = False,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
) -> None:
    """Checks label range, ``cu_seqlens``, ``seq_targets`` and ``seq_weights`` contents: one
    host sync on CUDA, one bool read.

    ``seq_targets`` must be ``>= 1`` and at least the sequence's own target count (``shift``
    decides what a target is): a piece cannot have more targets than its conversation.
    ``seq_weights`` must be finite and ``>= 0``. Both need ``cu_seqlens`` (checked before).

    Skipped while tracing (torch.compile, CUDA-graph capture), where no sync is possible; the
    kernels stay memory-safe on bad values there (an out-of-range label gives a NaN loss; a
    ``seq_targets`` entry below 1 counts as 1 on every backend).
    """
    if is_tracing():
        return
    bad_label = ((labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))).any()
    flags = [bad_label]
    if cu_seqlens is not None:
        n = labels.numel()
        flags += [
            cu_seqlens[0] != 0,
            cu_seqlens[-1] != n,
            (cu_seqlens[1:] < cu_seqlens[:-1]).any(),
        ]
    per_sequence = len(flags)  # where the seq_targets / seq_weights flags start
    if seq_targets is not None:
        own = own_targets(labels, cu_seqlens, shift=shift, ignore_index=ignore_index)
        flags += [(seq_targets < 1).any(), (seq_targets < own).any()]
    if seq_weights is not None:
        flags += [~(seq_weights.isfinite() & (seq_weights >= 0)).all()]
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
    if any(failed[1:per_sequence]):
        cu = cu_seqlens.tolist()
        if failed[1]:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        if failed[2]:
            raise ValueError(f"cu_seqlens must end at N={labels.numel()}, got {cu[-1]}")
        more = "..." if len(cu) > 16 else ""
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu[:16]}{more}")
    failed = failed[per_sequence:]
    _raise_per_sequence(failed, labels, cu_seqlens, shift, ignore_index, seq_targets, seq_weights)


def _raise_per_sequence(failed, labels, cu_seqlens, shift, ignore_index, seq_targets, seq_weights):
    """The message of a failed ``seq_targets`` / ``seq_weights`` flag of :func:`check_values`."""
    if seq_targets is not None:
        if failed[0]:
            bad = (seq_targets < 1).nonzero().flatten()[:5].tolist()
            raise ValueError(
                f"seq_targets must be >= 1 (1 for a sequence without targets), got "
                f"{seq_targets[bad].tolist()} at sequences {bad}"
            )
        if failed[1]:
            own = own_targets(labels, cu_seqlens, shift=shift, ignore_index=ignore_index)
            bad = (seq_targets < own).nonzero().flatten()[:5].tolist()
            raise ValueError(
                "seq_targets must count the targets of each whole conversation, at least the "
                f"sequence's own: sequences {bad} have {own[bad].tolist()} targets but "
                f"seq_targets {seq_targets[bad].tolist()}"
            )
    bad = (~(seq_weights.isfinite() & (seq_weights >= 0))).nonzero().flatten()[:5].tolist()
    raise ValueError(
        f"seq_weights must be finite and >= 0, got {seq_weights[bad].tolist()} at sequences {bad}"
    )
