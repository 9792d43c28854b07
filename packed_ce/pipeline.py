"""The one front door of :func:`packed_ce.cross_entropy` and
:func:`packed_ce.fused_linear_cross_entropy`: check, prepare targets, run, reshape, validate.

Both losses are ``sum_t coef[t] * l_t`` over the rows of some logits; they differ only in how
the rows are computed (given logits, or chunks of ``hidden @ weight.T + bias``). Everything
else, in this order, is :func:`run_loss`:

1. the value checks of earlier calls still pending are read, and raise if one failed
   (:func:`packed_ce.check_pending`, which says when values are checked);
2. the tensors' metadata is checked (:func:`packed_ce.validation.check_arguments`; the options
   were checked when their :class:`packed_ce.options.LossOptions` was built);
3. targets and coefficients are prepared (:func:`packed_ce.targets.prepare_targets`);
4. with ``validate``, the values are checked (:func:`packed_ce.validation.check_values`): now,
   or on the device for the kernel on CUDA, where a failure makes the coefficients NaN;
5. the caller's ``run`` computes the loss and z-term from the coefficients (and, with
   ``return_token_stats`` or ``return_seq_losses``, fills the per-row stats buffer in the same
   pass);
6. "none" is reshaped to the labels' shape; the stats are summed over the targets, or over each
   sequence's targets.
"""

from __future__ import annotations

from typing import Callable

import torch

from .options import Boundaries, LossOptions
from .reference import compute_dtype
from .pending import check_pending
from .stats import sum_sequence_losses, sum_token_stats
from .targets import Targets, prepare_targets, sequence_ids
from .validation import allowed_dtypes, check_arguments, check_values


def run_loss(
    run: Callable[[Targets, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]],
    labels: torch.Tensor,
    boundaries: Boundaries,
    options: LossOptions,
    *,
    backend: str,
    logits_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    name: str = "logits",
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """The loss of one call, whatever computes its rows.

    Args:
        run: ``(prepared, stats) -> (loss, z_loss)``: 0-d sums for "mean"/"sum", ``(N,)`` rows
            for "none"; ``stats`` is None, or with ``options.return_token_stats`` or
            ``options.return_seq_losses`` an ``(N, 3)`` float32 buffer of zeros that ``run``
            fills with each row's entropy, top-1 hit and ``coef_t * l_t`` (at least in the rows
            whose coefficient is nonzero).
        labels: ``(N,)`` or ``(B, T)`` integer labels.
        boundaries: the call's per-call tensors. options: its options.
        backend: "triton" or "torch" (:func:`packed_ce.runtime.resolve_backend`).
        logits_shape: ``(N, V)`` or ``(B, T, V)``, of the logits the rows are (or would be).
        dtype, device: of those logits (float64 means float64 arithmetic on the torch backend).
        name: how the logits are called in error messages.

    Returns:
        The loss, 0-d for "mean"/"sum", ``labels``-shaped for "none"; then ``z_loss`` (shaped
        like the loss) with ``options.return_z_loss``, then a :class:`packed_ce.TokenStats`
        with ``options.return_token_stats``, then a :class:`packed_ce.SequenceLosses` with
        ``options.return_seq_losses``: ``loss`` alone, or a tuple in that order.
    """
    check_pending()
    check_arguments(
        logits_shape,
        dtype,
        device,
        labels,
        boundaries,
        is_packed=options.is_packed,
        allowed=allowed_dtypes(backend),
        name=name,
    )
    prepared = prepare_targets(
        labels, boundaries, options, dtype=compute_dtype(dtype), use_kernel=backend == "triton"
    )
    if options.validate:
        # the kernel's checks may be deferred (they then make the coefficients NaN); the
        # reference's are read now
        coef = prepared.coef if backend == "triton" else None
        check_values(labels, logits_shape[-1], boundaries, options, coef)
    stats = None
    if options.return_token_stats or options.return_seq_losses:
        # zeros: a row the loss skips (no target, left out of the GEMMs) is never written
        stats = torch.zeros(prepared.coef.shape[0], 3, dtype=torch.float32, device=device)
    loss, z_loss = run(prepared, stats)
    if options.reduction == "none":
        loss, z_loss = loss.reshape(labels.shape), z_loss.reshape(labels.shape)
    outputs = (loss, z_loss) if options.return_z_loss else (loss,)
    if options.return_token_stats:
        outputs += (sum_token_stats(stats[:, :2], prepared.coef),)
    if options.return_seq_losses:
        seq, num_slots = sequence_ids(labels, boundaries.cu_seqlens, boundaries.position_ids)
        outputs += (sum_sequence_losses(stats[:, 2], prepared.coef, seq, num_slots),)
    return outputs if len(outputs) > 1 else loss
