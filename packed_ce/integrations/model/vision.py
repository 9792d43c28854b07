"""Vision-language models packed exactly: each conversation's positions and masks as alone.

What transformers (5.17 to 5.24) does with a packed row of a vision-language model, measured on
tiny models against every conversation alone:

- **Multimodal rotary embeddings** (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5 and their MoE
  variants). The model's own rope index (``get_rope_index``) runs over the whole row: the second
  conversation's positions continue from the first's. The text model reads ``position_ids`` of 4
  rows as ``(text, temporal, height, width)``: the text row builds the block-diagonal mask (and
  flash attention's boundaries), the other three the rotary embedding; 2-D or 3-row positions give
  no text row, so transformers builds one causal mask over the whole row (transformers #44911
  misread 3-row positions as packed). :func:`multimodal_inputs` gives a packed call (and any call
  with images and 2-D positions, which the model would take as text positions for its images)
  the model's own rope index of each conversation alone, laid side by side under a text row that
  restarts at every conversation: logits equal to each conversation alone (0 difference in
  float64).
- **Bidirectional attention within an image** (Gemma 3: ``token_type_ids``). transformers 5.24
  remaps a mask function to the packed per-conversation positions before it is called
  (``masking_utils.remap_positions_for_packed_sequence``), and Gemma 3's sliding layers pass their
  image blocks as such a function: they were read at the conversation's positions, not the row's
  (logits off by 0.3 for every conversation after the first). A packed call with images gets its
  masks built here from transformers' mask functions, on the row's own columns: causal or the
  token's image block, and within its conversation (and the sliding window on sliding layers),
  as Gemma 3 composes them alone.
- **Vision towers** keep each image to itself (Qwen's ``cu_seqlens`` per image and frame, SigLIP
  and CLIP per image): the features of a row's images equal each conversation's images alone. But
  they take some keywords of the call as their own (transformers' ``vision_utils`` pops
  ``cu_seqlens``, ``max_seqlen`` and ``position_ids`` from them, and flash attention in CLIP,
  SigLIP or Qwen's vision blocks would read the text's ``cu_seq_lens_q``): the ``max_seqlen`` of
  ``collators.PackedCollator`` and the text's varlen keywords are dropped from a call with images
  (flash attention then finds the text's conversations from the text positions).

Families are exact or refused by name (:data:`VISION_FAMILIES`); videos and context parallelism
with images are refused.
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch
from torch import nn

from ...columns import (
    ATTENTION_MASK,
    CU_SEQ_LENS_K,
    CU_SEQ_LENS_Q,
    IMAGE_GRID_THW,
    INPUT_IDS,
    LAYOUT,
    MAX_LENGTH_K,
    MAX_LENGTH_Q,
    MAX_SEQLEN,
    MM_TOKEN_TYPE_IDS,
    PIXEL_VALUES,
    POSITION_IDS,
    ROW_LAYOUT,
    TOKEN_TYPE_IDS,
)
from .audit import UNPACKED
from .guards import call_tokens

# The families whose packed rows with images are exact (tests/test_vision_models.py), by how each
# conversation is made as alone: "rope index" (multimodal rotary positions per conversation),
# "image blocks" (masks with bidirectional image blocks built per row), "positions" (the 2-D
# restarting positions of the text path are enough: 1-D rotary, causal masks).
VISION_FAMILIES = {
    "qwen2_vl": "rope index",
    "qwen2_5_vl": "rope index",
    "qwen3_vl": "rope index",
    "qwen3_vl_moe": "rope index",
    "qwen3_5": "rope index",
    "qwen3_5_moe": "rope index",
    "gemma3": "image blocks",
    "llava": "positions",
}
# A call's video inputs: refused packed (no family's video path is checked here).
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# Keywords a vision tower takes as its own from the call's (see the module docstring): the text's,
# dropped from a call with images.
TEXT_ONLY_KEYS = (MAX_SEQLEN, CU_SEQ_LENS_Q, CU_SEQ_LENS_K, MAX_LENGTH_Q, MAX_LENGTH_K)


def is_multimodal(model: nn.Module) -> bool:
    """Whether ``model``'s forward takes images (``pixel_values``)."""
    return PIXEL_VALUES in _parameters(type(model))


