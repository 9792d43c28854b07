"""From labels and sequence boundaries to per-token targets and loss coefficients.

Every backend reduces the loss the same way: token ``t`` contributes ``coef[t] * l_t``, where

    coef[t] = w_t / D            (reduction "mean")
    coef[t] = w_t                (reduction "sum" and "none")
    w_t     = 1 / n_s(t)         (is_packed=True, n_s = number of targets in t's sequence)
    w_t     = 1                  (is_packed=False)

and ``w_t = 0`` for tokens without a target. So the kernels see one flat ``(N,)`` float32
coefficient per row and never have to know about sequences. Everything here is vectorised
tensor code on the logits' device: no ``.item()``, ``.tolist()`` or data-dependent shapes, so
the preparation is safe under CUDA graphs and traceable by ``torch.compile``.

Dimensions: N tokens, V vocabulary, S sequences, B rows and T tokens per row (N = B*T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

REDUCTIONS = ("mean", "sum", "none")


@dataclass
class Targets:
    """What the loss needs to know about every token, independent of the logits.

    Attributes:
        targets: ``(N,)`` int64, the class each row of the logits is scored against;
            ``ignore_index`` where a row has no target.
        coef: ``(N,)`` float32, the row's weight in the reduced loss (0 for rows without a
            target), see the module docstring.
    """

    targets: torch.Tensor
    coef: torch.Tensor


def is_tracing() -> bool:
    """True under torch.compile or CUDA-graph capture, where a host sync is impossible."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def check_arguments(
    logits_shape: torch.Size,
    logits_dtype: torch.dtype,
    logits_device: torch.device,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    is_packed: bool,
    reduction: str,
    label_smoothing: float,
    z_loss_scale: float,
    softcap: float | None,
    num_items_in_batch,
    allowed_dtypes: tuple[torch.dtype, ...],
    name: str = "logits",
) -> None:
    """Checks everything that can be checked from shapes, dtypes and Python values (free)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor, got {type(labels).__name__}")
    if logits_dtype not in allowed_dtypes:
        raise TypeError(f"{name} must have dtype in {allowed_dtypes}, got {logits_dtype}")
    if labels.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
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
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= float(label_smoothing) <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if float(z_loss_scale) < 0.0:
        raise ValueError(f"z_loss_scale must be >= 0, got {z_loss_scale}")
    if softcap is not None and not float(softcap) > 0.0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give cu_seqlens or position_ids, not both")
    if is_packed and cu_seqlens is None and position_ids is None:
        raise ValueError(
            "is_packed=True needs the sequence boundaries: pass cu_seqlens or position_ids"
        )
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError(f"cu_seqlens must be 1-D (S+1,), got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device != logits_device:
            raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but {name} on {logits_device}")
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor):
            raise TypeError(
                f"position_ids must be a torch.Tensor, got {type(position_ids).__name__}"
            )
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
    if num_items_in_batch is not None:
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


def check_values(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None,
) -> None:
    """Checks label range and ``cu_seqlens`` contents: one host sync on CUDA, one bool read.

    Skipped while tracing (torch.compile, CUDA-graph capture), where no sync is possible; the
    kernels stay memory-safe on bad values there (an out-of-range label gives a NaN loss).
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
    cu = cu_seqlens.tolist()
    if failed[1]:
        raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
    if failed[2]:
        raise ValueError(f"cu_seqlens must end at N={labels.numel()}, got {cu[-1]}")
    raise ValueError(f"cu_seqlens must be non-decreasing, got {cu[:16]}{'...' if len(cu) > 16 else ''}")


def sequence_ids(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, int]:
    """Index of the sequence of every token, and an upper bound on the number of sequences.

    Args:
        labels: ``(N,)`` or ``(B, T)``; rows of a 2-D tensor are never one sequence.
        cu_seqlens: ``(S+1,)`` int32/int64 or None.
        position_ids: ``N`` entries (any shape) or None. A sequence starts at token 0 of every
            row and wherever ``position_ids[t] != position_ids[t-1] + 1``.

    Returns:
        ``seq`` ``(N,)`` int64, non-decreasing, and the number of sequence slots ``S`` such
        that ``0 <= seq < S``. Without boundaries each row of ``labels`` is one sequence.
    """
    n = labels.numel()
    device = labels.device
    if cu_seqlens is not None:
        tokens = torch.arange(n, device=device, dtype=torch.int64)
        # right=True: an empty sequence [c, c) owns no token, the next one starts at c.
        seq = torch.searchsorted(cu_seqlens.to(torch.int64), tokens, right=True) - 1
        num_slots = cu_seqlens.numel() - 1
        # Out-of-range ids only happen for malformed cu_seqlens; clamp keeps indexing safe
        # when check_values was skipped (tracing).
        return seq.clamp_(0, max(num_slots - 1, 0)), max(num_slots, 1)
    rows = labels.shape[0] if labels.dim() == 2 else 1
    row_len = n // rows if rows else 0
    if position_ids is not None:
        pos = position_ids.reshape(rows, row_len).to(torch.int64)
        starts = torch.ones_like(pos, dtype=torch.bool)
        starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
        return torch.cumsum(starts.reshape(-1), 0) - 1, max(n, 1)
    seq = torch.arange(rows, device=device).repeat_interleave(row_len)
    return seq, max(rows, 1)


