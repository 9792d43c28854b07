"""Who holds which tokens of a context-parallel row, and which keys each query may see.

Rank ``r`` of ``W`` holds ``m`` chunks of ``C`` tokens of the row, chosen by
:func:`collators.shard_batch` to balance the ranks' attention work (the shard records them). Query
``q`` sees key ``k`` iff both are in the same conversation (transformers' ``position_ids`` restart
rule, on the gathered row), ``k <= q``, and, on a sliding-window layer of window ``w``,
``q - k < w`` (transformers' ``sliding_window_overlay``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ...targets import sequence_ids
from .gather import gather_tokens

# Up to this many (query, key) pairs the dense boolean mask (16 MiB) is cheaper than building a
# block mask; flex attention's kernels for fewer than 128 queries (its decoding kernels) also
# fail to compile for some shapes (float32, grouped heads: "No choices to select").
DENSE_MASK_ELEMENTS = 2**24


@dataclass
class RowLayout:
    """What the attention of every layer needs about the row: built once per forward, handed to
    the layers as a keyword (so a recompute under gradient checkpointing uses its own forward's).

    The keys stay in the rank-major order of their all-gather (never permuted into row order): the
    mask reads each key's row index and conversation from tables in that order. A key block of
    128 lies within one chunk, so the block sparsity is the row order's.

    Attributes:
        group, rank, world_size: the ranks sharing the row.
        rows: ``(T,)`` int64 row index of each entry of the rank-major gather.
        documents: ``(T,)`` int64 conversation of each entry of the gather.
        queries: ``(L,)`` int64 row index of each local token (the rank's entries of ``rows``).
        query_documents: ``(L,)`` int64 conversation of each local token.
        order: ``(T,)`` int64 the gather entry of each row token (the inverse of ``rows``).
        masks: per sliding window (None: none), built on first use: a flex-attention block mask
            (CUDA, long rows) or the dense ``(L, T)`` bool mask.
        spans: the row's conversations as ``(start, end)`` row indices, read on first use
            (:meth:`conversations`).
        reached: the attention modules whose attention this layout computed (a family's own
            attention function would not: ``ContextParallel.finish``).
    """

    group: object
    rank: int
    world_size: int
    rows: torch.Tensor
    documents: torch.Tensor
    queries: torch.Tensor
    query_documents: torch.Tensor
    order: torch.Tensor
    masks: dict = field(default_factory=dict, repr=False)
    spans: list | None = field(default=None, repr=False)
    reached: set = field(default_factory=set, repr=False)

    @classmethod
    def gather(
        cls, group, rank: int, world_size: int, position_ids: torch.Tensor, chunks: tuple
    ) -> RowLayout:
        """Gathers the row's ``position_ids`` (``(1, L)`` of every rank, ``L = mC``) and derives
        each entry's row index and conversation. Every rank's ``L`` and ``chunks`` (``W`` tuples
        of ``m`` chunk indices, :class:`collators.sharding.ShardRecord`) are known to agree.
        """
        local = position_ids.shape[1]
        device = position_ids.device
        chunk_of = torch.tensor(chunks, device=device)  # (W, m)
        size = local // chunk_of.shape[1]
        gathered = position_ids.new_empty(world_size * local)  # rank-major
        dist.all_gather_into_tensor(gathered, position_ids[0].contiguous(), group=group)
        # entry (r, j, i) of the gather is row token chunks[r][j] * C + i
        rows = (chunk_of[:, :, None] * size + torch.arange(size, device=device)).reshape(-1)
        order = torch.empty_like(rows)
        order[rows] = torch.arange(rows.numel(), device=device)
        positions = gathered[order]  # (T,) in row order: the restart rule reads neighbours
        documents = sequence_ids(positions, None, positions)[0][rows]  # back to gather order
        mine = slice(rank * local, (rank + 1) * local)
        return cls(group, rank, world_size, rows, documents, rows[mine], documents[mine], order)

    def in_row_order(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` ``(L, ...)`` of every rank in row order, ``(T, ...)``; differentiable (the
        backward sums every rank's gradient into its owner's tokens).
        """
        return gather_tokens(local, self.group, self.rank, self.world_size)[self.order]

    def conversations(self) -> list[tuple[int, int]]:
        """The row's conversations as ``(start, end)`` row indices (one copy to the host, once)."""
        if self.spans is None:
            documents = self.documents[self.order]  # row order
            starts = torch.ones_like(documents, dtype=torch.bool)
            starts[1:] = documents[1:] != documents[:-1]
            cuts = starts.nonzero().flatten().tolist() + [documents.numel()]
            self.spans = list(zip(cuts[:-1], cuts[1:]))
        return self.spans

    def mask_mod(self, window: int | None):
        """The rule ``(b, h, q, k) -> bool`` on local query and gather key indices, elementwise on
        broadcast indices: flex attention's ``mask_mod`` and the dense mask alike.
        """
        rows, documents = self.rows, self.documents
        queries, query_documents = self.queries, self.query_documents

        def mask_mod(b, h, q_idx, kv_idx):
            query, key = queries[q_idx], rows[kv_idx]
            visible = (query_documents[q_idx] == documents[kv_idx]) & (key <= query)
            if window is not None:
                visible = visible & (query - key < window)
            return visible

        return mask_mod

    def mask(self, window: int | None, device: torch.device):
        """The mask of layers with sliding window ``window`` (None: full causal), built once."""
        if window not in self.masks:
            local, total = self.queries.numel(), self.rows.numel()
            mask_mod = self.mask_mod(window)
            if device.type == "cuda" and local * total > DENSE_MASK_ELEMENTS:
                from torch.nn.attention.flex_attention import create_block_mask

                # evaluated block by block: never the (L, T) dense mask
                self.masks[window] = create_block_mask(
                    mask_mod, None, None, local, total, device=device, _compile=True
                )
            else:  # each query sees itself: no row is empty
                self.masks[window] = mask_mod(
                    None,
                    None,
                    torch.arange(local, device=device)[:, None],
                    torch.arange(total, device=device)[None, :],
                )
        return self.masks[window]
