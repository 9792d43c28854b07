"""Argument checks shared by the tokenizer, packing and collator entry points.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
with the argument's name in the message, so a bad input never becomes a silently truncated float, a
dropped token or a bare numpy error.
"""

from __future__ import annotations

import math
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


def _shown(value) -> str:
    """``value`` for a message, at most 20 characters (``10**400`` has 401 digits)."""
    text = str(value)
    return text if len(text) <= 20 else f"{text[:17]}..."


def _beyond_float64(value, name: str) -> ValueError:
    """The error of a weight too large for float64 (``10**400``, a long double ``1e400``)."""
    return ValueError(
        f"`{name}` is {_shown(value)}, beyond float64's range: scale every weight down (the "
        "weighted mean does not depend on their scale)."
    )


def conversation_weight(value, name: str) -> float:
    """A per-conversation weight: a finite real number >= 0 (not a bool) within float64's range."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__} {value!r}.")
    try:
        weight = float(value)
    except OverflowError:  # a Python int (or Fraction) beyond float64
        weight = math.inf if value > 0 else -math.inf
        if weight > 0:
            raise _beyond_float64(value, name) from None
    if weight == math.inf and np.isfinite(value):  # a long double beyond float64
        raise _beyond_float64(value, name)
    if not math.isfinite(weight) or weight < 0:
        raise ValueError(f"`{name}` must be finite and >= 0, got {_shown(value)}.")
    return weight


def weight_array(values, name: str) -> np.ndarray:
    """Per-conversation weights as a 1-D float64 array: real, finite, >= 0, in float64's range."""
    if torch.is_tensor(values):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise ValueError(f"`{name}` must be 1-D, got shape {tuple(array.shape)}.")
    if array.size and array.dtype == object:  # Python ints beyond int64 (10**400), or not numbers
        return np.array(
            [conversation_weight(value, f"{name}[{i}]") for i, value in enumerate(array)]
        )
    if array.size and array.dtype.kind not in "iuf":
        raise TypeError(f"`{name}` must hold real numbers, got dtype {array.dtype}.")
    with np.errstate(over="ignore"):  # a long double beyond float64 becomes inf: named below
        converted = array.astype(np.float64)
    bad = ~np.isfinite(converted) | (converted < 0)
    if bad.any():
        index = int(np.flatnonzero(bad)[0])
        if converted[index] == np.inf and np.isfinite(array[index]):
            raise _beyond_float64(array[index], f"{name}[{index}]")
        raise ValueError(
            f"`{name}` must be finite and >= 0, got {converted[index]} at index {index}."
        )
    return converted


# The widest ratio of two positive conversation weights a trainer takes. A step divides each
# weight by the step's weight mass in float64, and its targets' float32 loss coefficients
# ``weight / (mass * targets)`` must stay normal numbers: with the lightest weight 2**-64 of the
# heaviest, that is >= 2**-64 / (2**20 conversations * 2**24 targets) = 2**-108 > 2**-126. A weight
# further below would train nothing and its conversations' loss could not be logged.
WEIGHT_RATIO_LIMIT = 2.0**64


def check_weight_range(weights: np.ndarray, where, data_name: str) -> None:
    """Whether a data set's conversation weights can be carried exactly: not all 0, positive ones
    normal float64 numbers within ``WEIGHT_RATIO_LIMIT`` of each other, and a finite sum.

    Args:
        weights: ``(C,)`` float64, each already finite and >= 0 (``conversation_weight``,
            ``weight_array``).
        where: ``where(i)`` names weight ``i`` in an error (``"train_dataset[3]['weight']"``).
        data_name: names the data set in an error (``"train_dataset"``).

    Raises:
        ValueError naming the weight (or the data set, when every weight is 0) and the fix.
    """
    positive = np.flatnonzero(weights > 0)
    if weights.size and not positive.size:
        raise ValueError(
            f"every weight of `{data_name}` is 0, so nothing would train: give the conversations "
            "to learn from a weight > 0 (0 leaves a conversation out)."
        )
    if not positive.size:
        return
    tiny = np.finfo(np.float64).tiny
    lightest = int(positive[np.argmin(weights[positive])])
    heaviest = int(np.argmax(weights))
    if weights[lightest] < tiny:
        raise ValueError(
            f"`{where(lightest)}` is {weights[lightest]:g}, below float64's normal range "
            f"({tiny:g}), where a weight loses its digits: scale every weight up (the weighted "
            "mean does not depend on their scale), or give it 0 to leave the conversation out."
        )
    if weights[lightest] * WEIGHT_RATIO_LIMIT < weights[heaviest]:
        raise ValueError(
            f"`{where(lightest)}` is {weights[lightest]:g}, more than 2**64 times lighter than "
            f"`{where(heaviest)}` ({weights[heaviest]:g}): its share of a step would fall below "
            "float32's range, so it would train nothing and its loss could not be logged; give it "
            "0 to leave the conversation out, or narrow the weights' range."
        )
    with np.errstate(over="ignore"):
        total = np.cumsum(weights)
    if not np.isfinite(total[-1]):
        first = int(np.argmax(~np.isfinite(total)))
        raise ValueError(
            f"the weights of `{data_name}` add up to more than float64 holds (at "
            f"`{where(first)}`): scale every weight down (the weighted mean does not depend on "
            "their scale)."
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
