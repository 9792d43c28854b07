"""The demo's data: conversations and tokenizer, packing, and splitting packed rows back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any


def load_data(dataset: str | None, tokenizer: str | None):
    """The conversations and tokenizer of ``--dataset`` and ``--tokenizer`` (None: the defaults)."""
    from transformers import AutoTokenizer

    import collators

    messages = (
        collators.load_default_dataset()
        if dataset is None
        else collators.load_messages_dataset(dataset)
    )
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
