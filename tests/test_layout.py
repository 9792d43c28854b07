"""PackedLayout: a packed call's conversations read once from the forms users bring, written out.

Every form of a row's boundaries gives the same layout; each derived form is written out for one
small call (two rows of 6 tokens: conversations of 2, 3 and 1 tokens, then one of 6), and the
layout keeps nothing that a second call with other boundaries in the same tensors could find.
"""

from __future__ import annotations

import pytest
import torch

from packed_ce.layout import PackedLayout, loss_boundaries

# two rows of 6 tokens: [0, 2) [2, 5) [5, 6) | [6, 12)
POSITIONS = torch.tensor([[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]])
CU_SEQLENS = torch.tensor([0, 2, 5, 6, 12], dtype=torch.int32)


@pytest.mark.parametrize(
    "keywords",
    [
        {"position_ids": POSITIONS},
        {"cu_seqlens": CU_SEQLENS},
        {"cu_seq_lens_q": CU_SEQLENS.to(torch.int64)},
        {"cu_seqlens": torch.tensor([0, 2, 5, 12], dtype=torch.int32)},  # row 2 starts one anyway
    ],
    ids=["position_ids", "cu_seqlens", "cu_seq_lens_q", "cu_seqlens over the row end"],
)
def test_every_form_gives_the_same_layout(keywords):
    layout = PackedLayout.of_call(keywords, (2, 6))
    assert layout.cu_seqlens.tolist() == [0, 2, 5, 6, 12] and layout.cu_seqlens.dtype == torch.int32
    assert layout.position_ids.tolist() == POSITIONS.tolist()
    assert layout.shape == (2, 6) and layout.num_conversations == 4 and layout.packed
    assert layout.spans == [[(0, 2), (2, 5), (5, 6)], [(0, 6)]]
    assert layout.max_seqlen == 6
    assert layout.seq_idx.tolist() == [[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert layout.seq_idx.dtype == torch.int32
    assert layout.token_conversation.tolist() == [[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3]]


def test_the_keywords_each_part_reads():
    layout = PackedLayout.of_call({"position_ids": POSITIONS}, (2, 6))
    flat = layout.flat_keywords()
    assert flat["seq_idx"].tolist() == [[0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3]]
    assert flat["cu_seq_lens_q"] is layout.cu_seqlens and flat["cu_seq_lens_k"] is layout.cu_seqlens
    assert flat["max_length_q"] == flat["max_length_k"] == 6
    assert set(layout.row_keywords()) == {"seq_idx"}  # two rows: no varlen keywords
    one_row = PackedLayout.of_call({"position_ids": POSITIONS[:1]}, (1, 6))
    assert one_row.row_keywords()["cu_seq_lens_q"].tolist() == [0, 2, 5, 6]


def test_one_conversation_per_row_is_not_packed_and_a_call_without_boundaries_has_no_layout():
    layout = PackedLayout.of_call({"position_ids": torch.arange(6).expand(2, 6)}, (2, 6))
    assert not layout.packed and layout.spans == [[(0, 6)], [(6 - 6, 6)]]
    assert PackedLayout.of_call({"input_ids": torch.zeros(2, 6)}, (2, 6)) is None


def test_the_loss_fields_travel_as_the_batch_gives_them():
    """The loss's cu_seqlens may split a conversation (a context-parallel shard's): its own
    boundaries, beside the model's conversations from the position_ids."""
    targets, weights = torch.tensor([1, 2, 2, 1, 3], dtype=torch.int32), torch.rand(5).double()
    split = torch.tensor([0, 2, 4, 5, 6, 12], dtype=torch.int32)
    keywords = {"position_ids": POSITIONS, "cu_seqlens": split, "seq_targets": targets,
                "seq_weights": weights}
    layout = PackedLayout.of_call(keywords, (2, 6))
    assert layout.cu_seqlens.tolist() == [0, 2, 5, 6, 12]
    assert layout.loss.cu_seqlens is split and layout.loss.seq_targets is targets
    assert layout.loss.seq_weights is weights
    assert loss_boundaries(torch.zeros(2, 6), {"position_ids": POSITIONS}).position_ids is POSITIONS
    assert loss_boundaries(torch.zeros(2, 6), {}).cu_seqlens.tolist() == [0, 6, 12]


def test_nothing_is_kept_on_the_tensors_a_loop_refills():
    """A loop that refills its inputs in place (static buffers, CUDA graphs) gets each call's own
    conversations: nothing read from one call is kept on the tensor or anywhere for the next."""
    positions = POSITIONS.clone()
    first = PackedLayout.of_call({"position_ids": positions}, (2, 6))
    assert first.spans[0] == [(0, 2), (2, 5), (5, 6)]
    positions.copy_(torch.tensor([[0, 1, 2, 3, 0, 1], [0, 1, 2, 0, 1, 2]]))
    second = PackedLayout.of_call({"position_ids": positions}, (2, 6))
    assert second.spans == [[(0, 4), (4, 6)], [(0, 3), (3, 6)]]
    assert not [name for name in vars(positions) if "packed" in name]
