"""Tokenizing a data set of conversations: every row through ``tokenize_conversation`` (or, given
the model's processor, ``tokenize_vision_conversation``), with its template columns, written to a
cache reused only for the same inputs; a streamed data set as it is read.
"""

from __future__ import annotations

import logging

from packed_ce.columns import IMAGES, INPUT_IDS, LABELS

from . import cache
from .arrow_rows import progress_unit
from .chat import (
    LABELS_VERSION,
    TEMPLATE_COLUMNS,
    conversations_column,
    system_column,
    template_inputs,
    tokenize_conversation,
    with_system_prompt,
)
from .checks import positive_int
from .images import row_images
from .vision import is_processor, tokenize_images, vision_rows

logger = logging.getLogger(__name__)


def tokenize_dataset(
    dataset,
    tokenizer,
    *,
    max_length: int | None = None,
    messages_column: str = "messages",
    skip_no_assistant: bool = True,
    num_proc: int | None = None,
    cache_file_name: str | None = None,
    load_from_cache_file: bool | None = None,
    **kwargs,
):
    """Tokenize every conversation of a ``datasets.Dataset`` with ``tokenize_conversation``, or
    with ``tokenize_vision_conversation`` given the model's processor (conversations with images).

    A row's ``tools``, ``documents`` and ``chat_template_kwargs`` columns (:data:`TEMPLATE_COLUMNS`)
    go to its chat template as trl's ``SFTTrainer`` passes them (:func:`template_inputs`), and a
    ``system`` or ``system_prompt`` column opens its messages as a system turn: the tokens and
    labels are those of ``PackedSFTTrainer`` for the same row.

    The tokens are written with ``datasets.Dataset.map`` to a cache beside the data set's files (or
    ``cache_file_name``), reused only if it was written for exactly these inputs: the data's
    fingerprint, the tokenizer, its chat template, ``max_length``, the other options and the
    labelling's version. A ``datasets.IterableDataset`` (a streamed data set) is tokenized as it
    is read, with no cache: ``collators.pack_dataset`` or ``pack_stream`` packs it then.

    Args:
        dataset: a ``datasets.Dataset`` or ``datasets.IterableDataset`` with a column of
            conversations in the ``messages`` format; with a processor, their images in an
            ``images`` column (or ``image``) and/or in their image parts
            (``collators.images``).
        tokenizer: any ``transformers.PreTrainedTokenizerBase`` with a chat template, or a
            ``transformers`` processor (``AutoProcessor``): then the rows get an ``images``
            column, each conversation's images in the order of their tokens.
        max_length: keep the first ``max_length`` tokens (unset when packing: ``pack_dataset``
            counts over-long conversations itself); with images, cut before the first image that
            does not fit whole.
        messages_column: the column of conversations.
        skip_no_assistant: drop (and count in a warning; for a stream, one per batch that drops
            some) or, with ``False``, refuse conversations without an assistant turn.
        num_proc: processes for ``datasets.Dataset.map`` (not for a stream).
        cache_file_name: where to write the tokens (``datasets.Dataset.map``'s argument); a file
            written for other inputs is written anew (not for a stream).
        load_from_cache_file: reuse tokens written for the same inputs (default: unless caching is
            disabled in ``datasets``; not for a stream).
        **kwargs: passed to ``tokenize_conversation`` (``tools``, ``chat_template``,
            ``ignore_index``, template variables), for every row.

    Returns:
        a data set of ``dataset``'s kind with ``input_ids`` and ``labels`` in place of
        ``messages_column`` and the template's columns (and ``images`` in place of the image
        columns), other columns kept, one row per kept conversation, in order.

    Example:
        >>> from datasets import Dataset
        >>> from collators import load_default_tokenizer, tokenize_dataset
        >>> conversations = Dataset.from_dict({"messages": [
        ...     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        ...     [{"role": "user", "content": "Anyone there?"}],
        ... ]})
        >>> tokenized = tokenize_dataset(conversations, load_default_tokenizer())
        >>> tokenized.num_rows, tokenized.column_names
        (1, ['input_ids', 'labels'])
    """
    import datasets
    from datasets.fingerprint import Hasher

    if max_length is not None:
        positive_int(max_length, "max_length")
    stream = isinstance(dataset, datasets.IterableDataset)
    if not stream and not isinstance(dataset, datasets.Dataset):
        raise TypeError(
            "`dataset` must be a datasets.Dataset or datasets.IterableDataset, got "
            f"{type(dataset).__name__}."
        )
    if stream:
        given = {"num_proc": num_proc, "cache_file_name": cache_file_name}
        given["load_from_cache_file"] = load_from_cache_file
        for option in (name for name, value in given.items() if value is not None):
            raise ValueError(
                f"`{option}` is for a datasets.Dataset: a datasets.IterableDataset is tokenized as "
                "it is read, with no processes or cache of its own; leave it out."
            )
    names = dataset.column_names
    if names is None:  # an IterableDataset may not know its columns before its first row
        first = next(iter(dataset), None)
        names = list(first) if first is not None else [messages_column]
    if messages_column not in names:
        found = conversations_column(dataset, names)
        hint = f": pass messages_column={found!r}" if found else ""
        raise ValueError(
            f"`dataset` has no column {messages_column!r}; its columns are {names}{hint}."
        )
    taken = [name for name in (INPUT_IDS, LABELS, "_kept") if name in names]
    if taken:
        raise ValueError(
            f"`dataset` already has the column(s) {taken}, which tokenize_dataset writes: remove "
            "or rename them."
        )
    rendered = [name for name in TEMPLATE_COLUMNS if name in names]
    system = system_column(names)
    given = [name for name in rendered if name in kwargs]
    if given:
        raise ValueError(
            f"`{given[0]}` is given to tokenize_dataset and `dataset` has a {given[0]!r} column, "
            "which gives each row's: keep one of them."
        )
    vision = is_processor(tokenizer)
    removed, features = [messages_column, *rendered, *([system] if system else [])], None
    if vision:
        dataset, replaced, features = vision_rows(dataset, messages_column)
        removed += [name for name in replaced if name not in removed]

    def tokenize_batch(batch, indices):
        out = {INPUT_IDS: [], LABELS: [], "_kept": []}
        if vision:
            out[IMAGES] = []
        for index, messages in enumerate(batch[messages_column]):
            where = f"`dataset` row {indices[index]}"
            if system is not None:
                messages = with_system_prompt(messages, batch[system][index], where)
            row = template_inputs({name: batch[name][index] for name in rendered})
            clash = sorted(row.keys() & kwargs.keys())
            if clash:
                raise ValueError(
                    f"`dataset`'s chat_template_kwargs give {clash}, which are also given to "
                    "tokenize_dataset: keep one of them."
                )
            if vision:
                images = row_images({name: batch[name][index] for name in replaced})
                example = tokenize_images(
                    tokenizer,
                    messages,
                    images,
                    f"dataset[{indices[index]}]",
                    max_length=max_length,
                    skip_no_assistant=skip_no_assistant,
                    **kwargs,
                    **row,
                )
            else:
                try:
                    example = tokenize_conversation(
                        tokenizer,
                        messages,
                        max_length=max_length,
                        skip_no_assistant=skip_no_assistant,
                        **kwargs,
                        **row,
                    )
                except ValueError as error:  # which conversation
                    raise ValueError(f"{where}: {error}") from None
            out["_kept"].append(example is not None)
            out[INPUT_IDS].append(example[INPUT_IDS] if example else [])
            out[LABELS].append(example[LABELS] if example else [])
            if vision:
                out[IMAGES].append(example[IMAGES] if example else [])
        skipped = out["_kept"].count(False)
        if stream and skipped:  # a stream's total is never known: each batch says what it drops
            logger.warning(
                "Skipped %d of %d streamed conversations that have no assistant turn.",
                skipped,
                len(out["_kept"]),
            )
        return out

    if stream:
        tokenized = dataset.map(
            tokenize_batch, batched=True, with_indices=True, remove_columns=removed
        )
        kept = tokenized.filter(lambda flags: flags, input_columns="_kept", batched=True)
        return kept.remove_columns("_kept")
    # Every input the tokens depend on; the code of tokenize_conversation through LABELS_VERSION.
    template = kwargs.get("chat_template") or getattr(tokenizer, "chat_template", None)
    key = Hasher.hash(
        (
            getattr(dataset, "_fingerprint", None),
            tokenizer,
            template,
            max_length,
            messages_column,
            skip_no_assistant,
            sorted(kwargs.items()),
            LABELS_VERSION,
        )
    )
    if cache_file_name is not None and not cache.reusable(cache_file_name, key):
        load_from_cache_file = False  # removed: written for other inputs
    with progress_unit(" conversations"):
        tokenized = dataset.map(
            tokenize_batch,
            batched=True,
            with_indices=True,
            remove_columns=removed,
            features=features,
            num_proc=num_proc,
            desc="Tokenizing",
            new_fingerprint=key,
            cache_file_name=cache_file_name,
            load_from_cache_file=load_from_cache_file,
        )
    if cache_file_name is not None:
        cache.record(cache_file_name, key)
    kept = tokenized["_kept"]
    num_skipped = len(kept) - sum(kept)
    if num_skipped:
        logger.warning(
            "Skipped %d of %d conversations that have no assistant turn.", num_skipped, len(kept)
        )
        tokenized = tokenized.filter(lambda flags: flags, input_columns="_kept", batched=True)
    return tokenized.remove_columns("_kept")
