"""Context parallelism: one rank's share of a packed batch, with the weights its targets need.

Rank ``r`` of ``W`` takes chunks ``r`` and ``2 W - 1 - r`` of ``2 W`` ("zig-zag": one cheap and one costly chunk
under causal attention). ``seq_targets`` carries each conversation's target count, so the ranks' weighted sums
add up to the whole batch's loss; labels are shifted before the cut, so no chunk loses its last target.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from .checks import positive_int, targets_per_sequence
from .columns import CU_SEQLENS, IGNORE_INDEX, INPUT_IDS, LABELS, POSITION_IDS, SEQUENCE_COLUMNS, SHIFT_LABELS


def shard_batch(batch: Mapping, rank: int, world_size: int, *, ignore_index: int = IGNORE_INDEX) -> dict:
    """The tokens of a packed batch that context-parallel rank ``rank`` of ``world_size`` holds.

    Chunks of ``C = T / (2 * world_size)`` tokens (collate with ``PackedCollator(pad_to_multiple_of=2 * world_size)``).
    With ``shift=False``, ``cu_seqlens`` and ``seq_targets``, the ``"sum"`` losses of the ranks add up to the whole
    batch's; divide by its weight mass for the mean. Attention needs the whole row, from the global
    ``position_ids`` returned here.

    Args:
        batch (``dict``): of ``PackedCollator``: ``input_ids``, ``labels`` ``(1, T)``, ``cu_seqlens`` ``(S + 1,)``, optionally
            ``position_ids``, ``seq_targets``, ``seq_weights``.
        rank (``int``): this rank, in ``[0, world_size)``.
        world_size (``int``): ranks sharing the row.
        ignore_index (``int``, *optional*, defaults to -100): the label of untrained tokens.

    Returns:
        ``dict`` on the batch's device:

        - ``input_ids`` ``(1, 2C)``, ``position_ids`` ``(1, 2C)`` int64: the local tokens and their global positions.
        - ``labels`` ``(1, 2C)``: the local labels (a model computes a loss only with them, from ``shift_labels``).
        - ``shift_labels`` ``(1, 2C)`` int64: each local token's target.
        - ``cu_seqlens`` ``(S_local + 1,)`` int32: local segments, cut at each chunk start and sequence start.
        - ``seq_targets`` ``(S_local,)`` int32: each segment's conversation target count (>= 1).
        - every other key of ``collators.columns.SEQUENCE_COLUMNS`` in ``batch`` (``seq_weights`` ``(S_local,)``
          float64, ``seq_sources`` a list): each segment's value, its sequence's.

    Example:

    >>> import torch
    >>> from collators import PackedCollator, shard_batch
    >>> batch = PackedCollator()([{"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]},
    ...                           {"input_ids": [6, 7, 8], "labels": [-100, 7, 8]}])
    >>> shard = shard_batch(batch, rank=0, world_size=2)  # chunks 0 and 3 of [1 2][3 4][5 6][7 8]
    >>> shard["input_ids"], shard["shift_labels"]
    (tensor([[1, 2, 7, 8]]), tensor([[   2,    3,    8, -100]]))
    >>> shard["cu_seqlens"], shard["seq_targets"]
    (tensor([0, 2, 4], dtype=torch.int32), tensor([4, 2], dtype=torch.int32))
    """
    world_size = positive_int(world_size, "world_size")
    rank = positive_int(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"`rank` must be in [0, world_size={world_size}), got {rank}.")
    if not isinstance(batch, Mapping):
        raise TypeError(f"`batch` must be a dict of tensors (a PackedCollator batch), got {type(batch).__name__}.")
    missing = {INPUT_IDS, LABELS, CU_SEQLENS} - set(batch)
    if missing:
        raise ValueError(f"`batch` lacks {sorted(missing)}: shard a batch of PackedCollator.")
    input_ids, labels = batch[INPUT_IDS], batch[LABELS]
    for name, tensor in ((INPUT_IDS, input_ids), (LABELS, labels)):
        if not torch.is_tensor(tensor) or tensor.dim() != 2 or tensor.shape[0] != 1 or tensor.dtype.is_floating_point:
            raise ValueError(f"`batch['{name}']` must be an integer tensor of shape (1, T), got {_describe(tensor)}.")
    num_tokens = input_ids.shape[1]
    if labels.shape != input_ids.shape:
        raise ValueError(f"`batch['labels']` has shape {tuple(labels.shape)}, `input_ids` {tuple(input_ids.shape)}.")
    cu_seqlens = batch[CU_SEQLENS]
    if not torch.is_tensor(cu_seqlens) or cu_seqlens.dim() != 1 or cu_seqlens.dtype.is_floating_point:
        raise ValueError(f"`batch['cu_seqlens']` must be a 1-D integer tensor, got {_describe(cu_seqlens)}.")
    cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
    if (
        cu_seqlens.numel() < 2
        or cu_seqlens[0] != 0
        or cu_seqlens[-1] != num_tokens
        or (cu_seqlens.diff() < 0).any()
    ):
        raise ValueError(
            f"`batch['cu_seqlens']` must rise from 0 to T={num_tokens} without decreasing, got {cu_seqlens.tolist()}."
        )
    num_sequences = cu_seqlens.numel() - 1
    lengths = cu_seqlens.diff()
    num_chunks = 2 * world_size
    if num_tokens % num_chunks:
        raise ValueError(
            f"`batch` has T={num_tokens} tokens, not a multiple of 2 * world_size = {num_chunks}: collate with "
            f"PackedCollator(pad_to_multiple_of={num_chunks})."
        )

    position_ids = batch.get(POSITION_IDS)
    if position_ids is None:
        starts = torch.repeat_interleave(cu_seqlens[:-1], lengths)
        position_ids = (torch.arange(num_tokens, device=input_ids.device) - starts)[None]
    elif not torch.is_tensor(position_ids) or position_ids.shape != input_ids.shape:
        raise ValueError(f"`batch['position_ids']` must be a tensor of shape (1, T), got {_describe(position_ids)}.")
    per_sequence = {}
    for column in SEQUENCE_COLUMNS:
        values = batch.get(column.key)
        if values is None and column.absent == "count":
            # Each sequence's own targets, 1 for a sequence without any (as PackedCollator counts them).
            own = targets_per_sequence(labels[0].cpu().numpy(), lengths.cpu().numpy(), ignore_index)
            values = torch.from_numpy(np.maximum(own, 1))
        if values is None:
            continue
        if column.dtype is not None and (not torch.is_tensor(values) or values.shape != (num_sequences,)):
            raise ValueError(
                f"`batch['{column.key}']` must be a tensor of shape (S,) = ({num_sequences},), got {_describe(values)}."
            )
        if column.dtype is None and len(values) != num_sequences:
            raise ValueError(
                f"`batch['{column.key}']` must list S = {num_sequences} {column.what}s, got {len(values)}."
            )
        column.values(values, f"batch['{column.key}']")
        if column.absent == "count" and (values < 1).any():
            raise ValueError(
                f"`batch['{column.key}']` must be >= 1 (PackedCollator gives 1 to a sequence without targets)."
            )
        per_sequence[column] = values

    # The target of token t is label t + 1 of its own sequence: none at each sequence's last token.
    shift_labels = torch.full_like(labels[0], ignore_index)
    shift_labels[:-1] = labels[0, 1:]
    shift_labels[cu_seqlens[1:][lengths > 0] - 1] = ignore_index

    size = num_tokens // num_chunks
    chunk_starts = torch.tensor([rank * size, (num_chunks - 1 - rank) * size], device=input_ids.device)
    local = (chunk_starts[:, None] + torch.arange(size, device=input_ids.device)).reshape(-1)
    # Local segments: each chunk's first token, plus every sequence start strictly inside a chunk.
    segment_starts = []
    for index, start in enumerate(chunk_starts.tolist()):
        inside = cu_seqlens[(cu_seqlens > start) & (cu_seqlens < start + size)].unique_consecutive()
        starts = torch.cat((torch.tensor([start], device=input_ids.device), inside))
        segment_starts.append(starts - start + index * size)  # global token -> local index
    local_starts = torch.cat(segment_starts)
    # The sequence of a segment is the last one starting at or before its first token (empty ones skipped).
    sequence_of = torch.searchsorted(cu_seqlens, local[local_starts], right=True) - 1
    shard = {
        INPUT_IDS: input_ids[:, local],
        LABELS: labels[:, local],
        POSITION_IDS: position_ids[:, local],
        SHIFT_LABELS: shift_labels[local][None],
        CU_SEQLENS: torch.cat((local_starts, torch.tensor([2 * size], device=input_ids.device))).to(torch.int32),
    }
    for column, values in per_sequence.items():
        if column.dtype is None:
            shard[column.key] = [values[index] for index in sequence_of.tolist()]
        else:
            dtype = getattr(torch, column.dtype)
            shard[column.key] = values.to(input_ids.device)[sequence_of].to(dtype)
    return shard


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"