@functools.lru_cache(maxsize=None)
def _parameters(cls: type) -> frozenset:
    return frozenset(inspect.signature(cls.forward).parameters)


def exact_calls(model: nn.Module, forward: Callable) -> Callable:
    """``forward`` (``model``'s own, or the multimodal base model's) taking each call's keywords
    through :func:`multimodal_inputs`; ``forward`` itself for a model without images.
    """
    if not is_multimodal(model):
        return forward

    def call(*args, **kwargs):
        tokens = call_tokens(args, kwargs)
        if isinstance(tokens, torch.Tensor) and tokens.dim() >= 2:
            shape = tuple(tokens.shape[:2])
            layout = kwargs.get(LAYOUT)  # the call's conversations (guards.checked_call)
            spans = layout.spans if layout is not None else [[(0, shape[1])]] * shape[0]
            kwargs = multimodal_inputs(model, kwargs, spans)
        return forward(*args, **kwargs)

    return call


def decoder_forward(model: nn.Module) -> Callable:
    """What the fused loss runs for the hidden states: the decoder, or for a vision-language model
    its multimodal base model (the decoder alone would skip the vision tower and embed the image
    tokens as text), each call through :func:`multimodal_inputs`.
    """
    if not is_multimodal(model):
        return model.get_decoder()
    return exact_calls(model, model.base_model)


def multimodal_inputs(model: nn.Module, kwargs: dict, spans: list[list[tuple[int, int]]]) -> dict:
    """The keywords of a call of a vision-language model, each conversation as it is alone.

    Args:
        model: the transformers model (``...ForConditionalGeneration``).
        kwargs: the call's keywords, after the packed-call checks: ``input_ids`` ``(B, T)``, 2-D
            ``position_ids`` restarting at every conversation (or none), the image inputs.
        spans: each row's conversations, ``(start, end)`` columns.

    Returns:
        ``kwargs`` unchanged for a call with neither images nor two conversations in a row; else a
        new dict without :data:`TEXT_ONLY_KEYS` (with images) and with, by family
        (:data:`VISION_FAMILIES`): ``position_ids`` ``(4, B, T)`` int64 (text positions, then the
        model's rope index of each conversation alone), or ``attention_mask`` as a dict of the
        packed masks with image blocks per layer type.

    Raises:
        ValueError: a call with images and ``position_ids`` (or packed) of a family not in
            :data:`VISION_FAMILIES`, images under context parallelism; a packed call with
            videos, with ``inputs_embeds`` and images, with 3-row ``position_ids``, or whose
            image tokens do not match ``image_grid_thw``.
    """
    images = kwargs.get(PIXEL_VALUES) is not None or kwargs.get(IMAGE_GRID_THW) is not None
    packed = any(len(row) > 1 for row in spans)
    family = model.config.model_type
    if kwargs.get(ROW_LAYOUT) is not None:
        if images:
            raise ValueError(
                f"context parallelism does not take batches with images (model_type={family!r}): "
                "the ranks would each need the images of the conversations they hold; train "
                "with images without context parallelism (packed on one rank), or text-only data "
                "under it"
            )
        # a rank's shard: its positions are the row's (a piece of a conversation does not
        # start at 0), and context parallelism's attention keeps the conversations apart
        return kwargs
    if not (images or packed):
        return kwargs
    kind = VISION_FAMILIES.get(family)
    positions = kwargs.get(POSITION_IDS)
    if images and kind is None and (packed or positions is not None):
        # given positions (a collator's, even for one conversation) may not be what the family
        # gives its image tokens alone
        raise ValueError(
            f"packed batches with images are not checked on model_type={family!r}: packed-ce "
            f"makes {', '.join(VISION_FAMILIES)} exact (their rows with images attend and "
            f"position as each conversation alone); {UNPACKED}"
        )
    if packed:
        _refuse_packed(family, images, kwargs, positions)
    kwargs = dict(kwargs)
    if images:
        for key in TEXT_ONLY_KEYS:
            kwargs.pop(key, None)
    two_dimensional = positions is None or positions.dim() == 2
    # without position_ids and with one conversation per row the model's own positions stand
    if kind == "rope index" and two_dimensional and (packed or positions is not None):
        kwargs[POSITION_IDS] = rope_positions(model, kwargs, spans)
    elif kind == "image blocks" and packed and kwargs.get(TOKEN_TYPE_IDS) is not None:
        kwargs[ATTENTION_MASK] = image_block_masks(model, kwargs, spans)
    return kwargs


