"""Argument and value checks of the loss: every bad input ends in an error naming the argument.

Two kinds, at two times:

- :func:`check_tensor`, :func:`check_arguments`, :func:`check_linear`: types, shapes, dtypes and
  devices, read from tensor metadata on the host (free, before anything runs). The non-tensor
  options are checked once, when their :class:`packed_ce.options.LossOptions` is built.
- label range and ``cu_seqlens`` contents, which live on the device: :func:`check_values` reads
  them now (CPU tensors, and the torch backend, whose reference must never see a bad label);
  :func:`queue_value_checks` checks them on CUDA without waiting for the device, and
  :func:`check_pending` raises what it found at the start of the next loss call at the latest.
  Both are skipped while tracing.
  ``seq_targets`` / ``seq_weights`` contents are read by :func:`check_values` (one host sync
  on CUDA, also on the kernel path: they are not in the device record).

Dimensions: N tokens, V vocabulary, H hidden size, S sequences, B rows and T tokens per row.
"""

from __future__ import annotations

import atexit
import math
import numbers
import os
import threading
import warnings
from dataclasses import dataclass

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


# --- values: label range and cu_seqlens contents ------------------------------------------

# What the value checks find, one int64 each: enough to write the error message without the
# tensors (the device kernel of packed_ce.kernels.checks writes one row of these per program).
RECORD_FIELDS = (
    "bad_labels",  # labels that are not ignore_index and outside [0, V)
    "first_bad_index",  # flat index of the first of them, -1 if none
    "first_bad_value",  # its value
    "cu_first",  # cu_seqlens[0] (0 without cu_seqlens)
    "cu_last",  # cu_seqlens[-1] (N without cu_seqlens)
    "decrease_at",  # the first s with cu_seqlens[s+1] < cu_seqlens[s], -1 if none
    "decrease_before",  # cu_seqlens[s]
    "decrease_after",  # cu_seqlens[s+1]
    "bad_count",  # 1 if a tensor num_items_in_batch is negative or not finite, else 0
    # the per-sequence tensors (row 0 only; filled by PyTorch ops, see queue_value_checks)
    "seq_targets_below_one",  # 1 if an entry of seq_targets is < 1
    "seq_targets_below_own",  # 1 if an entry is below its sequence's own target count
    "seq_weights_bad",  # 1 if an entry of seq_weights is negative or not finite
)


def bad_label_mask(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """True where a label is neither ``ignore_index`` nor in ``[0, vocab_size)``.

    In int64: compared in a narrow dtype, V and ignore_index would wrap (uint8: 300 -> 44,
    -100 -> 156), refusing valid labels and passing invalid ones.
    """
    labels = labels.to(torch.int64)
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))


def bad_count(count: torch.Tensor) -> torch.Tensor:
    """0-d bool on ``count``'s device: a tensor ``num_items_in_batch`` that no normaliser can be
    (negative, NaN or infinite)."""
    count = count.reshape(()).to(torch.float64)
    return ~torch.isfinite(count) | (count < 0)


def value_record(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None,
    count: torch.Tensor | None = None,
) -> list[int]:
    """The :data:`RECORD_FIELDS` of the inputs, computed in PyTorch on the host's schedule
    (several host syncs on CUDA: for error messages and as the device kernel's reference);
    ``count`` is a tensor ``num_items_in_batch`` or None."""
    flat = labels.reshape(-1)
    bad = torch.nonzero(bad_label_mask(flat, vocab_size, ignore_index)).flatten().tolist()
    record = [len(bad), bad[0] if bad else -1, int(flat[bad[0]]) if bad else 0]
    count_field = [int(bad_count(count))] if count is not None else [0]
    if cu_seqlens is None:
        return record + [0, flat.numel(), -1, 0, 0] + count_field + [0, 0, 0]
    cu = cu_seqlens.tolist()
    at = next((s for s in range(len(cu) - 1) if cu[s + 1] < cu[s]), -1)
    boundaries = [cu[0], cu[-1], at, cu[at] if at >= 0 else 0, cu[at + 1] if at >= 0 else 0]
    return record + boundaries + count_field + [0, 0, 0]


