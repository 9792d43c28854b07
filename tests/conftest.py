"""Shared fixtures: the one independent per-sequence reference loss of the test suite.

The per-sequence loop never looks at ``cu_seqlens`` or ``position_ids``: it takes the list of
sequences as Python slices, runs ``F.cross_entropy`` on each one as if it were unpacked, and
averages, which is what the packed loss must equal. It does not use ``packed_ce`` (nor the demo's
``per_sequence_mean_loss``), so a mistake there cannot hide in the reference.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

try:
    from hypothesis import settings
except ImportError:  # the GPU image runs the cuda tests without hypothesis
    settings = None

# Property tests draw the same examples on every CI run (a failure there is a bug in the tree,
# never bad luck); elsewhere hypothesis explores, and prints a failing example's seed.
if settings is not None:
    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


def per_sequence_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    slices: list[tuple[int, int]],
    *,
    is_packed: bool,
    shift: bool,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch=None,
    seq_targets: list[int] | None = None,
    seq_weights: list[float] | None = None,
) -> torch.Tensor:
    """The loss computed one sequence at a time with ``F.cross_entropy``, in float64.

    For ``is_packed=True``: each sequence's mean token loss, summed ("sum") or averaged over the
    sequences that have a target ("mean"). For ``is_packed=False``: the token sum or mean.
    "none" is not handled here (it is checked through its sum).

    ``seq_targets`` / ``seq_weights`` (one per slice): sequence ``i``'s token sum weighs
    ``seq_weights[i] / seq_targets[i]`` (packed) or ``seq_weights[i]`` instead, and "mean"
    divides by the weighted count of targets, ``sum_i seq_weights[i] * count_i / seq_targets[i]``
    (packed) or ``sum_i seq_weights[i] * count_i``.
    """
    x_all = logits.reshape(-1, logits.shape[-1]).double()
    y_all = labels.reshape(-1)
    if softcap is not None:
        x_all = softcap * torch.tanh(x_all / softcap)
    seq_sums, seq_counts, seq_scales = [], [], []
    for i, (start, end) in enumerate(slices):
        x, y = x_all[start:end], y_all[start:end]
        if shift:
            x, y = x[:-1], y[1:]
        count = int((y != ignore_index).sum())
        if count == 0:
            continue
        total = F.cross_entropy(
            x, y, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
        )
        lse = torch.logsumexp(x[y != ignore_index], dim=-1)
        total = total + z_loss_scale * lse.square().sum()
        seq_sums.append(total)
        seq_counts.append(count)
        weight = 1.0 if seq_weights is None else float(seq_weights[i])
        whole = count if seq_targets is None else int(seq_targets[i])
        seq_scales.append(weight / whole if is_packed else weight)
    # keeps the graph alive when nothing is a target (-inf logits, masked entries, add 0 too)
    zero = x_all.nan_to_num(neginf=0.0).sum() * 0.0
    if not seq_sums:
        return zero
    if seq_targets is not None or seq_weights is not None:
        total = sum(a * s for a, s in zip(seq_scales, seq_sums))
        items = sum(a * c for a, c in zip(seq_scales, seq_counts))
    elif is_packed:
        per_seq = torch.stack([s / c for s, c in zip(seq_sums, seq_counts)])
        total, items = per_seq.sum(), len(per_seq)
    else:
        total, items = torch.stack(seq_sums).sum(), sum(seq_counts)
    if reduction == "sum":
        return total + zero
    denominator = items if num_items_in_batch is None else float(num_items_in_batch)
    return total / denominator + zero if denominator > 0 else zero


@pytest.fixture(name="per_sequence_loss", scope="session")
def per_sequence_loss_fixture():
    """:func:`per_sequence_loss`, the ground truth of every loss test."""
    return per_sequence_loss


@pytest.fixture(autouse=True)
def no_pending_checks_between_tests():
    """Each test starts and ends with no value check pending (on CUDA they are read one call
    later): a test that expects a deferred error reads it with ``packed_ce.check_pending()``, and
    a leftover never raises inside the next, unrelated test."""
    from packed_ce import pending

    pending._pending.clear()
    yield
    pending._pending.clear()
