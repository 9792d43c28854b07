"""A conversation's images: found in its rows and its messages, opened as PIL images.

The formats of trl and ``datasets``: an ``images`` column (or ``image``, one image) whose images go,
in order, to the ``{"type": "image"}`` parts of the messages (trl puts them before the first user
turn's text where the messages are plain strings); an image inside a part (``"image"``, ``"path"``
or ``"url"`` of a local file). An image is a ``PIL.Image.Image``, a local path, encoded bytes, or
``datasets.Image``'s stored form ``{"bytes": ..., "path": ...}``.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping, Sequence
from typing import Any

from packed_ce.columns import IMAGES

IMAGE_COLUMN = "image"  # one image per row (trl's other format)
# The keys of an image part that may hold the image itself.
_INLINE = ("image", "path", "url")


def image_parts(content) -> list[dict]:
    """The image parts (``{"type": "image", ...}``) of a message's content (none in a string)."""
    if isinstance(content, (str, bytes)) or not isinstance(content, Sequence):
        return []
    return [part for part in content if isinstance(part, Mapping) and part.get("type") == "image"]


def row_images(row: Mapping[str, Any]) -> list:
    """The images of a data set row, unopened: its ``images`` list or its ``image``."""
    images = row.get(IMAGES)
    if images is None and row.get(IMAGE_COLUMN) is not None:
        images = [row[IMAGE_COLUMN]]
    return list(images or [])


def with_images(messages: Sequence[Mapping[str, Any]], images: Sequence, name: str):
    """The messages with every image part holding its image, and the images in their order.

    Args:
        messages: the conversation; parts ``{"type": "image"}`` take the next of ``images``, parts
            with an image of their own keep it.
        images: the row's images (``row_images``), in order.
        name: the conversation in errors (``dataset[3]``).

    Returns:
        ``(messages, images)``: new message dicts (content parts as dicts, each image part
        ``{"type": "image"}``: the template renders the placeholder), and the conversation's images
        as given (unopened: ``open_image``) in the order of their parts.

    Raises:
        ValueError naming ``name``: more or fewer images than image parts, a video part.
    """
    videos = [
        index
        for index, message in enumerate(messages)
        if isinstance(message.get("content"), Sequence)
        and not isinstance(message.get("content"), str)
        and any(isinstance(p, Mapping) and p.get("type") == "video" for p in message["content"])
    ]
    if videos:
        raise ValueError(
            f"`{name}` message {videos[0]} has a video part: conversations with videos are not "
            "supported (their positions are not checked per conversation); train them unpacked "
            "with the model's own collator"
        )
    if images and not any(image_parts(m.get("content")) for m in messages):
        messages = _images_first(messages, len(images), name)
    queue = list(images)
    found, out = [], []
    for message in messages:
        content = message.get("content")
        if not image_parts(content):
            out.append(dict(message))
            continue
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "image":
                inline = next((part[key] for key in _INLINE if part.get(key) is not None), None)
                if inline is None:
                    if not queue:
                        raise ValueError(
                            f"`{name}` has more image parts than images ({len(images)})."
                        )
                    inline = queue.pop(0)
                found.append(inline)
                parts.append({"type": "image"})
            else:
                parts.append(dict(part) if isinstance(part, Mapping) else part)
        out.append({**message, "content": parts})
    if queue:
        raise ValueError(
            f"`{name}` has {len(images)} images but only {len(images) - len(queue)} image parts "
            "take one: give each image a {'type': 'image'} part."
        )
    return out, found


def _images_first(messages, count: int, name: str):
    """Plain-string messages with images laid out as trl lays them: the images before the text of
    the first user turn.
    """
    out = [dict(message) for message in messages]
    for message in out:
        if message.get("role") == "user" and isinstance(message.get("content"), str):
            parts = [{"type": "image"} for _ in range(count)]
            message["content"] = parts + [{"type": "text", "text": message["content"]}]
            return out
    raise ValueError(
        f"`{name}` has {count} images but no image part and no user turn of text to put them in: "
        "add {'type': 'image'} parts to its messages."
    )


def open_image(image, name: str):
    """``image`` as an RGB ``PIL.Image.Image``: a PIL image, a local path, encoded bytes or
    ``{"bytes": ..., "path": ...}``.
    """
    from PIL import Image

    if isinstance(image, Mapping):
        image = image.get("bytes") or image.get("path")
    try:
        if isinstance(image, (bytes, bytearray)):
            image = Image.open(io.BytesIO(image))
        elif isinstance(image, (str, os.PathLike)):
            if str(image).startswith(("http://", "https://")):
                raise ValueError("images are read from local files, not fetched")
            image = Image.open(image)
        elif not isinstance(image, Image.Image):
            raise TypeError(f"got {type(image).__name__}")
        return image.convert("RGB")
    except (OSError, ValueError, TypeError) as error:
        raise ValueError(
            f"`{name}` has an image that cannot be opened ({error}): give a PIL image, a local "
            "path, encoded bytes or {'bytes': ..., 'path': ...}."
        ) from None
