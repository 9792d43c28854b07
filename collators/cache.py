"""Cache files reused only for exactly the inputs they were written for.

``datasets.Dataset.map`` reuses an existing ``cache_file_name`` without looking at any fingerprint,
so a second call with other data or options would return the first call's rows. A key file beside
the cache (``<file>.key``) records the inputs it was written for; a cache without a matching one is
removed (with the shards ``num_proc`` wrote) before ``map`` runs, so it is written anew.
"""

from __future__ import annotations

import os
import re
import tempfile

# ``map``'s names for the shards of ``num_proc`` processes: ``<stem>_00000_of_00002<ext>``.
_SHARD = re.compile(r"_\d{5}_of_\d{5}")


def _key_file(path: str) -> str:
    return f"{path}.key"


def _files(path: str) -> list[str]:
    """``path`` and its shards, those that exist."""
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    found = [path] if os.path.exists(path) else []
    if os.path.isdir(folder):
        found += [
            os.path.join(folder, other)
            for other in sorted(os.listdir(folder))
            if other.startswith(stem)
            and other.endswith(ext)
            and _SHARD.fullmatch(other[len(stem) : len(other) - len(ext)])
        ]
    return found


def remove(path: str) -> None:
    """Remove the cache at ``path``: the file, its shards and its key file."""
    for file in _files(path) + [_key_file(path)]:
        if os.path.exists(file):
            os.remove(file)


def reusable(path: str, key: str) -> bool:
    """Whether the cache at ``path`` was written for ``key``; if it was not, it is removed."""
    try:
        with open(_key_file(path), encoding="utf-8") as handle:
            if handle.read() == key:
                return True
    except FileNotFoundError:
        pass
    remove(path)
    return False


def record(path: str, key: str) -> None:
    """Record that the cache at ``path`` is for ``key`` (written then renamed: never half a key)."""
    folder = os.path.dirname(os.path.abspath(path))
    with tempfile.NamedTemporaryFile(
        "w", dir=folder, suffix=".tmp", delete=False, encoding="utf-8"
    ) as handle:
        handle.write(key)
    os.replace(handle.name, _key_file(path))
