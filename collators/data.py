"""Offline data: the English ``chatterbot-corpus`` dialogues and a BPE tokenizer trained on them."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from importlib import metadata, resources
from pathlib import Path

from .checks import positive_int
from .templates import CHATML_TEMPLATE

DEFAULT_VOCAB_SIZE = 3072
_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Bump when the training recipe changes, so a stale cached tokenizer is never picked up.
_TOKENIZER_RECIPE = "bytelevel-bpe-v1"


def require_demo_extra(caller: str) -> None:
    """ImportError naming the ``demo`` extra, not ``PackageNotFoundError`` or a missing ``yaml``."""
    try:
        import chatterbot_corpus  # noqa: F401
        import yaml  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"{caller} needs the `demo` extra (chatterbot-corpus, pyyaml; missing: {error.name}): "
            'pip install "packed-ce[demo]" (from a clone: pip install ".[demo]").'
        ) from None


def load_default_dataset(*, system_prompt: bool = True):
    """The English conversations of the ``chatterbot-corpus`` package as a ``datasets.Dataset``.

    Utterances become alternating ``user`` / ``assistant`` turns (an unanswered last one left out),
    after a system turn naming the category with ``system_prompt=True``.

    Args:
        system_prompt: add the system turn.

    Returns:
        ``datasets.Dataset`` of ``messages`` and ``category`` (str), in a fixed order.

    Raises:
        ImportError naming the ``demo`` extra when it is not installed.

    Example:
        >>> from collators import load_default_dataset
        >>> dataset = load_default_dataset()
        >>> dataset.num_rows
        2026
        >>> [m["role"] for m in dataset[0]["messages"]]
        ['system', 'user', 'assistant']
    """
    import datasets

    require_demo_extra("load_default_dataset")
    rows = {"messages": [], "category": []}
    for category, utterances in _corpus_conversations():
        turns = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": text}
            for i, text in enumerate(utterances[: len(utterances) // 2 * 2])
        ]
        if not turns:
            continue
        if system_prompt:
            turns.insert(
                0,
                {"role": "system", "content": f"You are a friendly assistant. Topic: {category}."},
            )
        rows["messages"].append(turns)
        rows["category"].append(category)
    return datasets.Dataset.from_dict(rows)


def load_default_tokenizer(
    *, vocab_size: int = DEFAULT_VOCAB_SIZE, cache_dir: str | os.PathLike | None = None
):
    """A ChatML-templated byte-level BPE tokenizer trained on the ``chatterbot-corpus`` dialogues.

    Deterministic, about a second, cached in ``cache_dir``, ``$PACKED_CE_CACHE`` or
    ``~/.cache/packed_ce``. Special tokens ``<|endoftext|>`` (padding), ``<|im_start|>``,
    ``<|im_end|>`` (``eos_token``); the template (``collators.templates.CHATML_TEMPLATE``) has
    ``{% generation %}`` markers.

    Args:
        vocab_size: size of the vocabulary, special tokens included (default: 3072).
        cache_dir: where to keep the trained tokenizer.

    Returns:
        ``transformers.PreTrainedTokenizerFast``.

    Raises:
        ImportError naming the ``demo`` extra when it is not installed.

    Example:
        >>> from collators import load_default_tokenizer
        >>> tokenizer = load_default_tokenizer()
        >>> len(tokenizer), tokenizer.pad_token, tokenizer.eos_token
        (3072, '<|endoftext|>', '<|im_end|>')
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    # The byte-level alphabet (256) and the special tokens are the smallest vocabulary.
    positive_int(vocab_size, "vocab_size", minimum=256 + len(_SPECIAL_TOKENS))
    require_demo_extra("load_default_tokenizer")
    corpus_version = metadata.version("chatterbot-corpus")
    key = hashlib.sha256(f"{_TOKENIZER_RECIPE}|{corpus_version}|{vocab_size}".encode()).hexdigest()[
        :16
    ]
    root = Path(
        cache_dir or os.environ.get("PACKED_CE_CACHE") or Path.home() / ".cache" / "packed_ce"
    )
    path = root / f"chatterbot-bpe-{vocab_size}-{key}.json"
    if path.exists():
        backend = Tokenizer.from_file(str(path))
    else:
        backend = _train_tokenizer(vocab_size)
        root.mkdir(parents=True, exist_ok=True)
        # Write then rename: DataLoader workers or parallel test runs may build it at the same time.
        with tempfile.NamedTemporaryFile("w", dir=root, suffix=".tmp", delete=False) as handle:
            handle.write(backend.to_str())
        os.replace(handle.name, path)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
    )


