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

from .families import ZERO_EMBEDDING_FAMILIES

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


def refuse_zero_embedding_tokens(model, kwargs: dict, context_parallel=None) -> None:
    """Refuses, where gradients are taken, ``input_ids`` holding the embedding's ``padding_idx`` in
    a family of :data:`ZERO_EMBEDDING_FAMILIES` whose embedding of it is 0: the loss is finite,
    but most gradients would be NaN (a tiny Gemma 3n: 50 of its 59 parameters, on a padding
    segment of ``PackedCollator``'s default ``pad_token_id=0``). Costs one host sync on such
    families only.

    Args:
        context_parallel: the model's context-parallel state (its ``group`` and ``world_size``),
            or None: whether any rank's shard holds the token is all-reduced over its group, so
            that every rank raises (the padding lies in one rank's shard; that rank alone
            raising would leave the others waiting in a collective).
    """
    family = model.config.get_text_config().model_type
    tokens = kwargs.get(INPUT_IDS)
    if family not in ZERO_EMBEDDING_FAMILIES or not torch.is_grad_enabled():
        return
    embedding = model.get_input_embeddings()
    pad = getattr(embedding, "padding_idx", None)
    if pad is None or not isinstance(tokens, torch.Tensor):
        return
    weight = embedding.weight
    found = (tokens == pad).any()
    # a tensor subclass (FSDP2's sharded DTensor) is taken as 0: reading its row would be a
    # collective that only the ranks holding the token join
    if type(weight) is torch.nn.Parameter:
        found &= ~weight[pad].detach().to(found.device).any()
    if context_parallel is not None and context_parallel.world_size > 1:
        found = found.to(torch.int64)
        group = context_parallel.group
        torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX, group=group)
    if not bool(found):
        return
    other = (pad + 1) % weight.shape[0]
    raise ValueError(
        f"model_type={family!r}: input_ids hold token {pad}, its embedding's padding_idx, whose "
        f"embedding is 0, and {ZERO_EMBEDDING_FAMILIES[family]}, so its gradients would be NaN "
        "(the loss stays finite): pad with another token, e.g. collators.PackedCollator("
        f"pad_to_multiple_of=..., pad_token_id={other}) (its padding segment's token, 0 by default)"
    )


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
