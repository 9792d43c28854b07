"""The pure-PyTorch cross entropy: the definition the kernels are tested against.

Written for clarity, not speed: logits are upcast (float64 stays float64, everything else
becomes float32), the per-token loss is the contract's formula, and autograd provides the
gradient. It is also the CPU path of ``backend="auto"``.
"""

from __future__ import annotations

import torch

from .targets import prepare_targets


def token_losses(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Unweighted per-token loss ``l_t`` and its z-term.

    Args:
        logits: ``(N, V)`` float64/float32/bfloat16/float16.
        targets: ``(N,)`` int64 target class, or ``ignore_index``.

    Returns:
        ``(l, z)``, both ``(N,)`` in the compute dtype (float64 for float64 logits, else
        float32), with ``l`` including the z-term and both 0 where there is no target.
    """
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(compute_dtype)
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    lse = torch.logsumexp(x, dim=-1)
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, 0)
    x_target = x.gather(-1, safe_targets[:, None]).squeeze(-1)
    eps = label_smoothing
    # l_t = (1 - eps) * (lse - x[y]) + eps * (lse - mean_j x[j]) + z * lse^2
    loss = (1.0 - eps) * (lse - x_target) + eps * (lse - x.mean(dim=-1))
    z_term = z_loss_scale * lse.square()
    zero = torch.zeros((), dtype=compute_dtype, device=x.device)
    return torch.where(valid, loss + z_term, zero), torch.where(valid, z_term, zero)


def cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    cu_seqlens: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    is_packed: bool = False,
    shift: bool = False,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    softcap: float | None = None,
    num_items_in_batch=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The contract's loss in plain PyTorch; arguments as :func:`packed_ce.cross_entropy`.

    Returns:
        ``(loss, z_loss)``: 0-d tensors for "mean"/"sum", ``labels``-shaped for "none", in the
        compute dtype (float64 for float64 logits, else float32).
    """
    vocab = logits.shape[-1]
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    prepared = prepare_targets(
        labels,
        cu_seqlens=cu_seqlens,
        position_ids=position_ids,
        is_packed=is_packed,
        shift=shift,
        ignore_index=ignore_index,
        reduction=reduction,
        num_items_in_batch=num_items_in_batch,
        dtype=compute_dtype,
    )
    loss, z_term = token_losses(
        logits.reshape(-1, vocab),
        prepared.targets,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss_scale=z_loss_scale,
        softcap=softcap,
    )
    loss, z_term = prepared.coef * loss, prepared.coef * z_term
    if reduction == "none":
        return loss.reshape(labels.shape), z_term.reshape(labels.shape).detach()
    return loss.sum(), z_term.sum().detach()