def load_messages_dataset(
    name_or_path: str | os.PathLike,
    *,
    split: str = "train",
    messages_column: str = "messages",
    **kwargs,
):
    r"""A ``messages`` data set from a local file or folder (``read_dataset``) or a hub name.

    Args:
        name_or_path: a ``.json`` / ``.jsonl`` / ``.parquet`` / ``.arrow`` file, a folder of them or
            written by ``save_to_disk``, or a hub name (a local-looking path is never sent to the
            hub).
        split: the split to load.
        messages_column: renamed to ``messages``.
        **kwargs: passed to ``datasets.load_dataset``.

    Returns:
        ``datasets.Dataset`` with a ``messages`` column.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError: empty, a malformed JSON line (named), a file of another format, no
            ``messages_column``.

    Example:
        >>> import json, tempfile
        >>> from collators import load_messages_dataset
        >>> record = {"messages": [
        ...     {"role": "user", "content": "Hi"},
        ...     {"role": "assistant", "content": "Hello"},
        ... ]}
        >>> with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        ...     _ = f.write(json.dumps(record) + "\n")
        >>> load_messages_dataset(f.name)[0]["messages"][1]
        {'role': 'assistant', 'content': 'Hello'}
    """
    dataset = read_dataset(name_or_path, split=split, **kwargs)
    if messages_column not in dataset.column_names:
        raise ValueError(
            f"`name_or_path` {str(name_or_path)!r} has no column {messages_column!r}; "
            f"its columns are {dataset.column_names}."
        )
    if messages_column != "messages":
        dataset = dataset.rename_column(messages_column, "messages")
    return dataset


# The data files read locally, by suffix: the ``datasets`` builder of each.
DATA_FILES = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".arrow": "arrow"}
_FORMATS = ".json, .jsonl, .parquet or .arrow"


def read_dataset(name_or_path: str | os.PathLike, *, split: str = "train", **kwargs):
    """A ``datasets.Dataset`` (any columns, at least one row) from a local file, folder or hub name.

    Local: a ``.json`` / ``.jsonl`` / ``.parquet`` / ``.arrow`` file (Arrow: the stream format of
    ``datasets``' own files, memory-mapped, or the IPC file format), a folder written by
    ``save_to_disk`` (a ``DatasetDict``: its ``split``), or a folder of data files of one format
    (``datasets.load_dataset``, which takes splits from the file names).

    Args:
        name_or_path: the file, folder or hub name.
        split: the split to load.
        **kwargs: passed to ``datasets.load_dataset``.

    Raises:
        FileNotFoundError: a local path that does not exist.
        ValueError naming ``name_or_path``: empty, a malformed file (a JSON line named), a file of
            another format, a folder of no data file or of several formats, a missing split.
    """
    import datasets

    path = local_path(name_or_path, "name_or_path")
    if path is None:
        dataset = datasets.load_dataset(str(name_or_path), split=split, **kwargs)
    elif path.is_dir():
        dataset = _read_folder(path, split, **kwargs)
    else:
        dataset = _read_file(path, split, **kwargs)
    if dataset.num_rows == 0:
        raise ValueError(
            f"`name_or_path` {str(name_or_path)!r} holds no conversation (split {split!r} is "
            "empty)."
        )
    return dataset


def _read_file(path: Path, split: str, **kwargs):
    import datasets
    import pyarrow as pa

    builder = DATA_FILES.get(path.suffix)
    if builder is None:
        raise ValueError(
            f"`name_or_path` {str(path)!r} is not a {_FORMATS} file (nor a folder of them, or a "
            "data set saved with save_to_disk)."
        )
    size = path.stat().st_size
    if size == 0 or (
        builder == "json" and size < 4096 and not path.read_text(encoding="utf-8").strip()
    ):
        raise ValueError(f"`name_or_path` {str(path)!r} is empty: it holds no conversation.")
    try:
        if builder == "arrow":
            try:  # datasets' own format, memory-mapped in place
                return datasets.Dataset.from_file(str(path))
            except pa.ArrowInvalid:  # the IPC file format (Feather v2)
                pass
        return datasets.load_dataset(builder, data_files=str(path), split=split, **kwargs)
    except Exception as error:
        if builder == "json":
            _raise_json_error(path, error)
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"`name_or_path` {str(path)!r} could not be loaded as {builder.title()}: {cause}"
        ) from error


