"""The demo's data: conversations and tokenizer, packing, and splitting packed rows back."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

# What to pass instead of a hub name that cannot be loaded offline, per command-line flag.
LOCAL_HINTS = {
    "--dataset": "a local .json/.jsonl file with a 'messages' column (--dataset ./chats.jsonl), or "
    "no --dataset for the offline default corpus",
    "--tokenizer": "a local tokenizer folder (--tokenizer ./my-tokenizer, as saved by "
    "save_pretrained), or no --tokenizer for the offline default",
    "--model-config": "a local JSON file of configuration fields (--model-config ./model.json), "
    "or no --model-config for the default tiny Llama",
}


@contextmanager
def naming_flag(flag: str, value: str | None) -> Iterator[None]:
    """Errors raised while loading what ``flag`` names come out as a ValueError naming the flag.

    The library names its own arguments (`` `name_or_path` 'x': ...``): that name becomes the
    flag; a message that names nothing (a tokenizer or configuration loader's) gets
    `` `flag` 'value': `` in front. A hub name that could not be loaded while the hub is
    offline (``HF_HUB_OFFLINE=1``, see :func:`offline_unless_reachable`) says so and what to
    pass instead.
    """
    try:
        yield
    except Exception as error:
        # transformers' configurations check their fields with huggingface_hub's validators
        from huggingface_hub.errors import StrictDataclassError

        if not isinstance(error, (ValueError, TypeError, OSError, StrictDataclassError)):
            raise
        text = (str(error).strip().splitlines() or [type(error).__name__])[0]
        if f"`{flag}`" in text:
            raise
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        if offline and value is not None and not Path(value).expanduser().exists():
            text = (
                "not a local path, and not in the local hub cache while the hub is offline "
                f"(unreachable, or HF_HUB_OFFLINE=1 set): pass {LOCAL_HINTS[flag]}"
            )
        named = re.match(r"`\w+` ", text)
        text = f"`{flag}` {text[named.end():]}" if named else f"`{flag}` {value!r}: {text}"
        raise ValueError(text) from error


def offline_unless_reachable(timeout: float = 3.0) -> bool:
    """Puts ``huggingface_hub``, ``transformers`` and ``datasets`` in offline mode (only the
    local cache is read) unless the hub answers a TCP connection within ``timeout`` seconds:
    otherwise a hub name would be retried for half a minute before failing. Behind a proxy
    (``HTTPS_PROXY``) the hub is assumed reachable. Returns whether the hub is offline.
    """
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE") != "1":
        proxied = any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy"))
        endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
        port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
        try:
            if not proxied:
                socket.create_connection((endpoint.hostname, port), timeout=timeout).close()
            return False
        except OSError:
            pass
    # The environment for what is imported later, the constants for what already is.
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    import huggingface_hub

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True
    return True


def load_data(dataset: str | None, tokenizer: str | None):
    """The conversations and tokenizer of ``--dataset`` and ``--tokenizer`` (None: the defaults).

    Raises:
        ValueError naming ``--dataset`` or ``--tokenizer`` (:func:`naming_flag`).
    """
    from transformers import AutoTokenizer

    import collators

    with naming_flag("--dataset", dataset):
        messages = (
            collators.load_default_dataset()
            if dataset is None
            else collators.load_messages_dataset(dataset)
        )
    with naming_flag("--tokenizer", tokenizer):
        if tokenizer is None:
            tok = collators.load_default_tokenizer()
        else:
            tok = AutoTokenizer.from_pretrained(tokenizer)
    return messages, tok


def pack(messages, tokenizer, max_length: int, *, overflow: str = "truncate"):
    """Tokenizes and packs conversations into rows of ``max_length`` tokens.

    Returns:
        ``(packed, stats)``: the packed rows (``datasets.Dataset`` with ``input_ids``, ``labels``,
        ``seq_lengths``) and the ``collators.PackingStats``.
    """
    import collators

    tokenized = collators.tokenize_dataset(messages, tokenizer)
    return collators.pack_dataset(tokenized, max_length, overflow=overflow, return_stats=True)


def split_rows(rows: Sequence[Mapping[str, Sequence[int]]]) -> list[dict[str, list[int]]]:
    """The conversations of packed rows, in order: the inverse of packing.

    Args:
        rows: rows of :func:`collators.pack_dataset` (``input_ids``, ``labels``, ``seq_lengths``).

    Returns:
        One ``{"input_ids", "labels"}`` dict per conversation.

    Example:
        >>> row = {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, -100, 4, 5],
        ...        "seq_lengths": [2, 3]}
        >>> for conversation in split_rows([row]):
        ...     print(conversation)
        {'input_ids': [1, 2], 'labels': [-100, 2]}
        {'input_ids': [3, 4, 5], 'labels': [-100, 4, 5]}
    """
    conversations = []
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            end = start + int(length)
            conversations.append(
                {
                    "input_ids": list(row["input_ids"][start:end]),
                    "labels": list(row["labels"][start:end]),
                }
            )
            start = end
    return conversations


def pack_to_disk(
    *,
    dataset: str | None,
    tokenizer: str | None,
    max_length: int,
    output: str | Path,
    overflow: str = "truncate",
) -> dict[str, Any]:
    """Tokenizes and packs a data set and saves it with ``datasets.Dataset.save_to_disk``.

    Returns:
        The packing statistics (the fields of ``collators.PackingStats`` and ``efficiency``) and
        the output path, as a dict.
    """
    messages, tok = load_data(dataset, tokenizer)
    packed, stats = pack(messages, tok, max_length, overflow=overflow)
    packed.save_to_disk(str(output))
    return {**asdict(stats), "efficiency": stats.efficiency, "output": str(output)}