def per_sequence_flags(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    shift: bool,
    ignore_index: int,
    seq_targets: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
) -> torch.Tensor:
    """``(3,)`` bool on the labels' device, no host sync: ``seq_targets`` below 1, below the
    sequence's own target count, ``seq_weights`` negative or not finite (False where absent)."""
    flags = torch.zeros(3, dtype=torch.bool, device=labels.device)
    if seq_targets is not None:
        own = own_targets(labels, cu_seqlens, shift=shift, ignore_index=ignore_index)
        flags[0] = (seq_targets < 1).any()
        flags[1] = (seq_targets < own).any()
    if seq_weights is not None:
        flags[2] = ~(seq_weights.isfinite() & (seq_weights >= 0)).all()
    return flags


def value_error(
    rows: list[list[int]],
    *,
    labels_shape: tuple[int, ...],
    vocab_size: int,
    ignore_index: int,
) -> str | None:
    """The message of the first failed value check in ``rows``, or None if every check passed.

    Args:
        rows: records (:data:`RECORD_FIELDS`) of consecutive blocks of the flattened labels, in
            order; the ``cu_seqlens`` fields are read from the first.
        labels_shape: ``(N,)`` or ``(B, T)``, to name the bad label's position.
        vocab_size, ignore_index: what a valid label is.
    """
    bad = sum(row[0] for row in rows)
    if bad:
        _, index, value = next(row for row in rows if row[0])[:3]
        position = []
        for size in reversed(labels_shape):
            index, coordinate = divmod(index, size)
            position.insert(0, str(coordinate))
        return (
            f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"found {bad} bad value{'s' if bad > 1 else ''}, the first "
            f"labels[{', '.join(position)}] = {value}"
        )
    cu_first, cu_last, at, before, after, count_failed, below_one, below_own, bad_weight = rows[0][3:]
    if below_one:
        return "seq_targets must be >= 1 (1 for a sequence without targets)"
    if below_own:
        return (
            "seq_targets must count the targets of each whole conversation, at least the "
            "sequence's own"
        )
    if bad_weight:
        return "seq_weights must be finite and >= 0"
    if count_failed:
        return (
            "num_items_in_batch must be finite and >= 0: pass the number of targets (or the "
            "weight of the sequences with a target) of the optimiser step"
        )
    n = math.prod(labels_shape)
    if cu_first != 0:
        return f"cu_seqlens must start at 0, got {cu_first}"
    if cu_last != n:
        return f"cu_seqlens must end at N={n}, got {cu_last}"
    if at >= 0:
        return (
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{at + 1}] = {after} < "
            f"cu_seqlens[{at}] = {before}"
        )
    return None


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
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    shift: bool = False,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
) -> None:
    """Checks label range, ``cu_seqlens`` contents, a tensor ``num_items_in_batch``'s value
    (finite, ``>= 0``), and ``seq_targets`` / ``seq_weights`` contents now: one host sync on
    CUDA, one bool read.

    ``seq_targets`` must be ``>= 1`` and at least the sequence's own target count (``shift``
    decides what a target is): a piece cannot have more targets than its conversation.
    ``seq_weights`` must be finite and ``>= 0``. Both need ``cu_seqlens`` (checked before).

    Skipped while tracing (torch.compile, CUDA-graph capture), where no sync is possible, and
    with ``validate=False``. Both backends then give the same defined result on bad values: an
    out-of-range label gives a NaN loss, ``cu_seqlens`` is read as :func:`clamp_cu_seqlens`
    makes it, a negative or non-finite ``num_items_in_batch`` gives a NaN loss, and a
    ``seq_targets`` entry below 1 counts as 1.
    """
    if is_tracing() or labels.device.type == "meta":  # meta tensors have no values to check
        return
    flags = [bad_label_mask(labels, vocab_size, ignore_index).any()]
    if cu_seqlens is not None:
        n = labels.numel()
        flags += [
            cu_seqlens[0] != 0,
            cu_seqlens[-1] != n,
            (cu_seqlens[1:] < cu_seqlens[:-1]).any(),
        ]
    count = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
    if count is not None:
        flags.append(bad_count(count))
    per_sequence = len(flags)  # where the seq_targets / seq_weights flags start
    if seq_targets is not None:
        own = own_targets(labels, cu_seqlens, shift=shift, ignore_index=ignore_index)
        flags += [(seq_targets < 1).any(), (seq_targets < own).any()]
    if seq_weights is not None:
        flags += [~(seq_weights.isfinite() & (seq_weights >= 0)).all()]
    # One transfer for all the checks; the detailed message is computed only on failure.
    failed = torch.stack(flags).tolist()
    if not any(failed):
        return
    if any(failed[:per_sequence]):
        record = value_record(labels, vocab_size, ignore_index, cu_seqlens, count)
        raise ValueError(
            value_error(
                [record],
                labels_shape=tuple(labels.shape),
                vocab_size=vocab_size,
                ignore_index=ignore_index,
            )
        )
    failed = failed[per_sequence:]
    _raise_per_sequence(failed, labels, cu_seqlens, shift, ignore_index, seq_targets, seq_weights)


