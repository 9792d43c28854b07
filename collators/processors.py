"""Offline processors and images: vision-language examples and tests without a model hub.

``load_default_processor`` builds a family's own ``transformers`` processor around the default
tokenizer (``load_default_tokenizer``, with the family's image tokens added) and the family's PIL
image processor (no torchvision), with small images; ``load_default_image_dataset`` generates
conversations about coloured shapes with their images. ``packed_ce.integrations.tiny_vision_lm``
builds a tiny model of the family that matches the processor.
"""

from __future__ import annotations

from .checks import positive_int

# The chat template of the default processors: ChatML, a message's content a string or a list of
# text and image parts, one placeholder per image part (written for this package; no generation
# markers, like the Qwen-VL templates, so the assistant turns are found by rendering).
_VISION_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{- '@IMAGE@' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
_QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# model_type -> (processor class and its module, the image markup of the template)
_FAMILIES = {
    "qwen2_vl": ("qwen2_vl", "Qwen2VLProcessor", _QWEN_IMAGE),
    "qwen2_5_vl": ("qwen2_5_vl", "Qwen2_5_VLProcessor", _QWEN_IMAGE),
    "qwen3_vl": ("qwen3_vl", "Qwen3VLProcessor", _QWEN_IMAGE),
    "qwen3_vl_moe": ("qwen3_vl", "Qwen3VLProcessor", _QWEN_IMAGE),
    "qwen3_5": ("qwen3_vl", "Qwen3VLProcessor", _QWEN_IMAGE),
    "qwen3_5_moe": ("qwen3_vl", "Qwen3VLProcessor", _QWEN_IMAGE),
    "gemma3": ("gemma3", "Gemma3Processor", "<start_of_image>"),
    "llava": ("llava", "LlavaProcessor", "<image>\\n"),
}
# The image sizes of the default processors, small enough for tests: Qwen's patches of 14 merged
# 2 x 2 (one image token per 28 x 28 pixels, 1 to 4 tokens per image); Gemma 3's and LLaVA's
# 28 x 28 images in patches of 7 (4 tokens per image pooled for Gemma 3, 16 for LLaVA).
QWEN_PIXELS = (28 * 28, 56 * 56)
IMAGE_SIDE = 28
PATCH = 7
GEMMA3_IMAGE_TOKENS = 4


def vision_families() -> tuple[str, ...]:
    """The ``model_type`` values :func:`load_default_processor` builds."""
    return tuple(_FAMILIES)


def load_default_processor(model_type: str = "qwen2_vl", *, cache_dir: str | None = None):
    """The family's ``transformers`` processor around the default tokenizer, built offline.

    Args:
        model_type: ``"qwen2_vl"``, ``"qwen2_5_vl"``, ``"qwen3_vl"``, ``"qwen3_vl_moe"``,
            ``"qwen3_5"``, ``"qwen3_5_moe"``, ``"gemma3"`` or ``"llava"``.
        cache_dir: where the default tokenizer is kept (``load_default_tokenizer``).

    Returns:
        the processor (``Qwen2VLProcessor``, ..., ``Gemma3Processor``, ``LlavaProcessor``) with a
        ChatML template whose image parts render the family's placeholder. The Qwen processors
        are built without a video processor (which needs torchvision): they take images only.

    Raises:
        ValueError: another ``model_type``.

    Example:
        >>> from collators import load_default_processor
        >>> processor = load_default_processor("qwen2_vl")
        >>> type(processor).__name__, processor.image_token
        ('Qwen2VLProcessor', '<|image_pad|>')
    """
    import importlib

    from transformers import PreTrainedTokenizerFast

    from .data import load_default_tokenizer

    if model_type not in _FAMILIES:
        raise ValueError(
            f"`model_type` must be one of {', '.join(map(repr, _FAMILIES))}, got {model_type!r}."
        )
    module_name, class_name, image_markup = _FAMILIES[model_type]
    module = importlib.import_module(f"transformers.models.{module_name}")
    processor_class = getattr(module, class_name)
    base = load_default_tokenizer(cache_dir=cache_dir)
    template = _VISION_TEMPLATE.replace("@IMAGE@", image_markup)
    special = {"pad_token": base.pad_token, "eos_token": base.eos_token}
    if module_name.startswith("qwen"):
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=base.backend_tokenizer, chat_template=template, **special
        )
        tokenizer.add_special_tokens({"additional_special_tokens": _QWEN_TOKENS})
        from transformers.models.qwen2_vl import Qwen2VLImageProcessorPil

        low, high = QWEN_PIXELS
        images = Qwen2VLImageProcessorPil(min_pixels=low, max_pixels=high, patch_size=14)
        return _without_videos(processor_class)(images, tokenizer, chat_template=template)
    if model_type == "gemma3":
        names = {
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        }
        tokenizer = PreTrainedTokenizerFast(
            tokenizer_object=base.backend_tokenizer,
            chat_template=template,
            extra_special_tokens=names,
            **special,
        )
        images = module.Gemma3ImageProcessorPil(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE})
        return processor_class(
            images, tokenizer, chat_template=template, image_seq_length=GEMMA3_IMAGE_TOKENS
        )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        chat_template=template,
        extra_special_tokens={"image_token": "<image>"},
        **special,
    )
    side = {"height": IMAGE_SIDE, "width": IMAGE_SIDE}
    images = module.LlavaImageProcessorPil(size=side, crop_size=side, do_center_crop=False)
    # CLIP's class token is dropped by the "default" feature selection: one token per patch
    return processor_class(
        images,
        tokenizer,
        chat_template=template,
        patch_size=PATCH,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )


