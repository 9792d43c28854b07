"""Conversations with images to tokens and labels, with the model's processor.

The conversation is rendered by the processor's chat template (one placeholder per image part) and
labelled as text is (``collators.chat.label_conversation``: assistant turns trained); the processor
then expands each placeholder to the model's image tokens. The labels follow the text onto the
expanded tokens by their offsets: a token of the expanded text outside the processor's replacements
takes the label of the same token of the text, and the replacements' tokens (the image tokens, and
what the processor writes around them) are never targets. Both renders tokenize the same text
outside the replacements; a processor that changes a trained token next to an image is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from packed_ce.columns import IGNORE_INDEX, IMAGES, INPUT_IDS, LABELS

from .chat import label_conversation
from .checks import positive_int
from .images import IMAGE_COLUMN, open_image, with_images


def is_processor(processing_class) -> bool:
    """Whether ``processing_class`` is a transformers processor (a tokenizer and image handling)."""
    from transformers import ProcessorMixin

    return isinstance(processing_class, ProcessorMixin)


def check_processor(processor, name: str = "processor") -> None:
    """TypeError naming ``name`` unless ``processor`` is a transformers processor."""
    if not is_processor(processor):
        raise TypeError(
            f"`{name}` must be the model's transformers processor (AutoProcessor), which expands "
            f"the image placeholders, got {type(processor).__name__}: load it with "
            "AutoProcessor.from_pretrained(...), or tokenize text with a tokenizer through "
            "collators.tokenize_conversation and collate it with PackedCollator."
        )


def vision_rows(dataset, messages_column: str):
    """A data set ready for ``tokenize_dataset`` with a processor.

    Returns:
        ``(dataset, removed, features)``: ``dataset`` with its image columns read as stored (a
        ``datasets.Dataset``'s ``Image`` columns not decoded: the tokenized rows keep each image
        as it was stored, not encoded again), the columns the tokenized rows replace (the
        messages and the image columns), and the features of the tokenized rows (None for an
        ``IterableDataset``, whose columns may be unknown before it is read).
    """
    import datasets

    names = dataset.column_names or []
    image_columns = [name for name in (IMAGES, IMAGE_COLUMN) if name in names]
    removed = [messages_column, *image_columns]
    if not isinstance(dataset, datasets.Dataset):
        return dataset, removed, None
    listing = getattr(datasets, "List", datasets.Sequence)  # datasets < 4 has Sequence only
    for name in image_columns:
        feature = dataset.features[name]
        if isinstance(feature, datasets.Image):
            dataset = dataset.cast_column(name, datasets.Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), datasets.Image):
            dataset = dataset.cast_column(name, listing(datasets.Image(decode=False)))
    kept = {name: f for name, f in dataset.features.items() if name not in removed}
    tokens = listing(datasets.Value("int64"))
    features = datasets.Features(
        {
            **kept,
            INPUT_IDS: tokens,
            LABELS: tokens,
            "_kept": datasets.Value("bool"),
            IMAGES: listing(datasets.Image()),
        }
    )
    return dataset, removed, features


def tokenize_vision_conversation(
    processor,
    messages: Sequence[Mapping[str, Any]],
    images: Sequence | None = None,
    *,
    max_length: int | None = None,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    skip_no_assistant: bool = False,
    assistant_only: bool = True,
    ignore_index: int = IGNORE_INDEX,
    **template_kwargs,
) -> dict | None:
    r"""Tokenize one conversation with images and label its assistant turns.

    Args:
        processor: the model's ``transformers`` processor (``AutoProcessor``), whose ``__call__``
            reports where it expands the image placeholders (``return_text_replacement_offsets``,
            transformers 5) and whose tokenizer is a fast one.
        messages: ``[{"role": ..., "content": ...}, ...]``; content a string or a list of parts
            ``{"type": "text", "text": ...}`` / ``{"type": "image"}`` (or with its image:
            ``"image"``, ``"path"``).
        images: the images of the ``{"type": "image"}`` parts, in order (``PIL`` images, local
            paths, encoded bytes or ``{"bytes": ..., "path": ...}``); with plain-string messages
            they go before the first user turn's text, as trl puts them.
        max_length: keep at most ``max_length`` tokens, cut before the first image that does not
            fit whole (the images after the cut are left out).
        tools, chat_template, **template_kwargs: for the template (default: the processor's).
        skip_no_assistant: return None instead of raising for a conversation without an
            assistant turn.
        assistant_only: train the assistant turns (default), or every token but the images'.
        ignore_index: the label of untrained tokens.

    Returns:
        ``{"input_ids", "labels", "images"}``: the processor's tokens, their labels (the image
        tokens never trained) and the conversation's images (RGB ``PIL`` images) in order; or None
        for a skipped conversation.

    Raises:
        ValueError: the messages' image parts and ``images`` do not match, an image cannot be
            opened, a processor that does not report its replacements, a trained token changed by
            an image's expansion; and those of :func:`collators.tokenize_conversation`.

    Example:
        >>> from collators import load_default_processor, tokenize_vision_conversation
        >>> from PIL import Image
        >>> processor = load_default_processor("qwen2_vl")
        >>> messages = [
        ...     {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]},
        ...     {"role": "assistant", "content": "Red"},
        ... ]
        >>> example = tokenize_vision_conversation(
        ...     processor, messages, [Image.new("RGB", (28, 28), "red")]
        ... )
        >>> processor.tokenizer.decode(example["input_ids"])
        '<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n<|im_start|>assistant\nRed<|im_end|>\n'
        >>> processor.tokenizer.decode([t for t in example["labels"] if t != -100])
        'Red<|im_end|>'
    """
    example = tokenize_images(
        processor,
        messages,
        images,
        "messages",
        max_length=max_length,
        tools=tools,
        chat_template=chat_template,
        skip_no_assistant=skip_no_assistant,
        assistant_only=assistant_only,
        ignore_index=ignore_index,
        **template_kwargs,
    )
    if example is None:
        return None
    example[IMAGES] = [open_image(image, "messages") for image in example[IMAGES]]
    return example


def tokenize_images(
    processor,
    messages,
    images,
    name: str,
    *,
    max_length: int | None = None,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    skip_no_assistant: bool = False,
    assistant_only: bool = True,
    ignore_index: int = IGNORE_INDEX,
    **template_kwargs,
) -> dict | None:
    """:func:`tokenize_vision_conversation`, its images as given (unopened); ``name`` names the
    conversation in errors.
    """
    check_processor(processor)
    if max_length is not None:
        positive_int(max_length, "max_length")
    messages, given = with_images(messages, list(images or []), name)
    opened = [open_image(image, name) for image in given]
    tokenizer = processor.tokenizer
    template = chat_template or getattr(processor, "chat_template", None)
    labelled = label_conversation(
        tokenizer,
        messages,
        tools=tools,
        chat_template=template,
        skip_no_assistant=skip_no_assistant,
        ignore_index=ignore_index,
        **template_kwargs,
    )
    if labelled is None:
        return None
    text, text_ids, text_labels = labelled
    if not assistant_only:  # every token but the images': set below, past the images' spans
        text_labels = [ignore_index] * len(text_ids)
    encoded = processor(
        text=[text],
        images=opened or None,
        return_offsets_mapping=True,
        return_text_replacement_offsets=True,
        add_special_tokens=False,
    )
    if encoded.get("text_replacement_offsets") is None and opened:
        raise ValueError(
            f"{type(processor).__name__} does not report where it expands the image placeholders "
            "(text_replacement_offsets, transformers 5): the labels cannot follow the text onto "
            "the image tokens; upgrade transformers."
        )
    input_ids = [int(t) for t in encoded[INPUT_IDS][0]]
    labels, image_spans = _follow_labels(
        tokenizer, (text, text_ids, text_labels), encoded, ignore_index, name
    )
    if not assistant_only:
        labels = list(input_ids)
        for start, end in image_spans:
            labels[start:end] = [ignore_index] * (end - start)
    if max_length is not None and len(input_ids) > max_length:
        cut = max_length
        for start, end in image_spans:
            if start < cut < end:
                cut = start  # never cut an image: it goes whole, or not at all
        kept = sum(end <= cut for _, end in image_spans)
        input_ids, labels, given = input_ids[:cut], labels[:cut], given[:kept]
    return {INPUT_IDS: input_ids, LABELS: labels, IMAGES: given}


def _follow_labels(
    tokenizer, labelled: tuple, encoded, ignore_index: int, name: str
) -> tuple[list[int], list[tuple[int, int]]]:
    """The labels of the processor's tokens, from the text's, and each image's token span.

    Args:
        labelled: ``(text, input_ids, labels)`` of the rendered conversation
            (``label_conversation``).
        encoded: the processor's output for ``text`` with ``offset_mapping`` (its tokens'
            characters in the expanded text) and ``text_replacement_offsets`` (each placeholder's
            characters in ``text``, ``span``, and its replacement's in the expanded text,
            ``new_span``).

    Returns:
        ``labels`` (``ignore_index`` where untrained) and ``[(first, end)]`` token spans of each
        image.
    """
    text, text_ids, text_labels = labelled
    input_ids = [int(t) for t in encoded[INPUT_IDS][0]]
    offsets = np.asarray(encoded["offset_mapping"][0], dtype=np.int64).reshape(-1, 2)
    replacements = (encoded.get("text_replacement_offsets") or [[]])[0]
    spans = [r["new_span"] for r in replacements]
    placeholders = [r["span"] for r in replacements]
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(encoding[INPUT_IDS]) != list(text_ids):
        raise ValueError(
            f"`{name}`: the tokenizer tokenizes the rendered conversation otherwise than the chat "
            "template's tokens; its labels cannot be placed."
        )
    text_offsets = [tuple(span) for span in encoding["offset_mapping"]]
    by_span = {span: index for index, span in enumerate(text_offsets)}
    flags = np.zeros(len(text), dtype=bool)  # the characters of trained tokens
    for (start, end), label in zip(text_offsets, text_labels):
        if label != ignore_index:
            flags[start:end] = True
    trained = np.concatenate(([0], np.cumsum(flags)))  # trained characters before each one

    starts = np.array([s for s, _ in spans], dtype=np.int64)
    ends = np.array([e for _, e in spans], dtype=np.int64)
    growth = (ends - starts) - np.array([e - s for s, e in placeholders], dtype=np.int64)
    shift_before = np.concatenate(([0], np.cumsum(growth)))
    first, last = offsets[:, 0], offsets[:, 1]
    # the first replacement ending after each token starts, and whether the token overlaps it
    k = np.searchsorted(ends, first, side="right")
    inside = k < len(spans)
    k_in = np.minimum(k, max(len(spans) - 1, 0))
    if len(spans):
        inside &= (last > starts[k_in]) | ((last == first) & (first >= starts[k_in]))
    else:
        inside[:] = False
    shift = shift_before[k]

    labels = [ignore_index] * len(input_ids)
    image_spans: list[list[int]] = [[-1, -1] for _ in spans]
    matched = set()
    for t, token in enumerate(input_ids):
        if inside[t]:
            span = image_spans[k[t]]
            span[0] = t if span[0] < 0 else span[0]
            span[1] = t + 1
            continue
        a, b = int(first[t] - shift[t]), int(last[t] - shift[t])
        index = by_span.get((a, b))
        if index is not None and text_ids[index] == token:
            labels[t] = text_labels[index]
            matched.add(index)
        elif trained[min(b, len(text))] - trained[min(a, len(text))] > 0:
            raise ValueError(
                f"`{name}`: the processor's expansion of an image changes a trained token next to "
                f"it (characters {a}..{b} of the rendered conversation): put the image in another "
                "part of the turn, or leave it out of the assistant turns."
            )
    in_placeholder = np.zeros(len(text) + 1, dtype=bool)
    for s, e in placeholders:
        in_placeholder[s:e] = True
    lost = [
        i
        for i, (label, (s, e)) in enumerate(zip(text_labels, text_offsets))
        if label != ignore_index and i not in matched and not in_placeholder[s:e].any()
    ]
    if lost:
        raise ValueError(
            f"`{name}`: {len(lost)} trained tokens of the rendered conversation are not among the "
            "processor's tokens; the labels cannot follow them."
        )
    return labels, [tuple(span) for span in image_spans]