def _targets_and_weights(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    is_packed: bool,
    shift: bool,
    ignore_index: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(N,)`` int64 targets, ``(N,)`` weights ``w_t`` and the default ``D``, in PyTorch."""
    flat = labels.reshape(-1).to(torch.int64)
    need_seq = is_packed or (shift and (cu_seqlens is not None or position_ids is not None))
    seq, num_slots = (None, 0)
    if need_seq or (shift and labels.dim() == 2):
        seq, num_slots = sequence_ids(labels, cu_seqlens, position_ids)

    if shift:
        n = flat.numel()
        ignore = torch.full((1,), ignore_index, dtype=torch.int64, device=flat.device)
        nxt = torch.cat([flat[1:], ignore])[:n]  # [:n]: N = 0 stays empty
        if seq is None:
            targets = nxt
        else:
            last = torch.zeros(1, dtype=torch.bool, device=flat.device)
            same_seq = torch.cat([seq[1:] == seq[:-1], last])[:n]
            targets = torch.where(same_seq, nxt, ignore)
    else:
        targets = flat
    valid = (targets != ignore_index).to(dtype)

    if is_packed:
        n_s = torch.zeros(num_slots, dtype=dtype, device=flat.device)
        n_s.index_add_(0, seq, valid)
        # valid tokens have n_s >= 1, the others get 0 / max(0, 1) = 0
        return targets, valid / n_s.clamp(min=1.0)[seq], (n_s > 0).sum()
    return targets, valid, valid.sum()


def prepare_targets(
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    is_packed: bool = False,
    shift: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch=None,
    dtype: torch.dtype = torch.float32,
    use_kernel: bool = False,
) -> Targets:
    """Targets and per-token coefficients (see the module docstring) for ``labels``.

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer labels.
        cu_seqlens / position_ids: sequence boundaries (at most one), or None.
        is_packed: weight each target by ``1 / n_s`` of its sequence.
        shift: the target of token ``t`` is ``labels[t+1]`` when ``t+1`` is in the same
            sequence, else none.
        num_items_in_batch: replaces the normaliser ``D`` of reduction "mean".
        dtype: of the coefficients; float32 for the kernels, float64 for a float64 reference.
        use_kernel: with ``cu_seqlens`` and float32, compute targets and weights with one Triton
            launch (:mod:`packed_ce.kernels.targets`) instead of ~25 PyTorch kernels; for the
            Triton backends in eager mode. The reference keeps the PyTorch path, so each checks
            the other.

    Returns:
        :class:`Targets` with ``(N,)`` int64 targets and ``(N,)`` coefficients of ``dtype``.
    """
    # Under torch.compile the PyTorch path is traced instead: inductor fuses it by itself.
    if (
        use_kernel
        and cu_seqlens is not None
        and dtype == torch.float32
        and not torch.compiler.is_compiling()
    ):
        from .kernels.targets import sequence_targets

        targets, weight, num_items = sequence_targets(
            labels.reshape(-1).to(torch.int64),
            cu_seqlens,
            is_packed=is_packed,
            shift=shift,
            ignore_index=ignore_index,
        )
    else:
        targets, weight, num_items = _targets_and_weights(
            labels, cu_seqlens, position_ids, is_packed, shift, ignore_index, dtype
        )

    if reduction == "mean":
        if num_items_in_batch is not None:
            num_items = num_items_in_batch
            if isinstance(num_items, torch.Tensor):
                num_items = num_items.reshape(()).to(device=labels.device)
            else:
                # a fill kernel: torch.tensor(n, device=cuda) would be a blocking host copy
                num_items = torch.full((), float(num_items), device=labels.device)
        num_items = num_items.to(dtype)
        # D == 0 means nothing to learn from: loss 0 and zero gradients, never 0/0.
        scale = torch.where(num_items > 0, 1.0 / num_items.clamp(min=1e-30), 0.0)
        return Targets(targets=targets, coef=weight * scale)
    return Targets(targets=targets, coef=weight)
