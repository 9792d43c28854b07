"""Helpers of the vision-language tests: offline processors and tiny models per family, rows of
generated conversations, and the ground truth of each conversation alone.

The ground truth never looks at packing: :func:`alone_loss` runs each conversation through the
model without the packed loss, its tokens and image inputs made by the processor's own
``apply_chat_template`` and its positions by the model itself, and averages over the
conversations the mean token loss of each.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

import collators
from packed_ce.integrations import tiny_vision_lm

IGNORE = -100
# every family of packed_ce.integrations.model.vision.VISION_FAMILIES
FAMILIES = (
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "gemma3",
    "llava",
)


@functools.lru_cache(maxsize=None)
def processor(family: str):
    return collators.load_default_processor(family)


@functools.lru_cache(maxsize=None)
def _conversations(count: int):
    return collators.load_default_image_dataset(count)


@functools.lru_cache(maxsize=None)
def _rows(family: str, count: int):
    return collators.tokenize_dataset(_conversations(count), processor(family))


def rows(family: str, count: int = 5) -> list[dict]:
    """``count`` tokenized conversations of ``load_default_image_dataset`` (with their images)."""
    return [dict(row) for row in _rows(family, count)]


def model(family: str, dtype=torch.float64, **kwargs):
    """A tiny model of ``family`` in ``dtype`` (float64 by default: packed and alone must agree to
    rounding); eager experts, which take float64.
    """
    if "moe" in family:
        kwargs.setdefault("experts_implementation", "eager")
    return tiny_vision_lm(processor(family), family, **kwargs).to(dtype)


def model_inputs(family: str, index: int, count: int) -> dict:
    """Conversation ``index`` of ``load_default_image_dataset(count)`` as a user calls the model on
    it alone: ``processor.apply_chat_template`` on its messages, each image in its part (its
    tokens, image inputs and modality ids), no positions (the model computes its own).
    """
    example = _conversations(count)[index]
    images = list(example["images"])
    messages = [
        {
            "role": message["role"],
            "content": [
                {"type": "image", "image": images.pop(0)}
                if part["type"] == "image"
                else {"type": "text", "text": part["text"]}
                for part in message["content"]
            ],
        }
        for message in example["messages"]
    ]
    out = processor(family).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_tensors="pt"
    )
    return {key: value for key, value in out.items() if key != "attention_mask"}


def alone_loss(family: str, model, count: int = 5, weights=None, only=None) -> torch.Tensor:
    """The mean over the conversations of ``load_default_image_dataset(count)`` (weighted by
    ``weights``; those of the indices ``only``) of each one's mean target loss, each run alone
    (:func:`model_inputs`, ``model`` without the packed loss) with the labels of :func:`rows`, in
    the model's dtype.
    """
    weights = [1.0] * count if weights is None else weights
    losses, kept = [], []
    for index, (row, weight) in enumerate(zip(rows(family, count), weights)):
        labels = torch.tensor(row["labels"])
        if not (labels[1:] != IGNORE).any() or weight == 0 or (only and index not in only):
            continue
        inputs = model_inputs(family, index, count)
        assert inputs["input_ids"][0].tolist() == row["input_ids"]  # the processor's own tokens
        logits = model(**inputs, use_cache=False).logits[0]
        losses.append(F.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE))
        kept.append(weight)
    kept = torch.tensor(kept, dtype=losses[0].dtype)
    return (torch.stack(losses) * kept).sum() / kept.sum()


def gradients(model) -> dict[str, torch.Tensor]:
    """A copy of every parameter gradient (zeros where a parameter got none)."""
    return {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in model.named_parameters()
    }


def worst_gradient(actual: dict, expected: dict) -> tuple[float, str]:
    """The largest ``|g - g_ref|`` over every parameter, relative to the largest ``|g_ref|`` of
    all (per parameter, a gradient that is 0 in exact arithmetic, like a key bias's, is rounding
    noise), and the parameter where it is.
    """
    scale = max(float(g.abs().max()) for g in expected.values())
    errors = {name: float((actual[name] - g).abs().max()) / scale for name, g in expected.items()}
    name = max(errors, key=errors.get)
    return errors[name], name