def _read_folder(path: Path, split: str, **kwargs):
    import datasets

    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():
        saved = datasets.load_from_disk(str(path))
        if isinstance(saved, datasets.DatasetDict):
            if split not in saved:
                raise ValueError(
                    f"`name_or_path` {str(path)!r} has no split {split!r}; its splits are "
                    f"{list(saved)}."
                )
            saved = saved[split]
        return saved
    files = [
        f
        for f in sorted(path.rglob("*"))
        if f.is_file()
        and f.suffix in DATA_FILES
        and not any(part.startswith(".") for part in f.relative_to(path).parts)
    ]
    formats = sorted({DATA_FILES[f.suffix] for f in files})
    if not files:
        raise ValueError(
            f"`name_or_path` {str(path)!r} holds no {_FORMATS} file, nor a data set saved with "
            "save_to_disk."
        )
    if len(formats) > 1:
        raise ValueError(
            f"`name_or_path` {str(path)!r} mixes {' and '.join(formats)} files: keep one format."
        )
    try:
        return datasets.load_dataset(str(path), split=split, **kwargs)
    except Exception as error:
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"`name_or_path` {str(path)!r} could not be loaded: {cause}") from error


# Data and model files that a hub name never ends with.
_FILE_SUFFIXES = (
    ".json",
    ".jsonl",
    ".csv",
    ".tsv",
    ".parquet",
    ".arrow",
    ".txt",
    ".yaml",
    ".yml",
    ".gz",
    ".zip",
)
# A hub repository id: ``name`` or ``owner/name``.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def local_path(name_or_path: str | os.PathLike, argument: str) -> Path | None:
    """``name_or_path`` as a local ``Path`` if it names one, None if it is a hub name.

    Local: anything that exists, or that a hub id (``name`` or ``owner/name``) cannot be (absolute,
    ``~`` or ``.``-relative, more than two parts, a backslash, a data or model file suffix).

    Raises:
        FileNotFoundError naming ``argument``: it looks local but does not exist.
    """
    text = os.fspath(name_or_path)
    path = Path(text).expanduser()
    if path.exists():
        return path
    if (
        isinstance(name_or_path, os.PathLike)
        or not _HUB_ID.fullmatch(text)
        or text.lower().endswith(_FILE_SUFFIXES)
    ):
        raise FileNotFoundError(
            f"`{argument}` {text!r}: no such file or folder (looked locally, not on a hub)."
        )
    return None


def _raise_json_error(path: Path, error: Exception):
    """Re-raise a failed JSON load as a ``ValueError`` naming the first malformed line, if any."""
    import json

    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)  # one JSON document: the problem is not its syntax
    except json.JSONDecodeError:
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as line_error:
                    raise ValueError(
                        f"`name_or_path` {str(path)!r} line {number}: malformed JSON "
                        f"({line_error.msg} at column {line_error.colno})."
                    ) from None
    cause = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    raise ValueError(
        f"`name_or_path` {str(path)!r} could not be loaded as JSON: {cause}"
    ) from error


def _corpus_conversations():
    """(category, utterances) for every English conversation of the corpus, files sorted by name."""
    import yaml

    english = resources.files("chatterbot_corpus") / "data" / "english"
    for entry in sorted(english.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".yml"):
            continue
        document = yaml.safe_load(entry.read_text(encoding="utf-8"))
        category = str(document.get("categories", [Path(entry.name).stem])[0])
        for utterances in document.get("conversations") or []:
            yield category, [str(u).strip() for u in utterances]


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Untrimmed offsets: whitespace tokens keep their characters, which the offset-based labelling
    # relies on.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    texts = ["system\nuser\nassistant\ntool\n"]
    texts += ["\n".join(utterances) for _, utterances in _corpus_conversations()]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer
