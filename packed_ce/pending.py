"""The deferred value checks: records on their way from the device, raised at the next call.

:func:`check_pending` is where the timing of the value checks is explained, once.
"""

from __future__ import annotations

import atexit
import os
import threading
import warnings
from dataclasses import dataclass

import torch

from . import records
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
