"""``VisionCollator``: batches of conversations with images for a vision-language model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from packed_ce.columns import ATTENTION_MASK, IGNORE_INDEX, IMAGES, INPUT_IDS

from .collate import PackedCollator, PaddedCollator
from .images import open_image
from .vision import check_processor


class VisionCollator:
    """Batches of tokenized conversations with their images: packed or padded, with the images'
    model inputs.

    The text is collated by :class:`PackedCollator` (``packed=True``: one row, the conversations
    back to back, ``position_ids`` restarting at each, ``cu_seqlens``, weights and sources) or
    :class:`PaddedCollator` (one conversation per row). The batch's images, in the order of their
    tokens (each example's ``images``, examples in order), go through the model's processor once
    (its own image options, so each image gets the tokens it got when tokenized), which gives
    the image inputs (``pixel_values`` and, by family, ``image_grid_thw``, ...), in the same
    order; its per-token modality ids (``mm_token_type_ids``, Gemma 3's ``token_type_ids``: 1 at
    image tokens) are computed for the batch's tokens. The model keeps each conversation's images
    and positions to itself (``packed_ce.integrations.apply_packed_loss``).

    Args:
        processor: the model's ``transformers`` processor (the one the data was tokenized with).
        packed: one packed row (default), or one padded row per conversation.
        pad_to_multiple_of, ignore_index, return_varlen_kwargs: as in :class:`PackedCollator`
            (``return_varlen_kwargs`` packed only).
        pad_token_id: the padding token (default: the processor's tokenizer's).

    Raises:
        ValueError: from ``__call__``, a batch whose image tokens do not match its images (the
            examples' ``images`` are not those they were tokenized with), and those of the text
            collator.

    Example:
        >>> from collators import (
        ...     VisionCollator, load_default_image_dataset, load_default_processor,
        ...     tokenize_dataset,
        ... )
        >>> processor = load_default_processor("qwen2_vl")
        >>> rows = tokenize_dataset(load_default_image_dataset(4), processor)
        >>> batch = VisionCollator(processor)(list(rows))
        >>> batch["input_ids"].shape, batch["cu_seqlens"].tolist()
        (torch.Size([1, 230]), [0, 34, 106, 173, 230])
        >>> batch["image_grid_thw"].tolist()
        [[1, 4, 4], [1, 2, 4], [1, 2, 2], [1, 2, 2], [1, 4, 2], [1, 4, 4], [1, 4, 4]]
        >>> batch["pixel_values"].shape  # 72 patches of 3 x 2 x 14 x 14 values
        torch.Size([72, 1176])
    """

    def __init__(
        self,
        processor,
        *,
        packed: bool = True,
        pad_to_multiple_of: int | None = None,
        pad_token_id: int | None = None,
        ignore_index: int = IGNORE_INDEX,
        return_varlen_kwargs: bool = True,
    ):
        check_processor(processor)
        self.processor = processor
        if pad_token_id is None:
            pad_token_id = processor.tokenizer.pad_token_id or 0
        if packed:
            self.text = PackedCollator(
                pad_to_multiple_of=pad_to_multiple_of,
                pad_token_id=pad_token_id,
                ignore_index=ignore_index,
                return_varlen_kwargs=return_varlen_kwargs,
            )
        else:
            self.text = PaddedCollator(
                pad_token_id, pad_to_multiple_of=pad_to_multiple_of, ignore_index=ignore_index
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({type(self.processor).__name__}, {self.text!r})"

    def __call__(self, examples: Sequence[Mapping]) -> dict:
        """Collate ``examples``: tokenized conversations or packed rows (``tokenize_dataset`` /
        ``pack_dataset`` with a processor) with their ``images`` (in the order of their tokens).
        """
        images = []
        for index, example in enumerate(examples):
            found = example.get(IMAGES) if isinstance(example, Mapping) else None
            images += [open_image(image, f"examples[{index}]") for image in found or []]
        batch = self.text(
            [
                {key: value for key, value in example.items() if key != IMAGES}
                if isinstance(example, Mapping)
                else example
                for example in examples
            ]
        )
        batch.update(self.image_inputs(images, batch[INPUT_IDS]))
        return batch

    def image_inputs(self, images: list, input_ids: torch.Tensor) -> dict:
        """The processor's inputs for ``images`` (RGB ``PIL`` images in the order of their tokens)
        and ``input_ids`` ``(B, T)``: its image inputs and its per-token modality ids; empty
        without images.
        """
        if not images:
            return {}
        processor = self.processor
        # one placeholder per image: the processor processes them as it did when tokenizing
        out = processor(
            text=[processor.image_token * len(images)], images=[images], return_tensors="pt"
        )
        shape = out[INPUT_IDS].shape
        per_token = [
            key
            for key, value in out.items()
            if key not in (INPUT_IDS, ATTENTION_MASK)
            and isinstance(value, torch.Tensor)
            and value.shape == shape
        ]
        types = torch.tensor(processor.create_mm_token_type_ids(input_ids.tolist()))
        expected = torch.tensor(processor.create_mm_token_type_ids(out[INPUT_IDS].tolist()))
        found, wanted = int((types == 1).sum()), int((expected == 1).sum())
        if found != wanted:
            raise ValueError(
                f"the batch has {found} image tokens but its {len(images)} images make {wanted}: "
                "each example's `images` must be the images it was tokenized with, in order"
            )
        inputs = {k: v for k, v in out.items() if k not in (INPUT_IDS, ATTENTION_MASK)}
        for key in per_token:
            if not torch.equal(out[key], expected.to(out[key].dtype)):
                raise ValueError(
                    f"{type(processor).__name__}'s {key} is not the modality of each token, so it "
                    "cannot be computed for a batch: collate this model's data unpacked, with "
                    "its own collator"
                )
            inputs[key] = types.to(out[key].dtype)
        return inputs
