"""The pure-PyTorch cross entropy the kernels are tested against, and the torch backend: logits
upcast (float64 stays float64, else float32), the contract's formula, autograd's gradient.
"""

from __future__ import annotations

import torch

from .options import LossOptions
from .targets import Targets


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype for inputs of ``dtype``: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def token_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    options: LossOptions,
    coef: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted per-token loss ``l_t`` and its z-term.

    Args:
        logits: ``(N, V)`` float64/float32/bfloat16/float16.
        targets: ``(N,)`` int64 target class, or ``options.ignore_index``.
        options: read for ``ignore_index``, ``label_smoothing``, ``z_loss_scale``, ``softcap``.
        coef: ``(N,)`` the rows' loss coefficients, or None: a row whose coefficient is 0 (its
            sequence weighs 0) counts as one without a target.

    A ``-inf`` logit has zero probability and gradient (with ``label_smoothing > 0`` its row's
    loss is ``+inf``); a row without a target is never read, as in the kernel.

    Returns:
        ``(l, z)``, ``(N,)`` in the compute dtype, ``l`` including ``z``, 0 without a target.
    """
    valid = targets != options.ignore_index
    if coef is not None:
        valid = valid & (coef != 0)
    # zeros in the rows without a target, before any arithmetic: autograd multiplies a masked
    # row's zero gradient by the softmax of its logits, NaN for NaN logits (0 * nan)
    x = torch.where(valid[:, None], logits.to(compute_dtype(logits.dtype)), 0.0)
    if options.softcap is not None:
        x = options.softcap * torch.tanh(x / options.softcap)
    lse = torch.logsumexp(x, dim=-1)
    # A label outside [0, V) (possible only unvalidated) gives NaN, as in the kernel, instead of
    # an indexing error here
    in_range = (targets >= 0) & (targets < x.shape[-1])
    safe_targets = torch.where(valid & in_range, targets, 0)
    x_target = x.gather(-1, safe_targets[:, None]).squeeze(-1)
    eps = options.label_smoothing
    # l_t = (1 - eps) * (lse - x[y]) + eps * (lse - mean_j x[j]) + z * lse^2
    loss = lse - x_target
    # each term only where its weight is nonzero: with a -inf logit lse - mean_j x[j] is +inf,
    # and 0 * inf would make the finite loss of eps == 0 NaN
    if eps != 0.0:
        loss = (1.0 - eps) * loss + eps * (lse - x.mean(dim=-1))
    # only when asked for, as in the kernel: logits of ~2e19 square to inf in float32, and
    # 0 * inf would make the loss NaN
    z_term = options.z_loss_scale * lse.square() if options.z_loss_scale else torch.zeros_like(lse)
    # a +inf logit leaves the softmax undefined: NaN, as F.cross_entropy and the kernel give
    loss = torch.where(in_range & (lse != float("inf")), loss, float("nan"))
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid, loss + z_term, zero), torch.where(valid, z_term, zero)


@torch.no_grad()
def token_stats_rows(
    logits: torch.Tensor, targets: torch.Tensor, options: LossOptions
) -> torch.Tensor:
    """Each row's softmax entropy and top-1 hit, as the kernel's ``stats`` output; detached.

    Args:
        logits: ``(N, V)`` float64/float32/bfloat16/float16.
        targets: ``(N,)`` int64 target class, or ``options.ignore_index``.
        options: read for ``ignore_index`` and ``softcap``.

    Returns:
        ``(N, 2)`` float32: ``H = -sum_j p_j log p_j`` (nats, soft-capped) and 1.0 where
        ``x[y] >= max_j x_j``; 0 without a target.
    """
    x = logits.to(compute_dtype(logits.dtype))
    if options.softcap is not None:
        x = options.softcap * torch.tanh(x / options.softcap)
    log_p = torch.log_softmax(x, dim=-1)
    p = log_p.exp()
    # p_j == 0 where x_j == -inf: its term is 0, not 0 * -inf
    entropy = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
    valid = targets != options.ignore_index
    x_target = x.gather(-1, torch.where(valid, targets, 0)[:, None]).squeeze(-1)
    hit = (x_target >= x.amax(-1)).to(x.dtype)
    rows = torch.stack([entropy, hit], dim=-1)
    return torch.where(valid[:, None], rows, 0.0).to(torch.float32)


def loss_from_targets(
    logits: torch.Tensor,
    prepared: Targets,
    options: LossOptions,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, z_loss)`` of prepared targets: summed for "mean"/"sum", ``(N,)`` for "none".

    Args:
        logits: ``(N, V)`` (any leading shape flattening to ``N`` rows).
        prepared: targets and coefficients from :func:`packed_ce.targets.prepare_targets`.
        options: the call's options.
        stats: ``(N, 3)`` float32 or None: column 2 receives the rows' ``coef_t * l_t``.
    """
    rows = logits.reshape(-1, logits.shape[-1])
    loss, z_term = token_losses(rows, prepared.targets, options, prepared.coef)
    loss, z_term = prepared.coef * loss, prepared.coef * z_term
    if stats is not None:
        stats[:, 2] = loss.detach()
    if options.reduction == "none":
        return loss, z_term.detach()
    return loss.sum(), z_term.sum().detach()
