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
    "--dataset": "a local file or folder (--dataset ./chats.jsonl; .json, .jsonl, .parquet, "
    ".arrow or a save_to_disk folder), or no --dataset for the offline default corpus",
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
        text = f"`{flag}` {text[named.end() :]}" if named else f"`{flag}` {value!r}: {text}"
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
    import collators

    with naming_flag("--dataset", dataset):
        messages = (
            collators.load_default_dataset()
            if dataset is None
            else collators.load_messages_dataset(dataset)
        )
    return messages, load_tokenizer(tokenizer)


def load_tokenizer(tokenizer: str | None):
    """The tokenizer of ``--tokenizer`` (None: the default); ValueError naming the flag."""
    from transformers import AutoTokenizer

    import collators

    with naming_flag("--tokenizer", tokenizer):
        if tokenizer is None:
            return collators.load_default_tokenizer()
        return AutoTokenizer.from_pretrained(tokenizer)


def load_processor(processor: str | None, dataset: str | None):
    """The processor of ``--tokenizer`` for conversations with images; ValueError naming it."""
    from transformers import AutoProcessor

    from collators.vision import is_processor

    if processor is None:
        raise ValueError(
            f"`--dataset` {dataset!r} has images: name the model's processor with --tokenizer "
            "(a hub name or a folder saved by processor.save_pretrained), which turns them into "
            "the model's image tokens"
        )
    with naming_flag("--tokenizer", processor):
        loaded = AutoProcessor.from_pretrained(processor)
    if not is_processor(loaded):
        raise ValueError(
            f"`--tokenizer` {processor!r} is a tokenizer, and `--dataset` {dataset!r} has "
            "images: name the model's processor (AutoProcessor), which turns them into the "
            "model's image tokens"
        )
    return loaded


def pack(
    conversations,
    tokenizer,
    max_length: int,
    *,
    overflow: str = "truncate",
    num_proc: int | None = None,
):
    """Tokenizes (unless ``tokenizer`` is None: the conversations are already tokenized) and packs
    conversations into rows of ``max_length`` tokens, with ``num_proc`` processes.

    Returns:
        ``(packed, stats)``: the packed rows (``datasets.Dataset`` with ``input_ids``, ``labels``,
        ``seq_lengths``) and the ``collators.PackingStats``.
    """
    import collators

    tokens = conversations
    if tokenizer is not None:
        tokens = collators.tokenize_dataset(conversations, tokenizer, num_proc=num_proc)
    return collators.pack_dataset(
        tokens, max_length, overflow=overflow, return_stats=True, num_proc=num_proc
    )


def load_conversations(dataset: str | None):
    """The data set of ``--dataset`` for ``packed-ce pack``: conversations in the ``messages``
    format or already tokenized (``input_ids`` and ``labels``), from any file or folder that
    :func:`collators.data.read_dataset` reads (None: the default corpus).

    Returns:
        ``(dataset, tokenized)``: the ``datasets.Dataset`` and whether it is tokenized.

    Raises:
        ValueError naming ``--dataset``: unreadable, empty, or neither messages nor tokens.
    """
    import collators
    from collators.chat import conversations_column
    from collators.data import read_dataset
    from packed_ce.columns import INPUT_IDS, LABELS

    with naming_flag("--dataset", dataset):
        if dataset is None:
            return collators.load_default_dataset(), False
        data = read_dataset(dataset)
        columns = data.column_names
        tokens = [name for name in (INPUT_IDS, LABELS) if name in columns]
        if tokens and "messages" in columns:
            raise ValueError(
                f"`name_or_path` {dataset!r} has both 'messages' and {tokens}: keep the "
                "conversations or their tokens"
            )
        if not tokens and "messages" not in columns:
            found = conversations_column(data, columns)
            hint = found and f": its column {found!r} holds conversations, name it 'messages'"
            raise ValueError(
                f"`name_or_path` {dataset!r} has neither a 'messages' column nor 'input_ids' and "
                f"'labels' (tokenized conversations); its columns are {columns}{hint or ''}"
            )
        if len(tokens) == 1:
            missing = LABELS if tokens == [INPUT_IDS] else INPUT_IDS
            raise ValueError(
                f"`name_or_path` {dataset!r} has {tokens[0]!r} but no {missing!r} column"
            )
    return data, bool(tokens)


