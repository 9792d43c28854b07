"""The one front door of :func:`packed_ce.cross_entropy` and
:func:`packed_ce.fused_linear_cross_entropy`: check, prepare targets, run, reshape, validate.

Both losses are ``sum_t coef[t] * l_t`` over the rows of some logits; they differ only in how
the rows are computed (given logits, or chunks of ``hidden @ weight.T + bias``). Everything
else, in this order, is :func:`run_loss`:

1. the tensors' metadata is checked (:func:`packed_ce.validation.check_arguments`; the options
   were checked when their :class:`packed_ce.options.LossOptions` was built);
2. on the torch backend, label range and the contents of ``cu_seqlens``, ``seq_targets`` and
   ``seq_weights`` are checked first (the reference would fail on a bad label anyway);
3. targets and coefficients are prepared (:func:`packed_ce.targets.prepare_targets`);
4. the caller's ``run`` computes the loss and z-term from them;
5. "none" is reshaped to the labels' shape;
6. on the Triton backend, the same values are checked after the launch: the one host
   sync then waits for work already queued instead of idling the GPU while the host prepares
   the kernel. The kernels are memory-safe on bad values (NaN loss), so nothing wrong escapes:
   the error is raised here.
"""

from __future__ import annotations

from typing import Callable

import torch

from .options import Boundaries, LossOptions
from .reference import compute_dtype
from .targets import Targets, prepare_targets
from .validation import allowed_dtypes, check_arguments, check_values


def run_loss(
    run: Callable[[Targets], tuple[torch.Tensor, torch.Tensor]],
    labels: torch.Tensor,
    boundaries: Boundaries,
    options: LossOptions,
    *,
    backend: str,
    logits_shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    name: str = "logits",
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The loss of one call, whatever computes its rows.

    Args:
        run: ``prepared -> (loss, z_loss)``: 0-d sums for "mean"/"sum", ``(N,)`` rows for "none".
        labels: ``(N,)`` or ``(B, T)`` integer labels.
        boundaries: the call's per-call tensors. options: its options.
        backend: "triton" or "torch" (:func:`packed_ce.runtime.resolve_backend`).
        logits_shape: ``(N, V)`` or ``(B, T, V)``, of the logits the rows are (or would be).
        dtype, device: of those logits (float64 means float64 arithmetic on the torch backend).
        name: how the logits are called in error messages.

    Returns:
        The loss, or ``(loss, z_loss)`` with ``options.return_z_loss``: 0-d for "mean"/"sum",
        ``labels``-shaped for "none".
    """
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
    vocab = logits_shape[-1]

    def validate_values():
        check_values(
            labels,
            vocab,
            options.ignore_index,
            boundaries.cu_seqlens,
            shift=options.shift,
            seq_targets=boundaries.seq_targets,
            seq_weights=boundaries.seq_weights,
        )

    if options.validate and backend == "torch":
        validate_values()
    prepared = prepare_targets(
        labels, boundaries, options, dtype=compute_dtype(dtype), use_kernel=backend == "triton"
    )
    loss, z_loss = run(prepared)
    if options.reduction == "none":
        loss, z_loss = loss.reshape(labels.shape), z_loss.reshape(labels.shape)
    if options.validate and backend == "triton":
        validate_values()
    return (loss, z_loss) if options.return_z_loss else loss
