"""Vision-language models packed: every family exact against each conversation alone (loss and
every gradient, the vision tower's included), or refused by name.

Each family's tiny model (float64, sdpa) runs the conversations of
``collators.load_default_image_dataset`` one at a time (the processor's own inputs, the model's own
positions: ``vision_utils.alone_loss``) and packed in one row (``collators.VisionCollator``); the
per-conversation mean and every gradient must agree to float64 rounding.
"""

from __future__ import annotations

import pytest
import torch
import vision_utils as vu

import collators
from packed_ce.columns import ROW_LAYOUT
from packed_ce.integrations import apply_packed_loss
from packed_ce.integrations.model import vision

# float64 rounding; where a family computes in float32 inside a float64 model (Qwen3.5's gated
# delta rule in transformers' torch path, Gemma 3's norms), a row and a conversation alone round
# their float64 inputs' last bits differently there: float32 rounding
TOLERANCE = {"qwen3_5": 1e-6, "qwen3_5_moe": 1e-6, "gemma3": 1e-7}
DEFAULT_TOLERANCE = 1e-10
# conversations per row: the first five of the generated data (1, 2, 3, 1 and 0 images); three
# for Qwen3.5, whose gated delta rule runs per conversation in transformers' slow torch path
COUNT = {"qwen3_5": 3, "qwen3_5_moe": 3}


def _packed_against_alone(family: str, fused: bool = False, count: int = 5):
    model = vu.model(family)
    expected = vu.alone_loss(family, model, count)
    expected.backward()
    reference = vu.gradients(model)
    model.zero_grad()
    apply_packed_loss(model, fused_linear=fused)
    batch = collators.VisionCollator(vu.processor(family))(vu.rows(family, count))
    loss = model(**batch).loss
    loss.backward()
    return loss, expected, vu.gradients(model), reference


@pytest.mark.parametrize("family", vu.FAMILIES)
def test_packed_row_with_images_is_every_conversation_alone(family):
    loss, expected, grads, reference = _packed_against_alone(family, count=COUNT.get(family, 5))
    tolerance = TOLERANCE.get(family, DEFAULT_TOLERANCE)
    torch.testing.assert_close(loss, expected, rtol=tolerance, atol=0)
    error, name = vu.worst_gradient(grads, reference)
    assert error < tolerance, (name, error)
    # the vision tower learns through the packed row too
    assert any(
        "visual" in n or "vision_tower" in n for n, g in reference.items() if bool(g.any())
    )


def test_fused_loss_runs_the_vision_tower():
    # the fused loss takes the hidden states of the multimodal base model, not of the decoder
    # alone (which would embed the image tokens as text)
    loss, expected, grads, reference = _packed_against_alone("qwen2_vl", fused=True)
    torch.testing.assert_close(loss, expected, rtol=1e-10, atol=0)
    error, name = vu.worst_gradient(grads, reference)
    assert error < 1e-10, (name, error)


def test_rope_positions_are_each_conversation_alone():
    # written out: two conversations of a row, the second's positions restart at 0 and its image
    # (2 x 2 merged tokens) takes its own height and width positions
    family = "qwen2_vl"
    tokenizer = vu.processor(family).tokenizer
    start, image, end = tokenizer.convert_tokens_to_ids(
        ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
    )
    first = [5, start, image, end, 6]
    second = [7, 8, start, image, image, image, image, end, 9]
    input_ids = torch.tensor([first + second])
    batch = {
        "input_ids": input_ids,
        "image_grid_thw": torch.tensor([[1, 2, 2], [1, 4, 4]]),
        "mm_token_type_ids": (input_ids == image).int(),
    }
    spans = [[(0, 5), (5, 14)]]
    positions = vision.rope_positions(vu.model(family), batch, spans)
    assert positions[:, 0].tolist() == [
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 7, 8],  # text: each conversation's token index
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 3, 3, 3, 5, 6],  # temporal
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 3, 4, 4, 5, 6],  # height
        [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 3, 4, 5, 6],  # width
    ]


def test_text_only_row_of_a_multimodal_rope_model_is_kept_apart():
    # 2-D positions alone give transformers' multimodal text models no text row, so no packed
    # mask: the conversations of a text-only row would attend to each other
    family = "qwen2_vl"
    model = vu.model(family)
    texts = [row for row in vu.rows(family, 10) if not row["images"]]
    assert len(texts) == 2
    expected = []
    for row in texts:
        logits = model(input_ids=torch.tensor([row["input_ids"]]), use_cache=False).logits[0]
        labels = torch.tensor(row["labels"])
        expected.append(torch.nn.functional.cross_entropy(logits[:-1], labels[1:]))
    apply_packed_loss(model)
    batch = collators.VisionCollator(vu.processor(family))(texts)
    assert "pixel_values" not in batch
    loss = model(**batch).loss
    torch.testing.assert_close(loss, torch.stack(expected).mean(), rtol=1e-10, atol=0)


def _packed_call(family: str, **changes) -> dict:
    model = vu.model(family)
    apply_packed_loss(model)
    batch = collators.VisionCollator(vu.processor(family))(vu.rows(family, 3))
    return model, {**batch, **changes}


def test_videos_in_a_packed_row_are_refused():
    model, batch = _packed_call("qwen2_vl", pixel_values_videos=torch.zeros(4, 1176))
    with pytest.raises(ValueError, match="packed batches with videos are not supported"):
        model(**batch)


def test_a_family_not_checked_is_refused_with_images(monkeypatch):
    monkeypatch.delitem(vision.VISION_FAMILIES, "llava")
    model, batch = _packed_call("llava")
    with pytest.raises(ValueError, match="not checked on model_type='llava'.*PaddedCollator"):
        model(**batch)
    # one conversation with the collator's positions too (they may not be the family's own)
    single = collators.VisionCollator(vu.processor("llava"))(vu.rows("llava", 1))
    with pytest.raises(ValueError, match="not checked on model_type='llava'"):
        model(**single)
    # unpacked, the model's own positions: as without packed-ce
    padded = collators.VisionCollator(vu.processor("llava"), packed=False)(vu.rows("llava", 3))
    assert torch.isfinite(model(**padded).loss)


def test_three_row_positions_on_a_packed_call_are_refused():
    model, batch = _packed_call("qwen2_vl")
    width = batch["input_ids"].shape[1]
    positions = batch["position_ids"].expand(3, 1, width)
    with pytest.raises(ValueError, match="without a text row transformers builds one causal"):
        vision.multimodal_inputs(model, {**batch, "position_ids": positions}, [[(0, 5), (5, width)]])


def test_images_under_context_parallelism_are_refused():
    model, batch = _packed_call("qwen2_vl")
    call = {**batch, ROW_LAYOUT: object()}
    width = batch["input_ids"].shape[1]
    for spans in ([[(0, 5), (5, width)]], [[(0, width)]]):  # a rank's shard of one conversation too
        with pytest.raises(ValueError, match="context parallelism does not take batches with"):
            vision.multimodal_inputs(model, call, spans)
    # text only: a shard's positions are the row's, left as they are
    text = {k: v for k, v in call.items() if k not in ("pixel_values", "image_grid_thw")}
    assert vision.multimodal_inputs(model, text, [[(0, 5), (5, width)]]) is text


def test_an_image_cut_at_a_conversation_boundary_is_refused():
    model, batch = _packed_call("qwen2_vl")
    image = (batch["mm_token_type_ids"][0] == 1).nonzero()[1].item()  # inside the first image
    spans = [[(0, image), (image, batch["input_ids"].shape[1])]]
    with pytest.raises(ValueError, match="inside an image"):
        vision.rope_positions(model, batch, spans)
