"""A conversation's weight, checked where it enters: one real number per conversation, finite,
>= 0 and within float64's range, and a data set's weights within a ratio the loss carries exactly.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong value)
naming the value, so a bad weight never becomes a silently rounded float or a NaN loss.
"""

from __future__ import annotations

import math
import numbers

import numpy as np
import torch


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
