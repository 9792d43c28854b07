"""A packed call's conversations, built once per model call from the batch and read by every part.

A packed row's boundaries reach the model in one of the forms users bring (``position_ids`` that
restart, ``cu_seqlens`` / ``cu_seq_lens_q`` over the flattened tokens, with ``seq_targets`` and
``seq_weights`` for the loss). :class:`PackedLayout` reads them once, on the device, and gives each
part of a step the form it reads: attention (``position_ids``, the varlen keywords), token mixers
(``seq_idx``, ``cu_seqlens``, each row's spans), rotary embeddings (each token's conversation),
the loss (:class:`~packed_ce.options.Boundaries`). It is immutable and lives as long as
its call: nothing derived from one step is kept anywhere for the next (a loop that refills its
input tensors in place gets a new layout each call).

Dimensions: B rows of T tokens, N = B*T; C conversations of the model, S sequences of the loss (a
context-parallel shard's loss splits conversations, so S and C may differ).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .columns import (
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    CU_SEQLENS,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    POSITION_IDS,
    SEQ_TARGETS,
    position_restarts,
)
from .options import SEQUENCE_FIELDS, Boundaries

SEQ_IDX = "seq_idx"  # (B, T) int32: the conversation of each token (transformers' keyword)


def loss_boundaries(
    labels: torch.Tensor, batch: Mapping[str, Any], *, is_packed: bool = True
) -> Boundaries:
    """The loss's sequence boundaries of ``labels`` as a batch (or a model call) carries them.

    Args:
        labels: ``(B, T)`` or ``(N,)`` integer labels, whose device the boundaries move to.
        batch: a collated batch or a model call's keywords.
        is_packed: whether ``seq_targets`` matter.

    Returns:
        ``cu_seqlens`` (with the per-sequence tensors, ``options.SEQUENCE_FIELDS``: ``seq_targets``
        and ``seq_weights``), else ``cu_seq_lens_q`` as
        ``cu_seqlens``, else ``position_ids``, else one sequence per row. Non-tensors are passed
        on, for the loss to refuse by name.
    """

    def on_device(value):  # anything but a tensor is refused by name where the loss checks it
        return value.to(labels.device) if isinstance(value, torch.Tensor) else value

    if batch.get(CU_SEQLENS) is not None:
        keys = [key for key in SEQUENCE_FIELDS if is_packed or key != SEQ_TARGETS]
        found = {key: on_device(batch[key]) for key in keys if batch.get(key) is not None}
        return Boundaries(cu_seqlens=on_device(batch[CU_SEQLENS]), **found)
    if batch.get(CU_SEQ_LENS_Q) is not None:
        return Boundaries(cu_seqlens=on_device(batch[CU_SEQ_LENS_Q]))
    if batch.get(POSITION_IDS) is not None:
        return Boundaries(position_ids=on_device(batch[POSITION_IDS]))
    rows = labels.shape[0] if labels.dim() == 2 else 1
    row_length = labels.shape[-1] if labels.dim() else 0
    return Boundaries(cu_seqlens=torch.arange(rows + 1, device=labels.device) * row_length)


@dataclass(frozen=True, eq=False)
class PackedLayout:
    """The conversations of one packed model call; every other form is derived from these fields
    when first read (each at most one copy to the host, for the whole call).

    Attributes:
        position_ids: ``(B, T)`` int64 on the call's device, each token's position in its
            conversation: the call's own tensor where it carried one (attention reads them).
        cu_seqlens: ``(C + 1,)`` int32, the model's conversations over the ``N`` flattened tokens;
            every row's first token starts one.
        loss: the loss's boundaries as the call carries them (:func:`loss_boundaries`).
    """

    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    loss: Boundaries

    @classmethod
    def of_call(cls, kwargs: Mapping[str, Any], shape: tuple[int, int]) -> PackedLayout | None:
        """The layout of a model call of ``(B, T)`` tokens, or None for a call without
        boundaries.

        The model's conversations come from ``position_ids`` (transformers' restart rule: what
        its attention follows; one host sync), else from ``cu_seqlens`` or ``cu_seq_lens_q`` over
        the flattened tokens (no sync for one row). Tensors of any other type or shape are left
        to the loss and the model, which refuse them by name.
        """
        rows, width = shape
        positions = kwargs.get(POSITION_IDS)
        if (
            isinstance(positions, torch.Tensor)
            and positions.dim() == 2
            and positions.shape[-1] == width
            and positions.shape[0] in (1, rows)
        ):
            positions = positions.expand(rows, width)
            starts = position_restarts(positions)
            cu_seqlens = _cumulative(starts.nonzero().flatten(), rows * width)
        else:
            cumulative = kwargs.get(CU_SEQLENS)
            if cumulative is None:
                cumulative = kwargs.get(CU_SEQ_LENS_Q)
            if not isinstance(cumulative, torch.Tensor) or cumulative.dim() != 1:
                return None
            cu_seqlens = cumulative.to(torch.int32)
            if rows > 1:  # every row starts a conversation: (B*T,) starts, back to offsets
                starts = torch.zeros(rows * width + 1, dtype=torch.bool, device=cumulative.device)
                starts[cu_seqlens.to(torch.int64).clamp(0, rows * width)] = True
                starts[torch.arange(0, rows * width, width, device=cumulative.device)] = True
                cu_seqlens = _cumulative(starts[:-1].nonzero().flatten(), rows * width)
            positions = _positions(cu_seqlens, rows, width)
        labels = kwargs.get("labels")
        reference = labels if isinstance(labels, torch.Tensor) else positions
        return cls(positions, cu_seqlens, loss_boundaries(reference, kwargs))

    @property
    def shape(self) -> tuple[int, int]:
        """``(B, T)``."""
        return tuple(self.position_ids.shape)

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    @property
    def num_conversations(self) -> int:
        """``C``, from the shape of ``cu_seqlens`` (no sync)."""
        return self.cu_seqlens.numel() - 1

    @property
    def packed(self) -> bool:
        """Whether some row holds more than one conversation (no sync)."""
        return self.num_conversations > self.shape[0]

    @functools.cached_property
    def host_cu_seqlens(self) -> list[int]:
        """``cu_seqlens`` on the host: the call's one copy of its boundaries."""
        return self.cu_seqlens.tolist()

    @functools.cached_property
    def host_cu_seqlens_tensor(self) -> torch.Tensor:
        """``(C + 1,)`` int64 on the CPU: what fla's varlen kernels take as ``cu_seqlens_cpu``,
        to lay out their chunks without reading the device's copy again.
        """
        return torch.tensor(self.host_cu_seqlens, dtype=torch.int64)

    @functools.cached_property
    def max_seqlen(self) -> int:
        """The longest conversation's length."""
        cuts = self.host_cu_seqlens
        return max((end - start for start, end in zip(cuts[:-1], cuts[1:])), default=0)

    @functools.cached_property
    def spans(self) -> list[list[tuple[int, int]]]:
        """Each row's conversations as ``(start, end)`` columns (empty ones left out)."""
        width = self.shape[1]
        found: list[list[tuple[int, int]]] = [[] for _ in range(self.shape[0])]
        cuts = self.host_cu_seqlens
        for start, end in zip(cuts[:-1], cuts[1:]):
            if end > start:
                row = start // width
                found[row].append((start - row * width, end - row * width))
        return found

    @functools.cached_property
    def token_conversation(self) -> torch.Tensor:
        """``(B, T)`` int64: the conversation (of ``C``) of each token, non-decreasing."""
        tokens = torch.arange(self.position_ids.numel(), device=self.cu_seqlens.device)
        # right=True: an empty conversation [c, c) owns no token, the next one starts at c
        found = torch.searchsorted(self.cu_seqlens.to(torch.int64), tokens, right=True) - 1
        return found.view(self.shape)

    @functools.cached_property
    def seq_idx(self) -> torch.Tensor:
        """``(B, T)`` int32: each token's conversation, counted from 0 in every row (the
        ``seq_idx`` of transformers' and mamba's kernels).
        """
        found = self.token_conversation
        return (found - found[:, :1]).to(torch.int32)

    def flat_keywords(self) -> dict[str, Any]:
        """The keywords of transformers' varlen kernels for the ``(1, N)`` flattened row:
        ``seq_idx`` ``(1, N)`` (conversations counted over the whole call),
        ``cu_seq_lens_q/k`` (``cu_seqlens``) and ``max_length_q/k``.
        """
        return {
            SEQ_IDX: self.token_conversation.view(1, -1).to(torch.int32),
            CU_SEQ_LENS_Q: self.cu_seqlens,
            CU_SEQ_LENS_K: self.cu_seqlens,
            MAX_LENGTH_Q: self.max_seqlen,
            MAX_LENGTH_K: self.max_seqlen,
        }

    def row_keywords(self) -> dict[str, Any]:
        """The keywords transformers' kernels read on this call's ``(B, T)`` rows: ``seq_idx``,
        and for one row the varlen keywords too (:meth:`flat_keywords`).
        """
        if self.shape[0] == 1:
            return self.flat_keywords()
        return {SEQ_IDX: self.seq_idx}


def _cumulative(starts: torch.Tensor, tokens: int) -> torch.Tensor:
    """``(C + 1,)`` int32 offsets from the ``(C,)`` flat start of every conversation."""
    end = torch.full((1,), tokens, dtype=starts.dtype, device=starts.device)
    return torch.cat((starts, end)).to(torch.int32)


def _positions(cu_seqlens: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``(B, T)`` int64 position of each token in its conversation of ``cu_seqlens``."""
    tokens = torch.arange(rows * width, device=cu_seqlens.device)
    offsets = cu_seqlens.to(torch.int64)
    conversation = torch.searchsorted(offsets, tokens, right=True) - 1
    return (tokens - offsets[conversation.clamp(0, offsets.numel() - 2)]).view(rows, width)
