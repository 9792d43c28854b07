"""The value record: what the value checks of one loss call found, as named int64 fields.

Enough to write the error message without the tensors, so it can be computed on the device and
read later. :func:`encode` (PyTorch; the reference of :mod:`packed_ce.kernels.checks`) writes it,
:func:`message` reads any number of rows.

Dimensions: N tokens, S sequences.
"""

from __future__ import annotations

import enum
import math
import struct

import torch


class Field(enum.IntEnum):
    """The columns of a record row; -1 stands for "none" in the ``*_AT`` fields."""

    BAD_LABELS = 0  # labels that are not ignore_index and outside [0, V)
    BAD_LABEL_AT = 1  # flat index of the first of them
    BAD_LABEL_VALUE = 2  # its value
    CU_FIRST = 3  # cu_seqlens[0] (0 without cu_seqlens)
    CU_LAST = 4  # cu_seqlens[-1] (N without cu_seqlens)
    DECREASE_AT = 5  # the first s with cu_seqlens[s+1] < cu_seqlens[s]
    DECREASE_BEFORE = 6  # cu_seqlens[s]
    DECREASE_AFTER = 7  # cu_seqlens[s+1]
    BAD_COUNT = 8  # 1 if a tensor num_items_in_batch is negative or not finite
    # the per-sequence tensors: always PyTorch ops, in the first row only
    TARGETS_BELOW_ONE = 9  # entries of seq_targets below 1
    TARGETS_BELOW_ONE_AT = 10
    TARGETS_BELOW_ONE_VALUE = 11
    TARGETS_BELOW_OWN = 12  # entries below their sequence's own target count
    TARGETS_BELOW_OWN_AT = 13
    TARGETS_BELOW_OWN_VALUE = 14
    TARGETS_OWN = 15  # that sequence's own count
    BAD_WEIGHTS = 16  # entries of seq_weights negative or not finite
    BAD_WEIGHT_AT = 17
    BAD_WEIGHT_BITS = 18  # the first one, float64 bits
    WEIGHT_SUM_OVERFLOWS = 19  # 1 if the valid entries of seq_weights add up to inf in float64


WIDTH = len(Field)
PER_SEQUENCE = Field.TARGETS_BELOW_ONE  # the first per-sequence field
# the per-sequence fields that count failures: nonzero means the call is bad
PER_SEQUENCE_COUNTS = (
    Field.TARGETS_BELOW_ONE,
    Field.TARGETS_BELOW_OWN,
    Field.BAD_WEIGHTS,
    Field.WEIGHT_SUM_OVERFLOWS,
)


def bad_label_mask(labels: torch.Tensor, vocab_size: int, ignore_index: int) -> torch.Tensor:
    """True where a label is neither ``ignore_index`` nor in ``[0, vocab_size)``.

    In int64: compared in a narrow dtype, V and ignore_index would wrap (uint8: 300 -> 44,
    -100 -> 156), refusing valid labels and passing invalid ones.
    """
    labels = labels.to(torch.int64)
    return (labels != ignore_index) & ((labels < 0) | (labels >= vocab_size))


def own_targets(
    labels: torch.Tensor, cu_seqlens: torch.Tensor, *, shift: bool, ignore_index: int
) -> torch.Tensor:
    """``n_s``, the targets of each sequence ``[c_s, c_{s+1})``: ``(S,)`` int64.

    From a prefix count, independently of :mod:`packed_ce.targets`; indices clamped to ``[0, N]``
    for a malformed ``cu_seqlens`` (reported in the same record).
    """
    has_target = (labels.reshape(-1) != ignore_index).to(torch.int64)
    prefix = torch.nn.functional.pad(torch.cumsum(has_target, 0), (1, 0))  # (N+1,)
    bounds = cu_seqlens.to(torch.int64).clamp(0, has_target.numel())
    end = bounds[1:].clamp(min=bounds[:-1])
    start = torch.minimum(bounds[:-1] + int(shift), end)
    return prefix[end] - prefix[start]