def _refuse_packed(family: str, images: bool, kwargs: dict, positions) -> None:
    """Raises for a packed call that cannot be made exact here (see :func:`multimodal_inputs`)."""
    if any(kwargs.get(key) is not None for key in VIDEO_KEYS):
        raise ValueError(
            f"packed batches with videos are not supported (model_type={family!r}): no family's "
            f"video positions are checked per conversation; {UNPACKED}"
        )
    if isinstance(positions, torch.Tensor) and positions.dim() == 3 and positions.shape[0] != 4:
        raise ValueError(
            f"a packed call of model_type={family!r} got position_ids of shape "
            f"{tuple(positions.shape)}: from multimodal positions without a text row transformers "
            "builds one causal mask over the whole row, so conversations attend to each other; "
            "pass the 2-D position_ids of collators.PackedCollator (they restart at every "
            "conversation) and packed-ce computes each conversation's multimodal positions"
        )
    if images and kwargs.get(INPUT_IDS) is None:
        raise ValueError(
            f"a packed call of model_type={family!r} with images needs input_ids (its image "
            "positions are found from the image tokens), not inputs_embeds"
        )


def _conversation_index(spans, rows: int, width: int, device) -> torch.Tensor:
    """``(B, T)`` int64: each token's conversation, numbered from 0 over the whole batch."""
    lengths = [end - start for row in spans for start, end in row]
    flat = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return flat.view(rows, width).to(device)