def _raise_per_sequence(failed, labels, cu_seqlens, shift, ignore_index, seq_targets, seq_weights):
    """The message of a failed ``seq_targets`` / ``seq_weights`` flag of :func:`check_values`."""
    if seq_targets is not None:
        if failed[0]:
            bad = (seq_targets < 1).nonzero().flatten()[:5].tolist()
            raise ValueError(
                f"seq_targets must be >= 1 (1 for a sequence without targets): got "
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
        f"seq_weights must be finite and >= 0: got {seq_weights[bad].tolist()} at sequences {bad}"
    )


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
    # slices filled with Python numbers: `clamped[0] = 0` copies a host scalar (a host sync)
    clamped[:1].zero_()
    if clamped.numel() > 1:
        clamped[-1:].fill_(num_tokens)
    return clamped


# --- deferred value checks: queued on the device, read at the next call ---------------------


@dataclass
class PendingCheck:
    """The value checks of one loss call, still on their way to the host.

    Attributes:
        record: ``(P, len(RECORD_FIELDS))`` int64 host tensor (pinned, filled by a copy queued
            on the device), rows as :func:`value_error` reads them.
        done: recorded after that copy; None when ``record`` is complete already.
        labels_shape, vocab_size, ignore_index: what :func:`value_error` needs besides.
    """

    record: torch.Tensor
    done: torch.cuda.Event | None
    labels_shape: tuple[int, ...]
    vocab_size: int
    ignore_index: int


# Every thread's loss calls queue here: a check_pending() of the training loop's thread then
# also reports calls made in other threads (nn.DataParallel replicas computing the loss).
_pending: list[PendingCheck] = []
_pending_lock = threading.Lock()


def _forget_pending_in_child() -> None:
    """A forked child (a DataLoader worker) cannot wait on its parent's device work, and may
    have been forked while another thread held the lock."""
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_forget_pending_in_child)


def defers_checks(device: torch.device) -> bool:
    """Whether the value checks of tensors on ``device`` are deferred: on CUDA, where reading
    their result now would wait for the device, not on the CPU, where it costs nothing."""
    return device.type == "cuda"


