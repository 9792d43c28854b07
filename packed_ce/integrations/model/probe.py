"""What a model does, not what its masks say: a conversation's logits must not depend on the one
before it in the row.

The masks a decoder layer receives are read by ``audit.py``; a family can also mix tokens
by a path no mask shows (a convolution, a recurrence, a pooled block, a batch-wide router).
:func:`probe`, on the first packed call of each attention implementation, runs the model's own
forward (every packed-ce hook in place: per-conversation rotary embeddings and mixers) on two rows
of two conversations of :data:`PROBE_TOKENS` tokens each, ``A + B`` and ``A' + B`` with ``A'``
other tokens than ``A``, and requires ``B``'s logits to be the same, up to the run-to-run noise of
``A + B`` computed twice (a kernel with atomics, a MoE's index_add on CUDA). The probe runs in
evaluation mode without gradients (no dropout, no router noise), then the model is as it was.

Skipped where its forwards could not run on one process alone: parameters sharded by FSDP or
DeepSpeed ZeRO-3 gather them in collectives every rank must join, and a rank whose batch holds one
conversation would not probe.
"""

from __future__ import annotations

import torch
from torch import nn

from ...columns import INPUT_IDS, POSITION_IDS

PROBE_TOKENS = 8  # each conversation's; longer than a short convolution's window
# A leak counts when it exceeds this many times the noise (or the float type's rounding).
NOISE_FACTOR = 16


def probe(model: nn.Module, forward, kwargs: dict, boundaries) -> str | None:
    """Why ``model`` lets a packed conversation depend on the one before, or None.

    Args:
        model: the transformers model with the packed loss (not a wrapper).
        forward: its own forward (``forward(**keywords)``), the packed-ce hooks in place.
        kwargs: the packed call's keywords: its tokens (``input_ids`` or ``inputs_embeds``) give
            the probe's.
        boundaries: ``boundaries(keywords, shape)``: the keywords with what the packed forward
            adds for a packed call of ``(B, T)`` tokens (the mixers' ``seq_idx``, ...).
    """
    if _sharded(model):
        return None
    tokens, key = kwargs.get(INPUT_IDS), INPUT_IDS
    if tokens is None:
        tokens, key = kwargs.get("inputs_embeds"), "inputs_embeds"
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return None
    first, second, other = _conversations(tokens, key, model)
    n = PROBE_TOKENS
    positions = torch.arange(n, device=tokens.device).repeat(2)[None]  # (1, 2n): restarts at n
    call = boundaries({POSITION_IDS: positions, "use_cache": False}, (1, 2 * n))
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            logits = [
                forward(**{key: torch.cat(pair, dim=1), **call}).logits[0, n:].float()
                for pair in ((first, second), (first, second), (other, second))
            ]
    finally:
        for module, training in modes:
            module.training = training
    noise = (logits[0] - logits[1]).abs().max()
    leak = (logits[2] - logits[0]).abs().max()
    scale = logits[0].abs().max().clamp_min(1.0)
    rounding = NOISE_FACTOR * torch.finfo(tokens.dtype if key != INPUT_IDS else _dtype(model)).eps
    if bool(leak <= torch.maximum(NOISE_FACTOR * noise, rounding * scale)):
        return None
    return (
        f"the logits of a conversation change by {float(leak):.1e} (run-to-run noise "
        f"{float(noise):.1e}) when the conversation before it in the row changes: a layer mixes "
        "tokens across conversations by a path no attention mask shows"
    )


def _conversations(tokens: torch.Tensor, key: str, model: nn.Module):
    """``A``, ``B`` and ``A'``: ``(1, n)`` token ids of the call (or ``(1, n, H)`` embeddings),
    ``A'`` other ids than ``A`` at every position (the negated embeddings).
    """
    n = PROBE_TOKENS
    flat = tokens.reshape(-1, *tokens.shape[2:])
    flat = flat.repeat((-(-2 * n // flat.shape[0]),) + (1,) * (flat.dim() - 1))  # >= 2n tokens
    first, second = flat[:n][None], flat[n : 2 * n][None]
    if key != INPUT_IDS:
        return first, second, -first
    vocabulary = model.get_input_embeddings().num_embeddings
    return first, second, (first + 1 + torch.arange(n, device=first.device)) % vocabulary


def _dtype(model: nn.Module) -> torch.dtype:
    parameter = next((p for p in model.parameters() if p.is_floating_point()), None)
    return torch.float32 if parameter is None else parameter.dtype


def _sharded(model: nn.Module) -> bool:
    """Parameters that FSDP (a ``DTensor``, a flat parameter) or ZeRO-3 (``ds_id``) shards."""
    for parameter in model.parameters():
        if hasattr(parameter, "ds_id") or type(parameter).__name__ == "FlatParameter":
            return True
        if torch.distributed.is_available() and hasattr(parameter, "placements"):
            return True
    return False