def split_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The conversations of packed rows, in order: the inverse of packing.

    Args:
        rows: rows of :func:`collators.pack_dataset` (``input_ids``, ``labels``, ``seq_lengths``,
            and the carried columns: ``seq_weights``, ``seq_sources``, ``seq_<name>``).

    Returns:
        One dict per conversation: ``input_ids``, ``labels`` and its carried values under their
        data set names (``weight``, ``source``, ``<name>``).

    Example:
        >>> row = {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, -100, 4, 5],
        ...        "seq_lengths": [2, 3], "seq_weights": [1.0, 0.5]}
        >>> for conversation in split_rows([row]):
        ...     print(conversation)
        {'input_ids': [1, 2], 'labels': [-100, 2], 'weight': 1.0}
        {'input_ids': [3, 4, 5], 'labels': [-100, 4, 5], 'weight': 0.5}
    """
    from packed_ce.columns import SEQ_LENGTHS, SEQ_TARGETS, SEQUENCE_COLUMNS

    names = {column.key: column.column for column in SEQUENCE_COLUMNS}
    conversations = []
    for row in rows:
        # seq_<name> -> <name>; seq_targets (a split conversation's total) is packing's own
        carried = {
            key: names.get(key) or key[len("seq_") :]
            for key in row
            if key.startswith("seq_") and key not in (SEQ_LENGTHS, SEQ_TARGETS)
        }
        start = 0
        for index, length in enumerate(row[SEQ_LENGTHS]):
            end = start + int(length)
            conversation = {
                "input_ids": list(row["input_ids"][start:end]),
                "labels": list(row["labels"][start:end]),
            }
            conversation.update((name, row[key][index]) for key, name in carried.items())
            conversations.append(conversation)
            start = end
    return conversations


def pack_to_disk(
    *,
    dataset: str | None,
    tokenizer: str | None,
    max_length: int,
    output: str | Path,
    overflow: str = "truncate",
    num_proc: int | None = None,
) -> dict[str, Any]:
    """Tokenizes (unless the data are tokenized) and packs a data set and saves it with
    ``datasets.Dataset.save_to_disk``, with ``num_proc`` processes.

    Returns:
        The packing statistics (the fields of ``collators.PackingStats`` and ``efficiency``) and
        the output path, as a dict.

    Raises:
        ValueError naming ``--dataset`` or ``--tokenizer`` (a tokenizer given for tokenized data):
            the trainers' refusals of its weights and sources (every weight 0 included), nothing
            to train.
    """
    from collators.arrow_rows import progress_unit
    from collators.images import IMAGE_COLUMN
    from packed_ce.columns import IMAGES
    from packed_ce.integrations.trainers.data_checks import check_columns

    conversations, tokenized = load_conversations(dataset)
    # the trainers' checks of the weights (every one 0, a range the loss cannot carry) and sources
    check_columns(conversations, "--dataset")
    if tokenized and tokenizer is not None:
        raise ValueError(
            f"`--tokenizer` {tokenizer!r} is not used: `--dataset` is already tokenized "
            "('input_ids', 'labels'); leave --tokenizer out"
        )
    images = bool({IMAGES, IMAGE_COLUMN} & set(conversations.column_names))
    if tokenized:
        tok = None
    elif images:
        tok = load_processor(tokenizer, dataset)
    else:
        tok = load_tokenizer(tokenizer)
    packed, stats = pack(conversations, tok, max_length, overflow=overflow, num_proc=num_proc)
    # tokenize_dataset skips (and logs) conversations without an assistant turn
    skipped = len(conversations) - stats.num_conversations
    trained = stats.num_packed - stats.num_without_targets
    if trained == 0:
        raise ValueError(
            f"`--dataset` {dataset or 'default corpus'!r}: nothing to train, none of its "
            f"{len(conversations)} conversations has a target ({skipped} without an assistant "
            f"turn, {stats.num_without_targets} without an assistant token after packing): "
            "an assistant turn needs the role 'assistant' (rename ShareGPT's 'human' and 'gpt' "
            "to 'user' and 'assistant'), tokenized data labels other than -100"
        )
    with progress_unit(" rows"):
        packed.save_to_disk(str(output), num_proc=num_proc)
    return {
        **asdict(stats),
        "num_skipped_no_assistant": skipped,
        "efficiency": stats.efficiency,
        "output": str(output),
    }
