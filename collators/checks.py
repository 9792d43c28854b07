"""Argument checks shared by the tokenizer, packing and collator entry points.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
with the argument's name in the message, so a bad input never becomes a silently truncated float, a
dropped token or a bare numpy error.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch


def positive_int(value, name: str, *, minimum: int = 1) -> int:
    """``value`` as an ``int``: an integer (not a bool or a float), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an int, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise ValueError(f"`{name}` must be an int >= {minimum}, got {value}.")
    return int(value)


def token_array(value, name: str) -> np.ndarray:
    """A sequence of token ids or labels as a 1-D int64 array.

    Accepts a list, tuple, numpy array or tensor of integers. A 2-D array or tensor with one row
    (what ``tokenizer(..., return_tensors="pt")`` returns, shape ``(1, T)``) is that row; any other
    2-D or deeper shape is refused, as are floats and bools (``[1.7]`` would otherwise become token
    1) and ``None`` entries.
    """
    if torch.is_tensor(value):
        value = value.detach().cpu().numpy()
    try:
        array = np.asarray(value)
    except ValueError as error:  # ragged nesting
        raise ValueError(f"`{name}` must be a flat sequence of ints: {error}") from None
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise ValueError(
            f"`{name}` must be 1-D (or one row of shape (1, T)), got shape {tuple(array.shape)}."
        )
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.dtype.kind not in "iu":
        raise TypeError(
            f"`{name}` must hold ints, got dtype {array.dtype}: convert it, e.g. to a list of ints."
        )
    return array.astype(np.int64, copy=False)


def check_tokens(input_ids: np.ndarray, labels: np.ndarray, ignore_index: int, name: str) -> None:
    """Token ids are >= 0 and every label is ``ignore_index`` or >= 0 (a class index)."""
    if input_ids.size and input_ids.min() < 0:
        raise ValueError(f"`{name}` has a negative token id {int(input_ids.min())} in `input_ids`.")
    bad = (labels < 0) & (labels != ignore_index)
    if bad.any():
        raise ValueError(
            f"`{name}` has the label {int(labels[bad][0])} in `labels`: labels are token ids (>= "
            f"0) or ignore_index={ignore_index}."
        )


def targets_per_sequence(
    labels: np.ndarray, lengths: np.ndarray, ignore_index: int, *, counted: np.ndarray | None = None
) -> np.ndarray:
    """Targets per sequence under the causal shift: labels not ``ignore_index`` after the first.

    Args:
        labels: ``(N,)`` int64, the sequences back to back.
        lengths: ``(S,)`` int64 >= 0, summing to ``N``.
        counted: ``(S,)`` int64, optional: count only the first ``counted[s] <= lengths[s]`` tokens
            of sequence ``s`` (what truncation keeps).

    Returns:
        ``(S,)`` int64: for sequence ``s``, the count of ``labels[t] != ignore_index`` for ``t`` in
        ``(start_s, start_s + counted_s)``: the first label of a sequence is no target (no token
        before it predicts it).
    """
    starts = np.cumsum(lengths) - lengths
    is_target = labels != ignore_index
    is_target[starts[lengths > 0]] = False
    # Two binary searches per sequence in the targets' positions: a running count over every token
    # (cumsum of a bool array) costs about 4 times as much, the bulk of packing's pass over a large
    # data set.
    positions = np.flatnonzero(is_target)
    ends = starts + (lengths if counted is None else counted)
    return np.searchsorted(positions, ends) - np.searchsorted(positions, starts)
