"""Collators for packed multi-turn conversations with exact sequence boundaries.

From conversations to batches: ``tokenize_conversation`` / ``tokenize_dataset`` (assistant-only
labels), ``pack_dataset`` / ``pack_stream`` / ``PackedIterableDataset`` (best-fit-decreasing
packing), ``PackedCollator`` / ``PaddedCollator`` (batches with ``cu_seqlens``), ``shard_batch`` (a
context-parallel rank's share of a packed batch), and offline defaults (``load_default_dataset``,
``load_default_tokenizer``) plus ``load_messages_dataset`` for other data. Conversations with
images: ``tokenize_dataset`` / ``tokenize_vision_conversation`` with the model's processor,
``pack_dataset``, ``VisionCollator``; offline, ``load_default_processor`` and
``load_default_image_dataset``.
"""

from .chat import tokenize_conversation
from .collate import PackedCollator, PaddedCollator
from .data import load_default_dataset, load_default_tokenizer, load_messages_dataset
from .packing import pack_dataset
from .planning import PackingStats
from .processors import load_default_image_dataset, load_default_processor
from .sharding import shard_batch
from .streaming import PackedIterableDataset, pack_stream
from .tokenize_data import tokenize_dataset
from .vision import tokenize_vision_conversation
from .vision_collate import VisionCollator

__all__ = [
    "PackedCollator",
    "PackedIterableDataset",
    "PackingStats",
    "PaddedCollator",
    "VisionCollator",
    "load_default_dataset",
    "load_default_image_dataset",
    "load_default_processor",
    "load_default_tokenizer",
    "load_messages_dataset",
    "pack_dataset",
    "pack_stream",
    "shard_batch",
    "tokenize_conversation",
    "tokenize_dataset",
    "tokenize_vision_conversation",
]
