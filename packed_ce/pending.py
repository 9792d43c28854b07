"""The value checks of a loss call: read now, or on their way from the device and raised at
the next call.

:func:`check_values` runs them (the one path, :mod:`packed_ce.records` their record);
:func:`check_pending` is where their timing is explained, once.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from . import records
from .options import Boundaries, LossOptions
from .runtime import is_tracing


@dataclass
class PendingCheck:
    """The value checks of one loss call, still on their way to the host.

    Attributes:
        record: ``(P, records.WIDTH)`` int64 host tensor (pinned, filled by a copy queued on the
            device), rows as :func:`packed_ce.records.message` reads them.
        done: recorded after that copy; None when ``record`` is complete already.
        labels_shape, vocab_size, ignore_index: what the message needs besides.
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
    have been forked while another thread held the lock.
    """
    global _pending_lock
    _pending_lock = threading.Lock()
    _pending.clear()


os.register_at_fork(after_in_child=_forget_pending_in_child)


def defers_checks(device: torch.device) -> bool:
    """Whether the value checks of tensors on ``device`` are deferred: on CUDA, where reading
    their result now would wait for the device, not on the CPU, where it costs nothing.
    """
    return device.type == "cuda"


def queue(record: torch.Tensor, labels_shape: tuple[int, ...], vocab_size: int, ignore_index: int):
    """Queue a device ``record`` for :func:`check_pending`: a non-blocking copy to pinned host
    memory and an event after it (a CPU record is queued as it is).
    """
    done = None
    if record.is_cuda:
        host = torch.empty(record.shape, dtype=record.dtype, pin_memory=True)
        host.copy_(record, non_blocking=True)  # queued on the stream of the labels' device
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(record.device))
        record = host
    check = PendingCheck(record, done, labels_shape, vocab_size, ignore_index)
    with _pending_lock:
        _pending.append(check)


def check_values(
    labels: torch.Tensor,
    vocab_size: int,
    boundaries: Boundaries,
    options: LossOptions,
    coef: torch.Tensor | None = None,
) -> None:
    """Checks a call's values (see the module docstring) with :mod:`packed_ce.records`.

    With ``coef`` (``(N,)`` fp32, Triton backend) on a deferring device, a kernel writes the record
    and makes ``coef`` NaN where a check fails; the record is queued for
    :func:`packed_ce.check_pending`. Otherwise it is read now and raises here. Skipped while
    tracing and on meta tensors.

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer labels, their metadata checked.
        vocab_size: ``V``. boundaries: the call's per-call tensors.
        options: read for ``ignore_index`` and ``shift`` (what a sequence's own targets are).
        coef: see above, or None.
    """
    if is_tracing() or labels.device.type == "meta":
        return
    count = boundaries.num_items_in_batch
    count = count if isinstance(count, torch.Tensor) else None
    per_sequence = dict(
        shift=options.shift,
        ignore_index=options.ignore_index,
        seq_targets=boundaries.seq_targets,
        seq_weights=boundaries.seq_weights,
    )
    where = dict(
        labels_shape=tuple(labels.shape),
        vocab_size=vocab_size,
        ignore_index=options.ignore_index,
    )
    if coef is None or not defers_checks(labels.device):
        record = records.encode(
            labels,
            vocab_size,
            options.ignore_index,
            boundaries.cu_seqlens,
            count,
            shift=options.shift,
            seq_targets=boundaries.seq_targets,
            seq_weights=boundaries.seq_weights,
        )
        error = records.message([record.tolist()], **where)
        if error is not None:
            raise ValueError(error)
        return
    from .kernels.checks import launch_value_checks

    record = launch_value_checks(
        labels,
        boundaries.cu_seqlens,
        coef,
        count,
        vocab_size=vocab_size,
        ignore_index=options.ignore_index,
    )
    if boundaries.seq_targets is not None or boundaries.seq_weights is not None:
        tail = records.encode_per_sequence(labels, boundaries.cu_seqlens, **per_sequence)
        record[0, records.PER_SEQUENCE :] = tail
        found = torch.stack([record[0, field] for field in records.PER_SEQUENCE_COUNTS]).any()
        coef.masked_fill_(found, float("nan"))
    queue(record, **where)


def pending_count() -> int:
    """How many loss calls' value checks are queued and not yet read (what tests assert on)."""
    with _pending_lock:
        return len(_pending)


def discard_pending() -> int:
    """Drops every queued check unread and returns how many there were: a test that leaves a
    bad call behind on purpose must not have its error raised in the next, unrelated test.
    """
    with _pending_lock:
        count = len(_pending)
        _pending.clear()
    return count


def check_pending() -> None:
    """Raises the ``ValueError`` of any bad value given to an earlier loss call.

    Metadata and options are always checked, on the host. Tensor values (labels, boundaries,
    weights, a tensor ``num_items_in_batch``) only with ``validate=True`` and not while tracing:
    inside the call on the CPU or with ``backend="torch"``; on CUDA with the kernel on the device,
    without waiting, so the bad call's loss is NaN and its error comes at the next loss call or
    here. Call it before ``optimizer.step()`` and no step trains on bad input::

        loss = packed_ce.cross_entropy(logits, labels, cu_seqlens=cu_seqlens, is_packed=True)
        loss.backward()
        packed_ce.check_pending()  # raises here if labels or cu_seqlens were bad
        optimizer.step()

    Checks still pending at exit are reported as a warning.

    Raises:
        ValueError: the first failed check's message (in call order); all are consumed.
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
        message = records.message(
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
