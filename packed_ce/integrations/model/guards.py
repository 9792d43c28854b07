"""The checks of every call of a model with the packed loss: exact or refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from packed_ce.columns import (
    ATTENTION_MASK,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    INPUT_IDS,
    LABELS,
    LAYOUT,
    POSITION_IDS,
    SHARD,
)
from packed_ce.layout import PackedLayout
from packed_ce.options import SEQUENCE_FIELDS

# The per-call tensors the model's own forward reads before the packed loss does (its attention:
# position_ids, and cu_seq_lens_q with flash attention): type-checked here, where they enter.
MODEL_TENSORS = (CU_SEQ_LENS_Q, POSITION_IDS)
# The loss's own per-call tensors: type-checked here, then carried to the loss by the call's
# layout (LAYOUT) and left out of the model's keywords: a mixer that hands its **kwargs to a kernel
# takes cu_seqlens for its own (transformers' gated delta rule: "got multiple values for keyword
# argument 'cu_seqlens'").
LOSS_TENSORS = (CU_SEQLENS, *SEQUENCE_FIELDS)


def batch_tensor(batch: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """``batch[key]``: a tensor, or None when absent.

    Raises:
        TypeError naming ``key`` (not an AttributeError deep inside, naming nothing).
    """
    value = batch.get(key)
    if value is None or isinstance(value, torch.Tensor):
        return value
    raise TypeError(
        f"{key} must be a torch.Tensor, got {type(value).__name__}: pass "
        f"torch.tensor({key}) (collators.PackedCollator returns tensors)"
    )


def call_tokens(args: tuple, kwargs: dict) -> Any:
    """A model call's tokens: its ``input_ids``, else ``inputs_embeds``, else its first positional
    argument (None when it has none).
    """
    tokens = kwargs.get(INPUT_IDS)
    if tokens is None:
        tokens = kwargs.get("inputs_embeds")
    if tokens is None and args:
        tokens = args[0]
    return tokens


def checked_call(args: tuple, kwargs: dict) -> dict:
    """The keywords of a call of a model with the packed loss, kept on the packed objective.

    - ``fused_lm_head=True`` (trl's ``SFTTrainer``) computes trl's own token mean and never calls
      the packed loss: refused, :class:`PackedSFTTrainer` is the fix.
    - A packed batch (see :func:`_exact_packed_call`) runs without a KV cache and without an
      all-ones ``attention_mask``, either of which would make its sequences attend to each other.
    - A call with boundaries (``position_ids``, ``cu_seqlens``, ``cu_seq_lens_q``) gets its
      :class:`~packed_ce.layout.PackedLayout` under :data:`~packed_ce.columns.LAYOUT`, built once
      here; the loss's tensors (:data:`LOSS_TENSORS`) travel in it.

    Returns:
        the keywords to call the model's forward with (a new dict where any changed).
    """
    for key in (*MODEL_TENSORS, *LOSS_TENSORS):
        batch_tensor(kwargs, key)
    if kwargs.get("fused_lm_head"):
        raise ValueError(
            "this model has the packed loss (apply_packed_loss), but trl's fused_lm_head=True "
            "computes trl's own token mean and never calls it: train with "
            "packed_ce.integrations.PackedSFTTrainer instead of trl.SFTTrainer"
        )
    kwargs = _exact_packed_call(args, kwargs)
    tokens = call_tokens(args, kwargs)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
        return kwargs
    layout = PackedLayout.of_call(kwargs, tuple(tokens.shape[:2]))
    if layout is None:
        return kwargs
    kwargs = {key: value for key, value in kwargs.items() if key not in LOSS_TENSORS}
    kwargs[LAYOUT] = layout
    return kwargs


def _exact_packed_call(args: tuple, kwargs: dict) -> dict:
    """The keywords of a packed call, changed so that no sequence attends to another.

    Packed: a boundary (``cu_seqlens``, ``cu_seq_lens_q``, a ``position_ids`` restart with
    ``labels``) inside a row. transformers masks such a row block-diagonally only without an
    ``attention_mask`` and a KV cache (else a loss error of ~2e-3 on Llama and Qwen2), so the
    cache is turned off, an all-ones mask dropped, and a masking ``attention_mask`` or
    ``past_key_values`` refused (reading the boundaries then costs one host sync).
    """
    boundaries, positions = packed_boundaries(kwargs)
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


def packed_boundaries(kwargs: dict) -> tuple[Any, Any]:
    """A call's sequence boundaries: ``cu_seqlens`` (else ``cu_seq_lens_q``) and, with ``labels``,
    ``position_ids``; None where absent.
    """
    boundaries = kwargs.get(CU_SEQLENS)
    if boundaries is None:
        boundaries = kwargs.get(CU_SEQ_LENS_Q)
    return boundaries, kwargs.get(POSITION_IDS) if kwargs.get(LABELS) is not None else None


def _restarts_inside_rows(args, kwargs, boundaries, positions) -> bool:
    """True if a sequence of the batch starts anywhere but at the start of a row (False for
    ``cu_seqlens`` that are not a tensor: the loss refuses them by name).
    """
    if boundaries is not None:
        if not isinstance(boundaries, torch.Tensor):
            return False
        tokens = call_tokens(args, kwargs)
        width = tokens.shape[1] if tokens is not None and tokens.dim() >= 2 else None
        if width is None:
            return True
        return bool((boundaries.to(torch.int64) % width != 0).any())
    positions = positions.reshape(-1, positions.shape[-1])
    return bool((positions[:, 1:] != positions[:, :-1] + 1).any())


def refuse_shard(model, kwargs: dict) -> None:
    """A context-parallel shard given to a model without context parallelism: refused."""
    record = kwargs.get(SHARD)
    if record is not None:
        raise ValueError(
            f"this batch is one rank's shard (collators.shard_batch, rank {record.rank} of "
            f"{record.world_size}), but context parallelism is not enabled on this "
            f"{type(model).__name__}: call enable_context_parallel(model) on every rank, or "
            "pass the whole batch"
        )
