"""Training vision-language models with the packed trainers: data with images packed (or
padding-free, or padded), ``evaluate()`` the per-conversation mean over the eval set at any batch
size, weights and sources; ``PackedTrainer`` with ``collators.VisionCollator``.

The reference is each conversation alone (``vision_utils.alone_loss``), float32 here as the
trainers run (rounding tolerance 1e-5).
"""

from __future__ import annotations

import pytest
import torch
import vision_utils as vu
from integration_utils import sft_args
from transformers import TrainingArguments

import collators
from packed_ce.integrations import PackedSFTTrainer, PackedTrainer

FAMILY = "qwen2_vl"
COUNT = 6
SOURCES = ["a", "b", "a", "a", "b", "b"]
WEIGHTS = [1.0, 2.0, 0.5, 1.0, 3.0, 1.0]


def _data(weights: bool = False):
    data = collators.load_default_image_dataset(COUNT).remove_columns("source")
    data = data.add_column("source", SOURCES)
    return data.add_column("weight", WEIGHTS) if weights else data


def _args(tmp_path, **fields):
    fields = {"assistant_only_loss": True, **fields}
    return sft_args(tmp_path, per_device_train_batch_size=2, max_length=512, **fields)


def _expected(model, weights=None, keep=None) -> float:
    with torch.no_grad():
        picked = range(COUNT) if keep is None else keep
        return float(vu.alone_loss(FAMILY, model, COUNT, weights, only=picked))


@pytest.mark.parametrize(
    "layout",
    [dict(packing=True), dict(padding_free=True), dict()],
    ids=["packing", "padding_free", "padded"],
)
@pytest.mark.parametrize("eval_batch", [1, 3])
def test_sft_trainer_with_images_evaluates_every_conversation_alone(tmp_path, layout, eval_batch):
    model = vu.model(FAMILY, dtype=torch.float32)
    trainer = PackedSFTTrainer(
        model=model,
        args=_args(tmp_path, per_device_eval_batch_size=eval_batch, **layout),
        train_dataset=_data(),
        eval_dataset=_data(),
        processing_class=vu.processor(FAMILY),
    )
    metrics = trainer.evaluate()
    model.eval()
    torch.testing.assert_close(metrics["eval_loss"], _expected(model), rtol=1e-5, atol=0)
    by_source = {s: [i for i, x in enumerate(SOURCES) if x == s] for s in ("a", "b")}
    for source, keep in by_source.items():
        torch.testing.assert_close(
            metrics[f"eval_loss/{source}"], _expected(model, keep=keep), rtol=1e-5, atol=0
        )


def test_sft_trainer_with_images_trains_the_weighted_mean(tmp_path):
    model = vu.model(FAMILY, dtype=torch.float32)
    trainer = PackedSFTTrainer(
        model=model,
        args=_args(tmp_path, packing=True),
        train_dataset=_data(weights=True),
        eval_dataset=_data(weights=True),
        processing_class=vu.processor(FAMILY),
    )
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if "visual" in n}
    trainer.train()  # one step over a packed row with images: the vision tower learns too
    assert all(not torch.equal(p, vision[n]) for n, p in model.named_parameters() if n in vision)
    metrics = trainer.evaluate()
    model.eval()
    torch.testing.assert_close(metrics["eval_loss"], _expected(model, WEIGHTS), rtol=1e-5, atol=0)
    # a data set passed to evaluate() is prepared as at construction
    again = trainer.evaluate(_data(weights=True))
    torch.testing.assert_close(again["eval_loss"], metrics["eval_loss"], rtol=1e-6, atol=0)


def test_split_packing_of_images_is_refused(tmp_path):
    with pytest.raises(ValueError, match="packing_strategy='bfd_split' splits long conversations"):
        PackedSFTTrainer(
            model=vu.model(FAMILY, dtype=torch.float32),
            args=_args(tmp_path, packing=True, packing_strategy="bfd_split"),
            train_dataset=_data(),
            processing_class=vu.processor(FAMILY),
        )


@pytest.mark.parametrize("family", ["gemma3", "qwen3_5"])
def test_packed_trainer_with_the_vision_collator(tmp_path, family):
    model = vu.model(family, dtype=torch.float32)
    from packed_ce.integrations import apply_packed_loss

    apply_packed_loss(model)
    processor = vu.processor(family)
    rows = collators.pack_dataset(collators.tokenize_dataset(_data(), processor), 256)
    trainer = PackedTrainer(
        model=model,
        args=TrainingArguments(
            str(tmp_path),
            per_device_train_batch_size=1,
            per_device_eval_batch_size=2,
            max_steps=1,
            report_to=[],
            use_cpu=True,
        ),
        train_dataset=rows,
        eval_dataset=rows,
        data_collator=collators.VisionCollator(processor),
    )
    trainer.train()
    metrics = trainer.evaluate()
    model.eval()
    with torch.no_grad():
        expected = float(vu.alone_loss(family, model, COUNT))
    torch.testing.assert_close(metrics["eval_loss"], expected, rtol=1e-5, atol=0)
