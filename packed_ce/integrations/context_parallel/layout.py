"""Who holds which tokens of a context-parallel row, and which keys each query may see.

Rank ``r`` of ``W`` holds ``m`` chunks of ``C`` tokens of the row, chosen by
:func:`collators.shard_batch` to balance the ranks' attention work (the shard records them). Query
``q`` sees key ``k`` iff both are in the same conversation (transformers' ``position_ids`` restart
rule, on the gathered row), ``k <= q``, and, on a sliding-window layer of window ``w``,
``q - k < w`` (transformers' ``sliding_window_overlay``).

The keys and values travel around the ranks (``ring.py``): at step ``i`` of ``W`` rank ``r``
holds those of rank ``(r - i) mod W``. What a step computes is planned here, once per row and
window: the blocks (a chunk of this rank's queries against a chunk of the step's keys, trimmed to
the rectangle that can see anything) that a conversation boundary, causality or the window does not
rule out; a whole step may have none.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ...targets import sequence_ids
from .gather import gather_tokens

# Up to this many (query, key) pairs per rank (``L * T``) the blocks run densely; beyond, on CUDA,
# each step runs flex attention with a block mask. Flex attention's kernels for fewer than 128
# queries (its decoding kernels) also fail to compile for some shapes (float32, grouped heads:
# "No choices to select").
DENSE_MASK_ELEMENTS = 2**24


class Block(NamedTuple):
    """This rank's queries ``[q0, q1)`` against the step's keys ``[k0, k1)`` (indices into the
    ``L`` local tokens of each); ``full``: every pair is visible (no mask needed).
    """

    q0: int
    q1: int
    k0: int
    k1: int
    full: bool


@dataclass
class RowLayout:
    """What the attention of every layer needs about the row: built once per forward, handed to
    the layers as a keyword (so a recompute under gradient checkpointing uses its own forward's).

    The tables are in the rank-major order of the ranks' tokens (rank ``s``'s ``L`` tokens at
    ``[s L, (s + 1) L)``), never permuted into row order: the masks read each key's row index and
    conversation from them.

    Attributes:
        group, rank, world_size: the ranks sharing the row.
        rows: ``(T,)`` int64 row index of each token, rank-major.
        documents: ``(T,)`` int64 conversation of each token, rank-major.
        queries: ``(L,)`` int64 row index of each local token (the rank's entries of ``rows``).
        query_documents: ``(L,)`` int64 conversation of each local token.
        order: ``(T,)`` int64 the rank-major entry of each row token (the inverse of ``rows``).
        chunks: ``W`` tuples of ``m`` ascending chunk indices, the chunks each rank holds
            (:class:`collators.sharding.ShardRecord`).
        masks: per (window, step), built on first use: a flex-attention block mask (CUDA, long
            rows).
        plans: what is planned on the host once per row: per window the blocks of each ring
            step (:meth:`ring_blocks`), the mixers' chunks (``state.py``).
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
    chunks: tuple = ()
    masks: dict = field(default_factory=dict, repr=False)
    plans: dict = field(default_factory=dict, repr=False)
    spans: list | None = field(default=None, repr=False)
    reached: set = field(default_factory=set, repr=False)
    mixer_stream: Callable | None = field(default=None, repr=False)

    @classmethod
    def gather(
        cls,
        group,
        rank: int,
        world_size: int,
        position_ids: torch.Tensor,
        chunks: tuple,
        mixer_stream: Callable | None = None,
    ) -> RowLayout:
        """Gathers the row's ``position_ids`` (``(1, L)`` of every rank, ``L = mC``) and derives
        each token's row index and conversation. Every rank's ``L`` and ``chunks`` (``W`` tuples
        of ``m`` chunk indices, :class:`collators.sharding.ShardRecord`) are known to agree.
        ``mixer_stream``: ``(module, bound, layout) -> output or None``, how a token mixer passes
        its state between the ranks (``state.streamed_mixer``; None: every mixer gathers).
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
        documents = sequence_ids(positions, None, positions)[0][rows]  # back to rank-major
        mine = slice(rank * local, (rank + 1) * local)
        return cls(
            group,
            rank,
            world_size,
            rows,
            documents,
            rows[mine],
            documents[mine],
            order,
            chunks,
            mixer_stream=mixer_stream,
        )

    @property
    def local(self) -> int:
        """``L``, the tokens each rank holds."""
        return self.queries.numel()

    def source(self, step: int) -> int:
        """The rank whose keys and values this rank holds at ring step ``step``."""
        return (self.rank - step) % self.world_size

    def in_row_order(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` ``(L, ...)`` of every rank in row order, ``(T, ...)``; differentiable (the
        backward sums every rank's gradient into its owner's tokens).
        """
        return gather_tokens(local, self.group, self.rank, self.world_size)[self.order]

    def row_documents(self) -> np.ndarray:
        """``(T,)`` the conversation of each row token, in row order, on the host (one copy per
        row, kept with the plans).
        """
        if "documents" not in self.plans:
            self.plans["documents"] = self.documents[self.order].cpu().numpy()
        return self.plans["documents"]

    def streamed_mixer(self, module, bound: dict):
        """Mixer ``module``'s output on this rank's tokens with its state passed between the
        ranks (``mixer_stream``: ``state.py``'s), or None where it gathers the row's inputs
        (``model/mixers.py``).
        """
        if self.mixer_stream is None:
            return None
        return self.mixer_stream(module, bound, self)

    def conversations(self) -> list[tuple[int, int]]:
        """The row's conversations as ``(start, end)`` row indices (one copy to the host, once)."""
        if self.spans is None:
            documents = self.documents[self.order]  # row order
            starts = torch.ones_like(documents, dtype=torch.bool)
            starts[1:] = documents[1:] != documents[:-1]
            cuts = starts.nonzero().flatten().tolist() + [documents.numel()]
            self.spans = list(zip(cuts[:-1], cuts[1:]))
        return self.spans

    def mask_mod(self, window: int | None, step: int):
        """The rule ``(b, h, q, k) -> bool`` on local query and key indices of ring step ``step``
        (keys of rank :meth:`source`), elementwise on broadcast indices: flex attention's
        ``mask_mod`` and the dense blocks' masks alike.
        """
        keys = slice(self.source(step) * self.local, (self.source(step) + 1) * self.local)
        rows, documents = self.rows[keys], self.documents[keys]
        queries, query_documents = self.queries, self.query_documents

        def mask_mod(b, h, q_idx, kv_idx):
            query, key = queries[q_idx], rows[kv_idx]
            visible = (query_documents[q_idx] == documents[kv_idx]) & (key <= query)
            if window is not None:
                visible = visible & (query - key < window)
            return visible

        return mask_mod

    def block_mask(self, window: int | None, step: int, device: torch.device):
        """Flex attention's block mask of ring step ``step`` (``L`` queries by ``L`` keys),
        evaluated block by block (never the dense ``(L, L)`` mask), built once per row.
        """
        if (window, step) not in self.masks:
            from torch.nn.attention.flex_attention import create_block_mask

            local = self.local
            self.masks[window, step] = create_block_mask(
                self.mask_mod(window, step), None, None, local, local, device=device, _compile=True
            )
        return self.masks[window, step]

    def ring_blocks(self, window: int | None) -> list[list[Block]]:
        """For each ring step, the blocks of this rank's queries and the step's keys that can see
        anything (module docstring); planned on the host once per row and window.

        A block is one query chunk against one key chunk (``C`` tokens each) trimmed: conversations
        never interleave, so the queries that can see a key of the chunk are those of the
        conversations from the chunk's first to its last key's, the keys those of the
        conversations from the first to the last query's, and the window bounds both sides.
        """
        if window in self.plans:
            return self.plans[window]
        documents = self.row_documents()
        chunks = np.asarray(self.chunks, dtype=np.int64)  # (W, m)
        size = documents.size // chunks.size  # C
        first, last = documents[::size], documents[size - 1 :: size]  # per chunk of the row
        mine = chunks[self.rank]
        plan = []
        for step in range(self.world_size):
            theirs = chunks[self.source(step)]
            query_chunk, key_chunk = mine[:, None], theirs[None, :]
            # keys before the queries, in a conversation of the query chunk, within the window
            # of its first query
            candidate = (key_chunk <= query_chunk) & (last[key_chunk] >= first[query_chunk])
            if window is not None:
                candidate &= (query_chunk - key_chunk - 1) * size + 1 < window
            blocks = []
            for j, k in zip(*np.nonzero(candidate)):
                block = _trimmed(documents, int(mine[j]), int(theirs[k]), size, window)
                if block is not None:
                    q0, q1, k0, k1, full = block
                    q, kk = j * size, k * size
                    blocks.append(Block(q + q0, q + q1, kk + k0, kk + k1, full))
            plan.append(blocks)
        self.plans[window] = plan
        return plan


def _trimmed(documents: np.ndarray, query_chunk: int, key_chunk: int, size: int, window):
    """The rectangle ``(q0, q1, k0, k1, full)`` of chunk offsets where the queries of row chunk
    ``query_chunk`` can see keys of row chunk ``key_chunk`` (``key_chunk <= query_chunk``), or
    None; ``documents`` ``(T,)`` the conversation of each row token (non-decreasing).
    """
    q_start, k_start = query_chunk * size, key_chunk * size
    query_docs = documents[q_start : q_start + size]
    key_docs = documents[k_start : k_start + size]
    q0 = int(np.searchsorted(query_docs, key_docs[0], "left"))
    q1 = int(np.searchsorted(query_docs, key_docs[-1], "right"))
    k0 = int(np.searchsorted(key_docs, query_docs[0], "left"))
    k1 = int(np.searchsorted(key_docs, query_docs[-1], "right"))
    diagonal = query_chunk == key_chunk
    if diagonal:  # causal: no key after the last query
        k1 = min(k1, q1)
    if window is not None:  # a key within the window of the first query, a query of the last key
        k0 = max(k0, q_start + q0 - window + 1 - k_start)
        q1 = min(q1, k_start + k1 - 1 + window - q_start)
    if q0 >= q1 or k0 >= k1:
        return None
    one_conversation = query_docs[q0] == query_docs[q1 - 1] == key_docs[k0] == key_docs[k1 - 1]
    in_window = window is None or (q_start + q1 - 1) - (k_start + k0) < window
    return q0, q1, k0, k1, bool(one_conversation and in_window and not diagonal)