def queue_value_checks(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None,
    coef: torch.Tensor,
    num_items_in_batch: int | torch.Tensor | None = None,
    *,
    shift: bool = False,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
) -> None:
    """Checks label range, ``cu_seqlens`` contents, a tensor ``num_items_in_batch``'s value and
    ``seq_targets`` / ``seq_weights`` contents without waiting for the device.

    On CUDA (:func:`defers_checks`) one kernel computes the checks' record, a non-blocking copy
    brings it to pinned host memory, and :func:`check_pending` reads it, at the start of the next
    loss call at the latest. Meanwhile, if a check fails, the kernel sets ``coef`` to NaN (in
    place) around the bad value, so the loss and the gradients of this call are NaN: no finite
    result comes from bad input. Elsewhere the checks run now (:func:`check_values`). Skipped
    while tracing.

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer labels. cu_seqlens: ``(S+1,)`` or None.
        vocab_size, ignore_index: what a valid label is.
        coef: ``(N,)`` fp32, the call's loss coefficients (:class:`packed_ce.targets.Targets`).
        num_items_in_batch: the call's normaliser; checked when it is a tensor (a Python number
            was checked with the arguments).
        shift, seq_targets, seq_weights: as :func:`check_values` reads them. Their checks are a
            few PyTorch ops (:func:`per_sequence_flags`) written into the record's first row;
            a failed one makes every coefficient NaN.
    """
    per_sequence = dict(shift=shift, seq_targets=seq_targets, seq_weights=seq_weights)
    if is_tracing() or labels.device.type == "meta":
        return
    if not defers_checks(labels.device):
        check_values(
            labels, vocab_size, ignore_index, cu_seqlens, num_items_in_batch, **per_sequence
        )
        return
    from .kernels.checks import launch_value_checks

    count = num_items_in_batch if isinstance(num_items_in_batch, torch.Tensor) else None
    record = launch_value_checks(
        labels, cu_seqlens, coef, count, vocab_size=vocab_size, ignore_index=ignore_index
    )
    if seq_targets is not None or seq_weights is not None:
        flags = per_sequence_flags(
            labels, cu_seqlens, ignore_index=ignore_index, **per_sequence
        )
        record[0, 9:12] = flags
        coef.masked_fill_(flags.any(), float("nan"))
    done = None
    if record.is_cuda:
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
        host.copy_(record, non_blocking=True)  # queued on the stream of the labels' device
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(record.device))
        record = host
    check = PendingCheck(record, done, tuple(labels.shape), vocab_size, ignore_index)
    with _pending_lock:
        _pending.append(check)


def check_pending() -> None:
    """Raises the ``ValueError`` of any bad label or ``cu_seqlens`` given to an earlier loss call.

    On CUDA, ``validate=True`` checks label range and ``cu_seqlens`` contents on the device,
    without waiting for it, so a bad value cannot raise inside the call that received it: that
    call returns a NaN loss (and NaN gradients), and the error is raised at the start of the next
    loss call (:func:`packed_ce.cross_entropy`, :func:`packed_ce.fused_linear_cross_entropy` or
    their modules) or here, whichever comes first. Call it between ``loss.backward()`` and
    ``optimizer.step()``, and no step ever trains on bad input::

        loss = packed_ce.cross_entropy(logits, labels, cu_seqlens=cu_seqlens, is_packed=True)
        loss.backward()
        packed_ce.check_pending()  # raises here if labels or cu_seqlens were bad
        optimizer.step()

    It waits for the device only up to the checks of the last loss call, which are queued before
    its loss kernel: normally long finished. On the CPU values are checked inside the call, and
    nothing is ever pending. Does nothing while tracing (torch.compile, CUDA-graph capture),
    where no checks are queued. Checks still pending when the interpreter exits are reported as
    a warning.

    Raises:
        ValueError: with the message the call itself would have raised, for the first failed
            check (in call order); every pending check is consumed.
    """
    # Compiling first: torch.compile then never reads (nor guards on) the queue. An empty queue
    # next: the capture test would initialise CUDA in a process that never used it.
    if torch.compiler.is_compiling() or not _pending or is_tracing():
        return
    with _pending_lock:
        checks = _pending[:]
        _pending.clear()
    failures = []
    for check in checks:
        if check.done is not None:
            check.done.synchronize()
        message = value_error(
            check.record.tolist(),
            labels_shape=check.labels_shape,
            vocab_size=check.vocab_size,
            ignore_index=check.ignore_index,
        )
        if message is not None:
            failures.append(message)
    if failures:
        later = len(failures) - 1
        others = f"; {later} later call{'s' if later > 1 else ''} failed too" if later else ""
        raise ValueError(
            f"{failures[0]} (in an earlier loss call, whose loss is NaN{others}; its check ran "
            "on the device: see packed_ce.check_pending)"
        )


@atexit.register
def _report_pending_at_exit() -> None:
    """A bad value in the last loss call before exit still reaches the user, as a warning."""
    try:
        check_pending()
    except ValueError as error:
        warnings.warn(f"at interpreter exit: {error}", RuntimeWarning, stacklevel=1)
