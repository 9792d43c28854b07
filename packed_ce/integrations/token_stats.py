"""Per-token training metrics (entropy, top-1 accuracy) without keeping a second ``(N, V)`` tensor.

TRL's SFTTrainer logs ``entropy`` and ``mean_token_accuracy``: token means over the targets of
the step. Both need each target row's full distribution, so they are computed here under
``no_grad`` over the rows that have a target, ``CHUNK_ROWS`` rows at a time: from the logits
when the model returned them (an elementwise pass, no GEMM), or from the last hidden states and
the LM head weight in the fused path (one forward GEMM over the target rows, ``2 * M * H * V``
flops for ``M`` targets, a third of what the loss's own forward and backward GEMMs cost, and
never more than a ``(CHUNK_ROWS, V)`` block in memory).
"""

from __future__ import annotations

import torch

# Rows per block: a (4096, V) float32 block is 2 GiB at V = 128256, small next to the weights of
# a model with such a vocabulary, and large enough to keep the GEMM efficient.
CHUNK_ROWS = 4096


@torch.no_grad()
def token_statistics(
    targets: torch.Tensor,
    *,
    logits: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sums of the entropy and of the top-1 hits over the targets, and the number of targets.

    Pass either ``logits`` or ``hidden`` and ``weight`` (logits ``= hidden @ weight.T + bias``,
    then soft-capped by ``softcap``, as the fused loss computes them).

    Args:
        targets: ``(N,)`` int64, the class each row is scored against, ``ignore_index`` where a
            row has no target (already shifted: see :func:`next_token_targets`).
        logits: ``(N, V)`` or ``(B, T, V)`` float32/bfloat16/float16, as the model returned them.
        hidden: ``(N, H)`` or ``(B, T, H)``, the last hidden states.
        weight: ``(V, H)`` the LM head weight; ``bias`` ``(V,)`` or None.
        softcap: ``c`` of ``c * tanh(x / c)``, or None.
        ignore_index: the value of ``targets`` that is no target.

    Returns:
        ``(3,)`` float32 on the targets' device: ``[sum of entropies, number of targets whose
        class is the most likely one, number of targets]`` (the entropy in nats, of the
        float32 softmax).

    Example:
        >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0], [0.0, 5.0]])
        >>> token_statistics(torch.tensor([1, 0, -100]), logits=logits)  # entropies log 2 and 0.3653
        tensor([1.0585, 1.0000, 2.0000])
    """
    if (logits is None) == (hidden is None) or (hidden is not None and weight is None):
        raise ValueError("token_statistics needs either logits, or hidden and weight")
    source = logits if logits is not None else hidden
    rows = source.reshape(-1, source.shape[-1])
    targets = targets.reshape(-1).to(rows.device)
    # boolean indexing: one host sync, which only metrics pay (the loss needs none)
    picked = (targets != ignore_index).nonzero().squeeze(1)
    totals = torch.zeros(3, dtype=torch.float32, device=rows.device)
    totals[2] = picked.numel()
    for start in range(0, picked.numel(), CHUNK_ROWS):
        index = picked[start : start + CHUNK_ROWS]
        block = rows[index]
        if logits is None:
            block = torch.nn.functional.linear(block, weight, bias)
            if softcap is not None:
                block = softcap * torch.tanh(block / softcap)
        block = block.float()
        probs = block.softmax(-1)
        # -sum p log p, with 0 log 0 = 0 where a logit is -inf
        totals[0] += torch.special.entr(probs).sum()
        totals[1] += (block.argmax(-1) == targets[index]).sum()
    return totals
