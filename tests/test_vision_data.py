"""Conversations with images: tokenized with the processor, packed with their images, collated.

Written-out examples first (the tokens and labels of one conversation, the positions of its
images), then the properties: every image format gives the same tokens, truncation never cuts an
image, packed rows carry their conversations' images in order, a collated batch holds the
processor's inputs of those images.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import vision_utils as vu
from datasets import Dataset

import collators
from collators import VisionCollator, tokenize_conversation, tokenize_vision_conversation
from collators.processors import shape_image

RED = shape_image("red", "square", (56, 56))  # 4 image tokens for Qwen (2 x 2 merged patches)
BLUE = shape_image("blue", "circle", (28, 28))  # 1


def _messages(*texts, images=1):
    user = [{"type": "image"}] * images + [{"type": "text", "text": texts[0]}]
    return [
        {"role": "user", "content": user},
        {"role": "assistant", "content": texts[1]},
    ]


def test_qwen_conversation_written_out():
    processor = vu.processor("qwen2_vl")
    tokenizer = processor.tokenizer
    example = tokenize_vision_conversation(
        processor, _messages("Shapes?", "Red, blue.", images=2), [RED, BLUE]
    )
    pad = "<|image_pad|>"
    assert tokenizer.decode(example["input_ids"]) == (
        f"<|im_start|>user\n<|vision_start|>{pad * 4}<|vision_end|><|vision_start|>{pad}"
        "<|vision_end|>Shapes?<|im_end|>\n<|im_start|>assistant\nRed, blue.<|im_end|>\n"
    )
    trained = [t for t in example["labels"] if t != -100]
    assert tokenizer.decode(trained) == "Red, blue.<|im_end|>"
    assert [image.size for image in example["images"]] == [(56, 56), (28, 28)]


def test_gemma3_image_tokens_are_never_targets():
    # Gemma 3's processor writes text around each image ("\n\n<start_of_image>...<end_of_image>
    # \n\n"): none of it is trained, even for an image in an assistant turn
    processor = vu.processor("gemma3")
    tokenizer = processor.tokenizer
    messages = [
        {"role": "user", "content": "Draw."},
        {"role": "assistant", "content": [{"type": "text", "text": "Here:"}, {"type": "image"}]},
    ]
    example = tokenize_vision_conversation(processor, messages, [RED])
    trained = [t for t in example["labels"] if t != -100]
    assert tokenizer.decode(trained) == "Here:<|im_end|>"
    assert example["input_ids"].count(tokenizer.image_token_id) == 4


def test_every_token_but_the_images_is_trained_without_assistant_only():
    processor = vu.processor("qwen2_vl")
    messages = _messages("Shapes?", "Red, blue.", images=2)
    example = tokenize_vision_conversation(processor, messages, [RED, BLUE], assistant_only=False)
    image = processor.image_token_id
    assert example["labels"] == [-100 if t == image else t for t in example["input_ids"]]


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_every_image_format_gives_the_same_tokens(tmp_path):
    processor = vu.processor("qwen2_vl")
    path = tmp_path / "red.png"
    RED.save(path)
    expected = tokenize_vision_conversation(processor, _messages("What?", "Red."), [RED])

    def inline(**part):
        messages = _messages("What?", "Red.")
        messages[0]["content"][0] = {"type": "image", **part}
        return tokenize_vision_conversation(processor, messages)

    found = {
        "path": tokenize_vision_conversation(processor, _messages("What?", "Red."), [str(path)]),
        "bytes": tokenize_vision_conversation(processor, _messages("What?", "Red."), [_png(RED)]),
        "stored": tokenize_vision_conversation(
            processor, _messages("What?", "Red."), [{"bytes": _png(RED), "path": None}]
        ),
        "inline image": inline(image=RED),
        "inline path": inline(path=str(path)),
        # trl's plain strings: the images before the first user turn's text
        "trl strings": tokenize_vision_conversation(
            processor,
            [{"role": "user", "content": "What?"}, {"role": "assistant", "content": "Red."}],
            [RED],
        ),
    }
    for name, example in found.items():
        assert example["input_ids"] == expected["input_ids"], name
        assert example["labels"] == expected["labels"], name
        assert np.array_equal(np.asarray(example["images"][0]), np.asarray(RED)), name


@pytest.mark.parametrize(
    ("images", "match"),
    [([], "more image parts than images"), ([RED, BLUE], "2 images but only 1 image parts")],
)
def test_images_that_do_not_match_the_parts_are_refused(images, match):
    with pytest.raises(ValueError, match=match):
        tokenize_vision_conversation(vu.processor("qwen2_vl"), _messages("?", "!"), images)


def test_a_video_part_is_refused():
    messages = _messages("?", "!")
    messages[0]["content"][0] = {"type": "video"}
    with pytest.raises(ValueError, match="message 0 has a video part"):
        tokenize_vision_conversation(vu.processor("qwen2_vl"), messages)


def test_an_image_that_cannot_be_opened_is_refused():
    with pytest.raises(ValueError, match="cannot be opened"):
        tokenize_vision_conversation(vu.processor("qwen2_vl"), _messages("?", "!"), [b"no png"])


def test_a_tokenizer_refuses_image_parts():
    with pytest.raises(ValueError, match="with the model's processor"):
        tokenize_conversation(vu.processor("qwen2_vl").tokenizer, _messages("?", "!"))


def test_truncation_never_cuts_an_image():
    processor = vu.processor("qwen2_vl")
    messages = _messages("Shapes?", "Red, blue.", images=2)
    whole = tokenize_vision_conversation(processor, messages, [BLUE, RED])
    image = processor.image_token_id
    # blue's token at 4; red's four tokens at 7..10: a cut at 9 falls inside red
    assert [i for i, t in enumerate(whole["input_ids"]) if t == image] == [4, 7, 8, 9, 10]
    cut = tokenize_vision_conversation(processor, messages, [BLUE, RED], max_length=9)
    # cut where red's tokens start (its <|vision_start|> before them is the template's text)
    assert cut["input_ids"] == whole["input_ids"][:7]
    assert cut["labels"] == whole["labels"][:7]
    assert len(cut["images"]) == 1
    kept = tokenize_vision_conversation(processor, messages, [BLUE, RED], max_length=12)
    assert kept["input_ids"] == whole["input_ids"][:12] and len(kept["images"]) == 2


def _dataset(count=6):
    return collators.load_default_image_dataset(count)


def test_tokenize_dataset_with_a_processor():
    processor = vu.processor("qwen2_vl")
    data = _dataset().add_column("weight", [1.0, 2.0, 0.5, 1.0, 1.0, 3.0])
    rows = collators.tokenize_dataset(data, processor)
    assert rows.column_names == ["source", "weight", "input_ids", "labels", "images"]
    for index, (conversation, row) in enumerate(zip(data, rows)):
        expected = tokenize_vision_conversation(
            processor, conversation["messages"], conversation["images"]
        )
        assert row["input_ids"] == expected["input_ids"], index
        assert row["labels"] == expected["labels"], index
        assert len(row["images"]) == len(conversation["images"])
        for got, given in zip(row["images"], conversation["images"]):
            assert np.array_equal(np.asarray(got.convert("RGB")), np.asarray(given))


def _pixels(images) -> list[np.ndarray]:
    return [np.asarray(collators.images.open_image(image, "test")) for image in images]


def test_packed_rows_carry_their_conversations_images_in_order():
    processor = vu.processor("qwen2_vl")
    rows = collators.tokenize_dataset(_dataset(8), processor)
    packed = collators.pack_dataset(rows, 160)
    assert sorted(n for row in packed["seq_lengths"] for n in [len(row)]) and len(packed) >= 3
    for row in packed:
        # find each piece's conversation by its tokens, then its images in the row's order
        start, expected = 0, []
        for length in row["seq_lengths"]:
            tokens = row["input_ids"][start : start + length]
            source = next(r for r in rows if r["input_ids"] == tokens)
            expected += _pixels(source["images"])
            start += length
        got = _pixels(row["images"])
        assert len(got) == len(expected)
        assert all(np.array_equal(a, b) for a, b in zip(got, expected))


def test_long_conversations_with_images_are_never_cut_by_packing():
    processor = vu.processor("qwen2_vl")
    rows = collators.tokenize_dataset(_dataset(6), processor)
    longest = max(len(ids) for ids in rows["input_ids"])
    for overflow in ("truncate", "split"):
        with pytest.raises(ValueError, match="conversations with images are longer"):
            collators.pack_dataset(rows, longest - 1, overflow=overflow)
    packed, stats = collators.pack_dataset(rows, longest - 1, overflow="drop", return_stats=True)
    assert stats.num_dropped >= 1 and len(packed) >= 1
    # a conversation without images is truncated as text is
    texts = rows.filter(lambda row: not row["images"])
    packed, stats = collators.pack_dataset(texts, 10, return_stats=True)
    assert stats.num_truncated == len(texts) and packed["images"] == [[]] * len(texts)


def test_a_stream_with_images_is_refused():
    rows = collators.tokenize_dataset(_dataset(2), vu.processor("qwen2_vl"))
    with pytest.raises(ValueError, match="a stream is not packed with"):
        list(collators.pack_stream(iter(rows), max_length=200))


def test_collated_images_are_the_processors_of_each_conversation_in_order():
    family = "qwen2_vl"
    processor = vu.processor(family)
    rows = vu.rows(family, 5)
    batch = VisionCollator(processor)(rows)
    alone = [vu.model_inputs(family, index, 5) for index in range(5)]
    with_images = [inputs for inputs in alone if "pixel_values" in inputs]
    torch.testing.assert_close(
        batch["pixel_values"], torch.cat([inputs["pixel_values"] for inputs in with_images])
    )
    assert batch["image_grid_thw"].tolist() == [
        grid for inputs in with_images for grid in inputs["image_grid_thw"].tolist()
    ]
    assert batch["mm_token_type_ids"][0].tolist() == [
        t for inputs in alone for t in inputs["mm_token_type_ids"][0].tolist()
    ]
    padded = VisionCollator(processor, packed=False)(rows)
    assert padded["input_ids"].shape[0] == 5 and "position_ids" not in padded
    torch.testing.assert_close(padded["pixel_values"], batch["pixel_values"])


def test_images_that_are_not_the_rows_are_refused():
    processor = vu.processor("qwen2_vl")
    rows = vu.rows("qwen2_vl", 3)
    assert len(rows[1]["images"]) == 2
    rows[1] = {**rows[1], "images": rows[1]["images"][:1]}
    with pytest.raises(ValueError, match="must be the images it was tokenized with"):
        VisionCollator(processor)(rows)


def test_default_image_dataset_is_trl_shaped():
    data = _dataset(5)
    assert isinstance(data, Dataset) and data.column_names == ["messages", "images", "source"]
    parts = [p["type"] for m in data[0]["messages"] for p in m["content"]]
    assert parts.count("image") == len(data[0]["images"])