def _without_videos(processor_class):
    """``processor_class`` taking no video processor: transformers checks the class of a video
    processor even when none is given, and that class needs torchvision ("type object
    'VIDEO_PROCESSOR_MAPPING' has no attribute '_extra_content'" without it). A processor's
    sub-processors are the parameters of its ``__init__``, so the subclass leaves it out.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        processor_class.__init__(self, image_processor, tokenizer, None, chat_template, **kwargs)

    return type(processor_class.__name__, (processor_class,), {"__init__": __init__})


_COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (230, 210, 40),
    "purple": (140, 60, 170),
}
_SHAPES = ("square", "circle")


def shape_image(colour: str, shape: str, size: tuple[int, int] = (56, 56)):
    """A ``PIL`` image of a ``colour`` (``red``, ``green``, ``blue``, ``yellow``, ``purple``)
    ``shape`` (``square`` or ``circle``) on white.
    """
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, "white")
    width, height = size
    box = (width // 6, height // 6, width - width // 6, height - height // 6)
    draw = ImageDraw.Draw(image)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=_COLOURS[colour])
    return image


def load_default_image_dataset(num_conversations: int = 64, *, seed: int = 0):
    """Conversations about generated images, in trl's format, deterministic for ``seed``.

    Each conversation shows one to three images of coloured shapes (28 to 56 pixels a side) and
    asks and answers about them over one or two user turns; every fifth has no image.

    Returns:
        ``datasets.Dataset`` of ``messages`` (content parts ``{"type": "image"}`` and
        ``{"type": "text", "text": ...}``), ``images`` (``PIL`` images) and ``source``
        (``"shapes"`` or ``"text"``).

    Example:
        >>> from collators import load_default_image_dataset
        >>> dataset = load_default_image_dataset(8)
        >>> dataset.num_rows, len(dataset[0]["images"])
        (8, 1)
        >>> dataset[0]["messages"][1]["content"][0]["text"]
        'It is a red square.'
    """
    import datasets
    import numpy as np

    positive_int(num_conversations, "num_conversations")
    rng = np.random.default_rng(seed)
    colours, rows = list(_COLOURS), {"messages": [], "images": [], "source": []}
    for index in range(num_conversations):
        count = 0 if index % 5 == 4 else 1 + index % 3
        picks = [
            (colours[(index + 2 * k) % len(colours)], _SHAPES[(index + k) % 2])
            for k in range(count)
        ]
        sizes = [tuple(int(s) for s in rng.choice([28, 42, 56], size=2)) for _ in picks]
        images = [shape_image(colour, shape, size) for (colour, shape), size in zip(picks, sizes)]
        described = [f"a {colour} {shape}" for colour, shape in picks]
        if count == 1:
            question, answer = "What is in the picture?", f"It is {described[0]}."
        elif count:
            question = "What do these pictures show?"
            ordinals = ("first", "second", "third")
            answer = ", the ".join(f"{ordinals[k]} is {d}" for k, d in enumerate(described))
            answer = f"The {answer}."
        else:
            question, answer = "Name a colour.", f"{colours[index % len(colours)].title()}."
        user = [{"type": "image", "text": None}] * count + [{"type": "text", "text": question}]
        messages = [
            {"role": "user", "content": user},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        if index % 2:
            messages += [
                {"role": "user", "content": [{"type": "text", "text": "Thanks!"}]},
                {"role": "assistant", "content": [{"type": "text", "text": "You are welcome."}]},
            ]
        rows["messages"].append(messages)
        rows["images"].append(images)
        rows["source"].append("shapes" if count else "text")
    return datasets.Dataset.from_dict(rows)