def _first(bad: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
    """``[count, first index or -1, value there or 0]`` of a 1-D mask, as 0-d int64 tensors
    (no host sync; any length, 0 included).
    """
    n = bad.numel()
    index = torch.arange(n + 1, device=bad.device)
    stop = torch.ones(1, dtype=torch.bool, device=bad.device)  # index n: none found
    at = torch.where(torch.cat([bad, stop]), index, n).min()
    value = _read(values, at)
    found = at < n
    return [bad.sum(), torch.where(found, at, -1), torch.where(found, value, 0)]


def _read(values: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """``values[at]`` as 0-d int64 for a 0-d device index, 0 where ``at`` is -1 or
    ``len(values)``. index_select, not ``values[at]``: indexing by a 0-d tensor reads it on the
    host (a sync on CUDA).
    """
    padded = torch.nn.functional.pad(values.to(torch.int64), (0, 1))
    at = torch.where(at < 0, values.numel(), at)
    return padded.index_select(0, at.reshape(1)).reshape(())


def encode_per_sequence(
    labels: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    *,
    shift: bool,
    ignore_index: int,
    seq_targets: torch.Tensor | None,
    seq_weights: torch.Tensor | None,
) -> torch.Tensor:
    """The per-sequence fields (from :data:`PER_SEQUENCE` on): ``(WIDTH - PER_SEQUENCE,)``
    int64 on the labels' device, no host sync; zeros (and -1 positions) where absent.
    """
    device = labels.device
    zero = torch.zeros((), dtype=torch.int64, device=device)
    none_found = [zero, zero - 1, zero]  # _first of an empty mask, without its kernels
    if seq_targets is None:
        fields = none_found * 2 + [zero]
    else:
        own = own_targets(labels, cu_seqlens, shift=shift, ignore_index=ignore_index)
        fields = _first(seq_targets < 1, seq_targets)
        fields += _first(seq_targets < own, seq_targets)
        fields.append(_read(own, fields[-2]))
    if seq_weights is None:
        fields += none_found + [zero]
    else:
        weights = seq_weights.detach().to(torch.float64)
        bad_weight = ~(weights.isfinite() & (weights >= 0))
        fields += _first(bad_weight, weights.view(torch.int64))
        # the mass of finite weights can still overflow: 1e308 + 1e308 is inf, the mean NaN
        fields.append(torch.where(bad_weight, 0.0, weights).sum().isinf())
    return torch.stack(fields).to(device=device, dtype=torch.int64)


def encode(
    labels: torch.Tensor,
    vocab_size: int,
    ignore_index: int,
    cu_seqlens: torch.Tensor | None,
    count: torch.Tensor | None = None,
    *,
    shift: bool = False,
    seq_targets: torch.Tensor | None = None,
    seq_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The record of one call's values: ``(WIDTH,)`` int64 on the labels' device, no host sync.

    Args:
        labels: ``(N,)`` or ``(B, T)`` integer. cu_seqlens: ``(S+1,)`` or None.
        vocab_size, ignore_index: what a valid label is.
        count: a tensor ``num_items_in_batch`` (one element), or None.
        shift, seq_targets, seq_weights: for the per-sequence fields (both need ``cu_seqlens``).
    """
    flat = labels.reshape(-1)
    n = flat.numel()
    device = flat.device
    fields = _first(bad_label_mask(flat, vocab_size, ignore_index), flat)
    if cu_seqlens is None:  # the fields of well-formed boundaries: [0, N]
        bounds = torch.zeros(2, dtype=torch.int64, device=device)
        bounds[1:].fill_(n)  # a fill, not torch.tensor([0, n]): no copy from the host
    else:
        bounds = cu_seqlens.to(torch.int64)
    _, at, before = _first(bounds[1:] < bounds[:-1], bounds[:-1])
    after = torch.where(at >= 0, _read(bounds, at + 1), 0)
    fields += [bounds[0], bounds[-1], at, before, after]
    bad_count = torch.zeros((), dtype=torch.bool, device=device)
    if count is not None:
        value = count.reshape(()).to(device=device, dtype=torch.float64)
        bad_count = ~torch.isfinite(value) | (value < 0)
    fields.append(bad_count)
    head = torch.stack([f.to(torch.int64) for f in fields])
    tail = encode_per_sequence(
        flat,
        cu_seqlens,
        shift=shift,
        ignore_index=ignore_index,
        seq_targets=seq_targets,
        seq_weights=seq_weights,
    )
    return torch.cat([head, tail])


def message(
    rows: list[list[int]],
    *,
    labels_shape: tuple[int, ...],
    vocab_size: int,
    ignore_index: int,
) -> str | None:
    """The message of the first failed check in ``rows``, or None if every check passed.

    Args:
        rows: records of consecutive blocks of the flattened labels, in order; the other fields
            are read from the first.
        labels_shape: ``(N,)`` or ``(B, T)``, to name the bad label's position.
        vocab_size, ignore_index: what a valid label is.
    """
    bad = sum(row[Field.BAD_LABELS] for row in rows)
    if bad:
        first = next(row for row in rows if row[Field.BAD_LABELS])
        index, position = first[Field.BAD_LABEL_AT], []
        for size in reversed(labels_shape):
            index, coordinate = divmod(index, size)
            position.insert(0, str(coordinate))
        return (
            f"labels must be in [0, {vocab_size}) or equal ignore_index={ignore_index}; "
            f"found {bad} bad value{'s' if bad > 1 else ''}, the first "
            f"labels[{', '.join(position)}] = {first[Field.BAD_LABEL_VALUE]}"
        )
    row = rows[0]
    n = math.prod(labels_shape)
    if row[Field.CU_FIRST] != 0:
        return f"cu_seqlens must start at 0, got {row[Field.CU_FIRST]}"
    if row[Field.CU_LAST] != n:
        return f"cu_seqlens must end at N={n}, got {row[Field.CU_LAST]}"
    at = row[Field.DECREASE_AT]
    if at >= 0:
        return (
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{at + 1}] = "
            f"{row[Field.DECREASE_AFTER]} < cu_seqlens[{at}] = {row[Field.DECREASE_BEFORE]}"
        )
    if row[Field.BAD_COUNT]:
        return (
            "num_items_in_batch must be finite and >= 0: pass the number of targets (or the "
            "weight of the sequences with a target) of the optimiser step"
        )
    if row[Field.TARGETS_BELOW_ONE]:
        return (
            "seq_targets must be >= 1 (1 for a sequence without targets): got "
            f"[{row[Field.TARGETS_BELOW_ONE_VALUE]}] at sequences "
            f"[{row[Field.TARGETS_BELOW_ONE_AT]}]{_more(row[Field.TARGETS_BELOW_ONE])}"
        )
    if row[Field.TARGETS_BELOW_OWN]:
        return (
            "seq_targets must count the targets of each whole conversation, at least the "
            f"sequence's own: sequences [{row[Field.TARGETS_BELOW_OWN_AT]}] have "
            f"[{row[Field.TARGETS_OWN]}] targets but seq_targets "
            f"[{row[Field.TARGETS_BELOW_OWN_VALUE]}]{_more(row[Field.TARGETS_BELOW_OWN])}"
        )
    if row[Field.BAD_WEIGHTS]:
        (weight,) = struct.unpack("<d", struct.pack("<q", row[Field.BAD_WEIGHT_BITS]))
        return (
            f"seq_weights must be finite and >= 0: got [{weight}] at sequences "
            f"[{row[Field.BAD_WEIGHT_AT]}]{_more(row[Field.BAD_WEIGHTS])}"
        )
    if row[Field.WEIGHT_SUM_OVERFLOWS]:
        return (
            "seq_weights add up to more than float64 holds, so their mass (the mean's "
            "denominator) is inf: scale them down (the weighted mean does not depend on their "
            "scale)"
        )
    return None


def _more(count: int) -> str:
    return f" (the first of {count})" if count > 1 else ""
