"""The checks of every call of a model with the packed loss: exact or refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from collators.columns import ATTENTION_MASK, CU_SEQLENS, CU_SEQ_LENS_Q, INPUT_IDS, LABELS, POSITION_IDS

# The per-call tensors the model's own forward reads before the packed loss does (its attention:
# position_ids, and cu_seq_lens_q with flash attention): type-checked here, where they enter.
MODEL_TENSORS = (CU_SEQ_LENS_Q, POSITION_IDS)
# Under this keyword the installed forward hands the loss its boundaries from MODEL_TENSORS when
# the batch has no cu_seqlens, already type-checked: ``{"cu_seqlens": cu_seq_lens_q}`` or
# ``{"position_ids": position_ids}`` (a causal LM's forward consumes position_ids and does not pass
# them on). The loss type-checks only what it reads from elsewhere (cu_seqlens, seq_targets,
# seq_weights), so each per-call tensor is checked once. Like any extra keyword it also reaches
# the attention functions, which ignore keywords they do not know.
BOUNDARIES_KEY = "packed_ce_boundaries"


def batch_tensor(batch: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """``batch[key]``: a tensor, or None when absent.

    Raises:
        TypeError naming ``key`` for anything else (a list would otherwise fail deep inside the
        loss with an AttributeError that names no argument).
    """
    value = batch.get(key)
    if value is None or isinstance(value, torch.Tensor):
        return value
    raise TypeError(
        f"{key} must be a torch.Tensor, got {type(value).__name__}: pass "
        f"torch.tensor({key}) (collators.PackedCollator returns tensors)"
    )


def checked_call(args: tuple, kwargs: dict) -> dict:
    """The keywords of a call of a model with the packed loss, kept on the packed objective.

    - ``fused_lm_head=True`` (trl's ``SFTTrainer``) computes trl's own token mean and never calls
      the packed loss: refused, :class:`PackedSFTTrainer` is the fix.
    - A packed batch (see :func:`_exact_packed_call`) runs without a KV cache and without an
      all-ones ``attention_mask``, either of which would make its sequences attend to each other.
    - without ``cu_seqlens``, ``cu_seq_lens_q`` or else ``position_ids`` are handed to the loss
      under :data:`BOUNDARIES_KEY`.

    Returns:
        the keywords to call the model's forward with (a new dict where any changed).
    """
    for key in MODEL_TENSORS:
        batch_tensor(kwargs, key)
    if kwargs.get("fused_lm_head"):
        raise ValueError(
            "this model has the packed loss (apply_packed_loss), but trl's fused_lm_head=True "
            "computes trl's own token mean and never calls it: train with "
            "packed_ce.integrations.PackedSFTTrainer instead of trl.SFTTrainer"
        )
    kwargs = _exact_packed_call(args, kwargs)
    if kwargs.get(LABELS) is not None and kwargs.get(CU_SEQLENS) is None:
        for key, argument in ((CU_SEQ_LENS_Q, CU_SEQLENS), (POSITION_IDS, POSITION_IDS)):
            if kwargs.get(key) is not None:
                return {**kwargs, BOUNDARIES_KEY: {argument: kwargs[key]}}
    return kwargs


def _exact_packed_call(args: tuple, kwargs: dict) -> dict:
    """The keywords of a packed call, changed so that no sequence attends to another.

    A batch is packed when it has ``cu_seqlens`` or ``cu_seq_lens_q`` with a boundary inside a
    row, or ``labels`` and ``position_ids`` that restart inside a row. transformers builds the
    block-diagonal mask of such a row from ``position_ids`` only without an ``attention_mask``
    and without a KV cache; otherwise every token attends to every earlier token of its row
    (a relative loss error of about 2e-3 on Llama and Qwen2, sdpa and eager). So:

    - the cache is turned off (a training or scoring call never reads it back);
    - an ``attention_mask`` of ones, which says nothing, is dropped;
    - an ``attention_mask`` that masks tokens, or a ``past_key_values`` passed in, cannot be
      made exact: ValueError.

    Deciding whether boundaries lie inside rows reads them (one host sync), and only happens
    when an ``attention_mask`` or ``past_key_values`` is passed with them.
    """
    boundaries = kwargs.get(CU_SEQLENS)
    if boundaries is None:
        boundaries = kwargs.get(CU_SEQ_LENS_Q)
    positions = kwargs.get(POSITION_IDS) if kwargs.get(LABELS) is not None else None
    if boundaries is None and positions is None:
        return kwargs
    kwargs = {**kwargs, "use_cache": False}
    mask = kwargs.get(ATTENTION_MASK)
    if mask is None and kwargs.get("past_key_values") is None:
        return kwargs
    if not _restarts_inside_rows(args, kwargs, boundaries, positions):
        return kwargs
    if kwargs.get("past_key_values") is not None:
        raise ValueError(
            "past_key_values cannot be used with a packed batch (sequence boundaries inside a "
            "row): the cached keys would be attended across sequences"
        )
    if not bool(mask.all()):
        raise ValueError(
            "a packed batch (sequence boundaries inside a row) cannot have an attention_mask that "
            "masks tokens: transformers then ignores the boundaries and lets sequences attend to "
            "each other. Leave attention_mask out and make padding a sequence of its own "
            "(collators.PackedCollator(pad_to_multiple_of=...) does)"
        )
    del kwargs[ATTENTION_MASK]
    return kwargs


def _restarts_inside_rows(args, kwargs, boundaries, positions) -> bool:
    """True if a sequence of the batch starts anywhere but at the start of a row (False for
    ``cu_seqlens`` that are not a tensor: the loss refuses them by name)."""
    if boundaries is not None:
        if not isinstance(boundaries, torch.Tensor):
            return False
        tokens = kwargs.get(INPUT_IDS)
        if tokens is None:
            tokens = kwargs.get("inputs_embeds")
        if tokens is None and args:
            tokens = args[0]
        width = tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None
        if width is None:
            return True
        return bool((boundaries.to(torch.int64) % width != 0).any())
    positions = positions.reshape(-1, positions.shape[-1])
    return bool((positions[:, 1:] != positions[:, :-1] + 1).any())