def rope_positions(model: nn.Module, kwargs: dict, spans) -> torch.Tensor:
    """``(4, B, T)`` int64 positions of a call: row 0 each conversation's token index (the text
    positions transformers' masks read), rows 1-3 the model's own ``get_rope_index`` of each
    conversation alone (its image tokens' temporal, height and width positions).

    The conversations with image tokens go through one ``get_rope_index`` call, one per row of a
    padded batch (its ``attention_mask`` marks each one's tokens), which takes the
    ``image_grid_thw`` rows in the batch's order of images: the row's order. A conversation
    without images has the text positions on every row, as the model gives it alone.

    Raises:
        ValueError: a conversation's image tokens are not a whole number of ``image_grid_thw``'s
            images (an image cut at a conversation boundary, or grids that do not match).
    """
    input_ids = kwargs[INPUT_IDS]
    rows, width = input_ids.shape
    device = input_ids.device
    config = model.config
    conversation = _conversation_index(spans, rows, width, device)
    starts = torch.tensor([start for row in spans for start, _ in row], device=device)
    text = torch.arange(width, device=device).expand(rows, width) - starts[conversation]
    positions = torch.cat([text[None], text[None].expand(3, rows, width)]).clone()

    grids = kwargs.get(IMAGE_GRID_THW)
    if grids is None:  # no image: the model's own positions are the text positions, as alone
        return positions
    types = kwargs.get(MM_TOKEN_TYPE_IDS)
    if types is None:  # as the processors mark them: 1 at image tokens
        types = (input_ids == config.image_token_id).to(torch.int32)
    image_tokens = types == 1
    merge = config.vision_config.spatial_merge_size
    per_image = (grids.prod(-1) // merge**2).tolist()  # image tokens of each image
    counts = torch.zeros(len(starts), dtype=torch.int64, device=device)
    counts.index_add_(0, conversation.reshape(-1), image_tokens.reshape(-1).to(torch.int64))
    counts = counts.tolist()
    ends = set(torch.tensor(per_image).cumsum(0).tolist()) | {0}
    seen = 0
    for index, count in enumerate(counts):
        seen += count
        if seen not in ends:
            raise ValueError(
                f"conversation {index} of the batch ends after {seen} image tokens, inside an "
                f"image (image_grid_thw gives {per_image} tokens per image): an image was cut at "
                "a conversation boundary, or the grids do not belong to these tokens"
            )
    if seen != sum(per_image):
        raise ValueError(
            f"the batch has {seen} image tokens but image_grid_thw gives {sum(per_image)}: the "
            "grids do not belong to these tokens"
        )
    with_images = [c for c, count in enumerate(counts) if count]
    if not with_images:
        return positions
    flat = [span for row in spans for span in row]
    row_of = [r for r, row in enumerate(spans) for _ in row]
    longest = max(flat[c][1] - flat[c][0] for c in with_images)
    batch_ids = input_ids.new_zeros(len(with_images), longest)
    batch_types = types.new_zeros(len(with_images), longest)
    mask = torch.zeros(len(with_images), longest, dtype=torch.int64, device=device)
    for slot, c in enumerate(with_images):
        (start, end), row = flat[c], row_of[c]
        batch_ids[slot, : end - start] = input_ids[row, start:end]
        batch_types[slot, : end - start] = types[row, start:end]
        mask[slot, : end - start] = 1
    inner = model.base_model
    rope, _ = inner.get_rope_index(
        batch_ids, mm_token_type_ids=batch_types, image_grid_thw=grids, attention_mask=mask
    )
    for slot, c in enumerate(with_images):
        (start, end), row = flat[c], row_of[c]
        positions[1:, row, start:end] = rope[:, slot, : end - start].to(positions.device)
    return positions


def image_block_masks(model: nn.Module, kwargs: dict, spans) -> dict:
    """The masks of a packed call of a family with bidirectional image blocks (Gemma 3), by layer
    type: on every layer a token sees the earlier tokens of its conversation and every token of
    its own image; on sliding layers only those within the window.

    Built by transformers' own mask functions (for the call's attention implementation: sdpa and
    eager tensors, a flex ``BlockMask``), evaluated at the row's own columns: Gemma 3's
    composition, AND(sliding window, OR(causal, image block)), and each conversation apart.
    """
    from transformers import masking_utils

    input_ids = kwargs[INPUT_IDS]
    rows, width = input_ids.shape
    token_types = kwargs[TOKEN_TYPE_IDS]
    conversation = _conversation_index(spans, rows, width, input_ids.device)
    # each run of image tokens (token type 1) one block, -1 for text: Gemma 3's own grouping
    is_image = token_types == 1
    opens = is_image & ~torch.nn.functional.pad(is_image, (1, 0))[:, :-1]
    blocks = torch.where(is_image, opens.cumsum(-1) - 1, -1)
    config = model.config.get_text_config()
    dtype = next(model.parameters()).dtype
    embeds = torch.empty(rows, width, 1, dtype=dtype, device=input_ids.device)  # its shape only
    apart = masking_utils.packed_sequence_mask_function(conversation)
    image = masking_utils.blockwise_overlay(blocks)
    window = masking_utils.sliding_window_overlay(config.sliding_window)
    # positional: the fourth parameter is `cache` in 5.24, `past_key_values` in 5.17
    return {
        "full_attention": masking_utils.create_causal_mask(
            config, embeds, None, None, None, or_mask_function=image, and_mask_function=apart
        ),
        "sliding_attention": masking_utils.create_causal_mask(
            config,
            embeds,
            None,
            None,
            None,
            or_mask_function=image,
            and_mask_function=masking_utils.and_masks(window, apart),
        ),
    }
