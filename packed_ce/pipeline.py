"""The one front door of :func:`packed_ce.cross_entropy` and
:func:`packed_ce.fused_linear_cross_entropy`, which differ only in how the rows of logits are
computed: pending checks read, metadata checked, targets prepared, values checked (now, or on
the device), the caller's ``run``, "none" reshaped, stats summed.
"""

from __future__ import annotations

from typing import Callable

import torch

from .options import Boundaries, LossOptions
from .pending import check_pending, check_values
from .reference import compute_dtype
from .stats import sum_sequence_losses, sum_token_stats
from .targets import Targets, prepare_targets, sequence_ids
from .validation import allowed_dtypes, check_arguments


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
        run: ``(prepared, stats) -> (loss, z_loss)``: 0-d sums, or ``(N,)`` rows for "none";
            ``stats`` None or an ``(N, 3)`` float32 zeros buffer ``run`` fills where ``coef != 0``
            with entropy, top-1 hit and ``coef_t * l_t``.
        labels, boundaries, options: the call's. backend: "triton" or "torch".
        logits_shape, dtype, device: of the logits the rows are (or would be), called ``name``.

    Returns:
        ``loss``, or ``(loss, z_loss, TokenStats, SequenceLosses)`` as far as the options ask.
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
