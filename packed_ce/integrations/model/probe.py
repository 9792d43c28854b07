"""What a model does, not what its masks say: a conversation's logits must not depend on the one
before it in the row, nor on another row of the batch.

The masks a decoder layer receives are read by ``audit.py``; a family can also mix tokens
by a path no mask shows (a convolution, a recurrence, a pooled block, a batch-wide router, a
module of remote code). :func:`probe`, on the first packed call of each attention implementation,
runs the model's own forward as a training step runs it (the packed-ce keywords and hooks in
place, the model in its own mode: dropout and router noise drawn from the same seed for every
run, so that only the inputs differ) on two rows of two conversations of ``n`` tokens each (``n``
up to :data:`PROBE_TOKENS`, as the model's positions allow): ``A + B, C + D`` twice (the
run-to-run noise: kernels with atomics, a MoE's index_add on CUDA) and ``A' + B, C' + D'`` with
``A'`` and ``C'`` other tokens. ``B``'s logits must be the same: a change is a leak from the
conversation before it in the row or from the other row. Without gradients; the model's modes
and random state are as they were after it.

Skipped where its forwards could not run on one process alone: parameters sharded by FSDP or
DeepSpeed ZeRO-3 gather them in collectives every rank must join, and a rank whose batch holds one
conversation would not probe.
"""

from __future__ import annotations

import torch
from torch import nn

from ...columns import INPUT_IDS, POSITION_IDS

# Each conversation's tokens, at most: further than a short convolution's window or a delta rule's
# chunk reaches back, and a leak from anywhere in the conversation before is seen.
PROBE_TOKENS = 64
# A leak counts when it exceeds this many times the noise (or the float type's rounding).
NOISE_FACTOR = 16


def probe(model: nn.Module, forward, kwargs: dict, prepare) -> str | None:
    """Why ``model`` lets a packed conversation depend on the one before or on another row, or
    None.

    Args:
        model: the transformers model with the packed loss (not a wrapper).
        forward: its own forward (``forward(**keywords)``), the packed-ce hooks in place.
        kwargs: the packed call's keywords: its tokens (``input_ids`` or ``inputs_embeds``) give
            the probe's.
        prepare: ``prepare(args, keywords)``: the keywords the packed forward gives the model's
            own forward for a call (its layout, the mixers' keywords, ...).
    """
    if _sharded(model):
        return None
    tokens, key = kwargs.get(INPUT_IDS), INPUT_IDS
    if tokens is None:
        tokens, key = kwargs.get("inputs_embeds"), "inputs_embeds"
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return None
    n = _probe_tokens(model)
    same, other = _rows(tokens, key, model, n)
    positions = torch.arange(n, device=tokens.device).repeat(2)[None].expand(2, -1)  # (2, 2n)
    call = prepare((), {key: same, POSITION_IDS: positions, "use_cache": False})
    devices = [tokens.device] if tokens.device.type == "cuda" else []
    logits = []
    with torch.no_grad(), torch.random.fork_rng(devices=devices):
        for rows in (same, same, other):
            torch.manual_seed(0)  # the same dropout and router noise on every run
            logits.append(forward(**{**call, key: rows}).logits[0, n:].float())  # B's
    noise = (logits[0] - logits[1]).abs().max()
    leak = (logits[2] - logits[0]).abs().max()
    scale = logits[0].abs().max().clamp_min(1.0)
    rounding = NOISE_FACTOR * torch.finfo(tokens.dtype if key != INPUT_IDS else _dtype(model)).eps
    if bool(leak <= torch.maximum(NOISE_FACTOR * noise, rounding * scale)):
        return None
    mode = "training" if model.training else "evaluation"
    return (
        f"the logits of a conversation change by {float(leak):.1e} (run-to-run noise "
        f"{float(noise):.1e}, {mode} mode) when the conversation before it in the row and the "
        "other row of the batch change: a layer mixes tokens across conversations by a path no "
        "attention mask shows"
    )


def _probe_tokens(model: nn.Module) -> int:
    """``n``: :data:`PROBE_TOKENS`, fewer where the model has fewer than ``2n`` positions."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    positions = getattr(config or model.config, "max_position_embeddings", None)
    if isinstance(positions, int) and positions > 0:
        return max(2, min(PROBE_TOKENS, positions // 2))
    return PROBE_TOKENS


def _rows(tokens: torch.Tensor, key: str, model: nn.Module, n: int):
    """Two batches of two rows, ``(2, 2n)`` token ids (``(2, 2n, H)`` embeddings): ``A + B, C + D``
    from the call's tokens, and ``A' + B, C' + D'``, with ``A'``, ``C'`` and ``D'`` other ids than
    ``A``, ``C`` and ``D`` at every position (the negated embeddings).
    """
    flat = tokens.reshape(-1, *tokens.shape[2:])
    flat = flat.repeat((-(-4 * n // flat.shape[0]),) + (1,) * (flat.dim() - 1))  # >= 4n tokens
    a, b, c, d = (flat[i * n : (i + 1) * n] for i in range(4))
    if key == INPUT_IDS:
        vocabulary = model.get_input_embeddings().num_embeddings
        shift = 1 + torch.arange(n, device=flat.device)

        def changed(part):
            return (part + shift) % vocabulary
    else:

        def changed(part):
            return -part

    same = torch.stack((torch.cat((a, b)), torch.cat((c, d))))
    other = torch.stack((torch.cat((changed(a), b)), torch.cat((changed(c), changed(d)))))
    return same, other


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
