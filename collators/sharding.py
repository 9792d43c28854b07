"""Context parallelism: one rank's share of a packed batch, with the weights its targets need.

The row is cut into ``W * m`` chunks of ``C`` tokens (``m`` per rank: 2, or more for long rows,
chunks of about ``CHUNK_TOKENS``) and each rank gets ``m`` of them, chosen so that the ranks'
attention work is balanced: a token attends to every earlier token of its own conversation, so a
chunk's work is the sum of its tokens' positions + 1, and the chunks are dealt out largest first,
each to the rank with the least work so far (for one conversation over the whole row and ``m = 2``
this is the "zig-zag" of chunks ``r`` and ``2 W - 1 - r``). ``seq_targets`` carries each
conversation's target count, so the ranks' weighted sums add up to the whole batch's loss; labels
are shifted before the cut, so no chunk loses its last target.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping

import numpy as np
import torch
import torch.nn.functional as F

from packed_ce.columns import (
    ATTENTION_MASK,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    IGNORE_INDEX,
    INPUT_IDS,
    LABELS,
    POSITION_IDS,
    SEQUENCE_COLUMNS,
    SHARD,
    SHIFT_LABELS,
    position_restarts,
)

from .checks import positive_int, targets_per_sequence

# Long rows are cut into chunks of at least this many tokens (a multiple of flex attention's
# 128-token blocks): finer chunks balance the ranks' attention work over conversations of mixed
# lengths.
CHUNK_TOKENS = 1024


@dataclasses.dataclass(frozen=True)
class ShardRecord:
    """What a shard is, so that a context-parallel forward can refuse one it cannot use exactly.

    Attributes:
        rank, world_size: the rank it was cut for, of how many.
        row_length: ``T``, the whole row's tokens.
        row_checksum: a hash of the whole row's tokens and boundaries: the ranks of a group must
            shard the same row (a data-parallel loader giving each rank its own batch would not).
        chunks: ``W`` tuples of ``m`` ascending chunk indices, the chunks each rank holds.
    """

    rank: int
    world_size: int
    row_length: int
    row_checksum: int
    chunks: tuple[tuple[int, ...], ...]


def _chunks_per_rank(per_rank: int) -> int:
    """``m``: the most chunks of >= ``CHUNK_TOKENS`` tokens dividing a rank's even share, >= 2."""
    for count in range(per_rank // CHUNK_TOKENS, 2, -1):
        if per_rank % count == 0:
            return count
    return 2


def balanced_chunks(lengths: np.ndarray, num_tokens: int, world_size: int) -> np.ndarray:
    """Which chunks each rank holds: the ranks' causal attention work balanced (module docstring).

    Args:
        lengths: ``(S,)`` int64 sequence lengths, summing to ``num_tokens``, a multiple of
            ``2 * world_size``.

    Returns:
        ``(world_size, m)`` int64, each row the ascending chunk indices of one rank.

    Example:
        >>> balanced_chunks(np.array([8]), 8, 2)  # one conversation: the zig-zag
        array([[0, 3],
               [1, 2]])
        >>> balanced_chunks(np.array([4, 4]), 8, 2)  # two alike: one each
        array([[0, 1],
               [2, 3]])
    """
    per_rank = num_tokens // world_size
    count = _chunks_per_rank(per_rank)
    size = per_rank // count
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    work = (np.arange(num_tokens) - starts + 1).reshape(world_size * count, size).sum(1)
    load, held = np.zeros(world_size), np.zeros(world_size, dtype=np.int64)
    owner = np.empty(len(work), dtype=np.int64)
    for chunk in np.argsort(-work, kind="stable"):  # largest first, ties in row order
        rank = min((r for r in range(world_size) if held[r] < count), key=lambda r: (load[r], r))
        owner[chunk] = rank
        load[rank] += work[chunk]
        held[rank] += 1
    return np.stack([np.flatnonzero(owner == rank) for rank in range(world_size)])


def _row_checksum(input_ids: torch.Tensor, bounds: np.ndarray) -> int:
    """63 bits of a hash of the row's tokens and boundaries (one copy of the row to the host)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(input_ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    digest.update(bounds.astype(np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1


def shard_batch(
    batch: Mapping, rank: int, world_size: int, *, ignore_index: int = IGNORE_INDEX
) -> dict:
    """The tokens of a packed batch that context-parallel rank ``rank`` of ``world_size`` holds.

    ``L = T / world_size`` tokens in ``m`` chunks, balanced (module docstring; collate with
    ``PackedCollator(pad_to_multiple_of=2 * world_size)``). With ``shift=False``, ``cu_seqlens`` and
    ``seq_targets``, the ``"sum"`` losses of the ranks add up to the whole batch's; divide by its
    weight mass for the mean. Attention needs the whole row, from the global ``position_ids``
    returned here.

    Args:
        batch: a ``PackedCollator`` batch: ``input_ids``, ``labels`` ``(1, T)``, ``cu_seqlens``
            ``(S + 1,)``, optionally ``position_ids``, ``seq_targets``, ``seq_weights``.
        rank: this rank, in ``[0, world_size)``.
        world_size: ranks sharing the row.
        ignore_index: the label of untrained tokens (default: -100).

    Returns:
        ``dict`` on the batch's device:

        - ``input_ids`` ``(1, L)``, ``position_ids`` ``(1, L)`` int64: the local tokens and their
          global positions.
        - ``labels`` ``(1, L)``: the local labels (a model computes a loss only with them, from
          ``shift_labels``).
        - ``shift_labels`` ``(1, L)`` int64: each local token's target.
        - ``cu_seqlens`` ``(S_local + 1,)`` int32: local segments, cut at each chunk start and
          sequence start.
        - ``seq_targets`` ``(S_local,)`` int32: each segment's conversation target count (>= 1).
        - every other key of ``packed_ce.columns.SEQUENCE_COLUMNS`` in ``batch`` (``seq_weights``
          ``(S_local,)`` float64, ``seq_sources`` a list): each segment's value, its sequence's.
        - ``context_parallel_shard`` (``ShardRecord``): the rank, world size, row and chunks it was
          cut for, which the model's forward checks and lays out (``enable_context_parallel``).

    Example:
        >>> import torch
        >>> from collators import PackedCollator, shard_batch
        >>> batch = PackedCollator()([{"input_ids": [1, 2, 3, 4, 5], "labels": [1, 2, 3, 4, 5]},
        ...                           {"input_ids": [6, 7, 8], "labels": [-100, 7, 8]}])
        >>> shard = shard_batch(batch, rank=1, world_size=2)  # chunks 2, 3 of [1 2][3 4][5 6][7 8]
        >>> shard["input_ids"], shard["shift_labels"]
        (tensor([[5, 6, 7, 8]]), tensor([[-100,    7,    8, -100]]))
        >>> shard["cu_seqlens"], shard["seq_targets"]
        (tensor([0, 1, 2, 4], dtype=torch.int32), tensor([4, 2, 2], dtype=torch.int32))
        >>> shard["context_parallel_shard"].chunks  # attention work 3 + 7 against 6 + 5
        ((0, 1), (2, 3))
    """
    world_size = positive_int(world_size, "world_size")
    rank = positive_int(rank, "rank", minimum=0)
    if rank >= world_size:
        raise ValueError(f"`rank` must be in [0, world_size={world_size}), got {rank}.")
    if not isinstance(batch, Mapping):
        raise TypeError(
            "`batch` must be a dict of tensors (a PackedCollator batch), got "
            f"{type(batch).__name__}."
        )
    missing = {INPUT_IDS, LABELS, CU_SEQLENS} - set(batch)
    if missing:
        raise ValueError(f"`batch` lacks {sorted(missing)}: shard a batch of PackedCollator.")
    input_ids, labels = batch[INPUT_IDS], batch[LABELS]
    for name, tensor in ((INPUT_IDS, input_ids), (LABELS, labels)):
        if (
            not torch.is_tensor(tensor)
            or tensor.dim() != 2
            or tensor.shape[0] != 1
            or tensor.dtype.is_floating_point
        ):
            raise ValueError(
                f"`batch['{name}']` must be an integer tensor of shape (1, T), got "
                f"{_describe(tensor)}."
            )
    num_tokens = input_ids.shape[1]
    if labels.shape != input_ids.shape:
        raise ValueError(
            f"`batch['labels']` has shape {tuple(labels.shape)}, `input_ids` "
            f"{tuple(input_ids.shape)}."
        )
    cu_seqlens = batch[CU_SEQLENS]
    if (
        not torch.is_tensor(cu_seqlens)
        or cu_seqlens.dim() != 1
        or cu_seqlens.dtype.is_floating_point
    ):
        raise ValueError(
            f"`batch['cu_seqlens']` must be a 1-D integer tensor, got {_describe(cu_seqlens)}."
        )
    # Every index is computed on the host from one copy of the boundaries: one wait for a device's
    # queued work, not one per check; the device only gathers.
    bounds = cu_seqlens.detach().to("cpu", torch.int64).numpy()
    if bounds.size < 2 or bounds[0] != 0 or bounds[-1] != num_tokens or (np.diff(bounds) < 0).any():
        raise ValueError(
            f"`batch['cu_seqlens']` must rise from 0 to T={num_tokens} without decreasing, got "
            f"{bounds.tolist()}."
        )
    num_sequences = bounds.size - 1
    lengths = np.diff(bounds)
    num_chunks = 2 * world_size
    if num_tokens % num_chunks:
        raise ValueError(
            f"`batch` has T={num_tokens} tokens, not a multiple of 2 * world_size = {num_chunks}: "
            f"collate with PackedCollator(pad_to_multiple_of={num_chunks})."
        )
    device = input_ids.device
    position_ids = batch.get(POSITION_IDS)
    if position_ids is None:
        position_ids = torch.from_numpy(np.arange(num_tokens) - np.repeat(bounds[:-1], lengths))[
            None
        ].to(device)
    elif not torch.is_tensor(position_ids) or position_ids.shape != input_ids.shape:
        raise ValueError(
            "`batch['position_ids']` must be a tensor of shape (1, T), got "
            f"{_describe(position_ids)}."
        )
    per_sequence = {}  # column -> its checked values on the host
    for column in SEQUENCE_COLUMNS:
        values = batch.get(column.key)
        if values is None and column.absent == "count":
            # Each sequence's own targets, 1 for a sequence without any (as PackedCollator counts
            # them).
            values = np.maximum(
                targets_per_sequence(labels[0].cpu().numpy(), lengths, ignore_index), 1
            )
        elif values is None:
            continue
        elif column.dtype is not None and (
            not torch.is_tensor(values) or values.shape != (num_sequences,)
        ):
            raise ValueError(
                f"`batch['{column.key}']` must be a tensor of shape (S,) = ({num_sequences},), got "
                f"{_describe(values)}."
            )
        values = column.values(values, f"batch['{column.key}']")
        if len(values) != num_sequences:
            raise ValueError(
                f"`batch['{column.key}']` must list S = {num_sequences} {column.what}s, got "
                f"{len(values)}."
            )
        if column.absent == "count" and (values < 1).any():
            raise ValueError(
                f"`batch['{column.key}']` must be >= 1 (PackedCollator gives 1 to a sequence "
                "without targets)."
            )
        per_sequence[column] = values

    chunks = balanced_chunks(lengths, num_tokens, world_size)
    size = num_tokens // chunks.size
    local = (chunks[rank][:, None] * size + np.arange(size)).reshape(-1)
    # Local segments: each chunk's first token, plus every sequence start inside a chunk.
    row_starts = np.zeros(num_tokens + 1, dtype=bool)
    row_starts[bounds] = True
    local_starts = np.flatnonzero(row_starts[local] | (np.arange(local.size) % size == 0))
    # The sequence of a segment is the last one starting at or before its first token (empty ones
    # skipped).
    sequence_of = np.searchsorted(bounds, local[local_starts], side="right") - 1
    # The target of token t is label t + 1 of its own sequence: none at each sequence's last token.
    shift_labels = torch.full_like(labels[0], ignore_index)
    shift_labels[:-1] = labels[0, 1:]
    shift_labels[torch.from_numpy(bounds[1:][lengths > 0] - 1).to(device)] = ignore_index
    index = torch.from_numpy(local).to(device)
    shard = {
        INPUT_IDS: input_ids[:, index],
        LABELS: labels[:, index],
        POSITION_IDS: position_ids[:, index],
        SHIFT_LABELS: shift_labels[index][None],
        CU_SEQLENS: torch.from_numpy(np.append(local_starts, local.size).astype(np.int32)).to(
            device
        ),
        SHARD: ShardRecord(
            rank,
            world_size,
            num_tokens,
            _row_checksum(input_ids, bounds),
            tuple(map(tuple, chunks.tolist())),
        ),
    }
    for column, values in per_sequence.items():
        if column.dtype is None:
            shard[column.key] = [values[index] for index in sequence_of.tolist()]
        else:
            shard[column.key] = torch.from_numpy(
                np.asarray(values, dtype=column.dtype)[sequence_of]
            ).to(device)
    return shard


def shard_for_rank(
    batch: Mapping, rank: int, world_size: int, *, ignore_index: int = IGNORE_INDEX
) -> dict:
    """One context-parallel rank's share of a one-row batch of any packing collator (for trainers).

    The row's boundaries are read from ``cu_seqlens``, ``cu_seq_lens_q`` (trl's padding-free
    batches) or the restarts of ``position_ids``; it is padded to a multiple of ``2 * world_size``
    with a segment that has no target, weight 0 and no source, then cut by ``shard_batch``.
    Whole-row keys (``max_seqlen``, the varlen keywords) are left out.

    Args:
        batch: ``input_ids`` and ``labels`` ``(1, T)`` (labels aligned with ``input_ids``), the
            boundaries, optionally ``seq_targets``, ``seq_weights`` ``(S,)`` and ``seq_sources``
            (list of ``S``).
        rank, world_size: this rank within the context-parallel group, and its size.
        ignore_index: the label of untrained tokens (default: -100).

    Raises:
        ValueError: a batch of several rows (padded, not packed) or with an ``attention_mask``.
    """
    input_ids, labels = batch[INPUT_IDS], batch[LABELS]
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or batch.get(ATTENTION_MASK) is not None:
        raise ValueError(
            "context parallelism needs one packed row per batch (PackedCollator, or trl's "
            f"padding_free=True), got input_ids of shape {tuple(input_ids.shape)}"
            + (" and an attention_mask" if batch.get(ATTENTION_MASK) is not None else "")
        )
    length = input_ids.shape[1]
    cu_seqlens = batch.get(CU_SEQLENS)
    if cu_seqlens is None:
        cu_seqlens = batch.get(CU_SEQ_LENS_Q)
    if cu_seqlens is None:
        position_ids = batch.get(POSITION_IDS)
        starts = (
            position_restarts(position_ids)
            if position_ids is not None
            else torch.arange(length) == 0
        )
        cu_seqlens = F.pad(starts.nonzero().flatten(), (0, 1), value=length)
    cu_seqlens = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
    padding = -length % (2 * world_size)
    row = {INPUT_IDS: input_ids, LABELS: labels, CU_SEQLENS: cu_seqlens}
    row.update((c.key, batch[c.key]) for c in SEQUENCE_COLUMNS if batch.get(c.key) is not None)
    if padding:
        row[INPUT_IDS] = F.pad(input_ids, (0, padding), value=0)
        row[LABELS] = F.pad(labels, (0, padding), value=ignore_index)
        row[CU_SEQLENS] = torch.cat((cu_seqlens, cu_seqlens.new_tensor([length + padding])))
        row.update((c.key, c.padded(row[c.key])) for c in SEQUENCE_COLUMNS if c.key in row)
    return shard_batch(row, rank, world_size, ignore_index=ignore_index)


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"
