"""The batch contract: every key a row, a batch or a data set column carries, in one place.

A misspelt key is then a NameError, not a column silently missing. ``SEQUENCE_COLUMNS`` describes
each value a conversation carries into packed rows and batches once; packers, collators, shards and
trainers iterate it.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .weights import check_weight_range, conversation_weight, weight_array

IGNORE_INDEX = -100  # a label that is no target (PyTorch's and transformers' value)

# Tokens, one per position: a tokenised conversation, a packed row, a batch.
INPUT_IDS = "input_ids"
LABELS = "labels"  # aligned with input_ids; IGNORE_INDEX where nothing is learnt
SHIFT_LABELS = "shift_labels"  # already shifted: the target of each token (collators.shard_batch)
POSITION_IDS = "position_ids"  # restart at 0 for each sequence
ATTENTION_MASK = "attention_mask"  # PaddedCollator's (B, T) only: a packed row has none

# A packed row's columns, one value per sequence of the row (SEQUENCE_COLUMNS describes all but the
# lengths).
SEQ_LENGTHS = "seq_lengths"
SEQ_TARGETS = "seq_targets"  # the whole conversation's target count (a split one's pieces share it)
SEQ_WEIGHTS = "seq_weights"
SEQ_SOURCES = "seq_sources"

# Images: a conversation's (data set column, a list of images in the order of its image parts)
# and a batch's (what the model's processor makes of a row's images, in the row's order).
IMAGES = "images"
PIXEL_VALUES = "pixel_values"
IMAGE_GRID_THW = "image_grid_thw"  # (I, 3) int64: each image's grid (the Qwen-VL families)
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"  # (B, T): 1 at image tokens (the Qwen-VL families)
TOKEN_TYPE_IDS = "token_type_ids"  # (B, T): 1 at image tokens (Gemma 3)

# A conversation's optional data set columns, one value per row (packing moves them to
# SEQ_WEIGHTS and SEQ_SOURCES).
WEIGHT_COLUMN = "weight"
SOURCE_COLUMN = "source"

# A batch's sequence boundaries and counts.
CU_SEQLENS = "cu_seqlens"  # int32 (S+1,)
MAX_SEQLEN = "max_seqlen"
NUM_SEQUENCES = "num_sequences"  # sequences with at least one target
# transformers' varlen keywords (flash attention; trl's padding-free batches carry them)
CU_SEQ_LENS_Q = "cu_seq_lens_q"
CU_SEQ_LENS_K = "cu_seq_lens_k"
MAX_LENGTH_Q = "max_length_q"
MAX_LENGTH_K = "max_length_k"
# What a context-parallel shard is (collators.shard_batch): a ShardRecord the model's forward
# checks.
SHARD = "context_parallel_shard"
# A context-parallel call's row layout (who holds which tokens), handed to every layer.
ROW_LAYOUT = "packed_ce_row_layout"
# A packed model call's conversations (packed_ce.layout.PackedLayout), handed to every layer and
# to the loss; built by the packed forward from the public keys above.
LAYOUT = "packed_ce_layout"


def position_restarts(position_ids: torch.Tensor) -> torch.Tensor:
    """Where sequences start under transformers' rule: each row's first token, and wherever
    ``position_ids[t] != position_ids[t - 1] + 1``.

    Args:
        position_ids: ``(B, T)`` or ``(T,)`` integer.

    Returns:
        ``(B * T,)`` bool, True at each sequence's first token.
    """
    positions = position_ids.reshape(-1, position_ids.shape[-1]).to(torch.int64)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts.reshape(-1)


# The trainers' evaluation batches: each example's token count, (B,) int64, to find the copies
# accelerate adds to the last batch (packed_ce.integrations.trainers.evaluation).
EXAMPLE_TOKENS = "example_tokens"


def _check_source(value, name: str):
    if value is not None and not isinstance(value, str):
        raise TypeError(
            f"`{name}` must be None or a string (sources are strings), got {type(value).__name__} "
            f"{value!r}."
        )
    return value


def _check_scalar(value, name: str):
    if isinstance(value, (list, tuple, dict, np.ndarray, torch.Tensor)):
        raise ValueError(
            f"`{name}` holds a {type(value).__name__}, not one value per conversation, so packed "
            "rows cannot carry it (they hold one value per sequence): remove the column or reduce "
            "it to one value per conversation."
        )
    return value


def _check_count(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must hold ints, got {type(value).__name__} {value!r}.")
    if value < 0:
        raise ValueError(f"`{name}` must hold counts >= 0, got {value}.")
    return int(value)


@dataclasses.dataclass(frozen=True)
class SequenceColumn:
    """A value each conversation carries into packed rows and batches, one value per sequence there.

    Packing gives each piece the value of its conversation (the pieces of a split conversation share
    it), in the row column ``key``; collators concatenate the examples' values, ``padding`` for a
    padding segment; ``collators.shard_batch`` gives each local segment the value of the sequence it
    belongs to.

    Attributes:
        column: the data set column, one value per conversation; None: packing computes it.
        key: the packed row's and the batch's key.
        dtype: the batch tensor's dtype (a numpy name: ``"float64"``); None: a Python list.
        padding: the value of a padding segment.
        absent: a batch in which some examples lack it: ``"count"`` (each sequence's own target
            count), ``"refuse"`` (a ValueError naming the example) or ``"pad"`` (``padding`` for
            theirs).
        what: one value, in errors (``"weight"``).
        check: ``check(value, name)``, one value checked (an error naming ``name``) and returned.
        check_values: ``check_values(values, name)``, the same for many at once (vectorised: a data
            set column's), returning an array; default: ``check`` on each.
        check_together: ``check_together(values, where, data_name)``, what a data set's values must
            be together (weights: not all 0, within a ratio the loss carries), ``where(i)`` naming
            value ``i``; None: nothing.
    """

    column: str | None
    key: str
    dtype: str | None
    padding: Any
    absent: str
    what: str
    check: Callable[[Any, str], Any]
    check_values: Callable[[Any, str], np.ndarray] | None = None
    check_together: Callable[[np.ndarray, Callable[[int], str], str], None] | None = None

    def values(self, values, name: str):
        """Per-sequence ``values`` (list, array or tensor), checked: a ``dtype`` array or a list."""
        if torch.is_tensor(values):
            values = values.detach().cpu().numpy()
        array = (
            np.asarray(values, dtype=object)
            if isinstance(values, (list, tuple, np.ndarray))
            else None
        )
        if array is None or array.ndim != 1:
            raise TypeError(
                f"`{name}` must be a list of one {self.what} per sequence, got "
                f"{type(values).__name__}."
            )
        if self.check_values is not None:
            return self.check_values(values, name).astype(self.dtype)
        values = [self.check(value, name) for value in array.tolist()]
        return values if self.dtype is None else np.array(values, dtype=self.dtype)

    def of_example(self, example, index: int, count: int):
        """The ``count`` sequences' values of one example (``examples[index]``), checked: ``key``
        (per sequence) or one conversation's ``column``; None where the example carries neither.
        """
        name = f"examples[{index}]"
        values = example.get(self.key)
        if values is not None:
            values = self.values(values, f"{name}[{self.key!r}]")
            if len(values) != count:
                raise ValueError(
                    f"`{name}[{self.key!r}]` must hold one {self.what} per sequence of "
                    "`seq_lengths`."
                )
            return values
        value = example.get(self.column) if self.column else None
        if value is None:
            return None
        if count != 1:
            raise ValueError(
                f"`{name}` is a packed row: give its {self.what}s per sequence in {self.key!r}."
            )
        values = [self.check(value, f"{name}[{self.column!r}]")]
        return values if self.dtype is None else np.array(values, dtype=self.dtype)

    def padded(self, values, count: int = 1):
        """``values`` (tensor, array or list) with ``count`` padding values appended, same kind."""
        if torch.is_tensor(values):
            return torch.cat((values, values.new_full((count,), self.padding)))
        if isinstance(values, np.ndarray):
            return np.append(values, np.full(count, self.padding, dtype=values.dtype))
        return list(values) + [self.padding] * count


TARGETS = SequenceColumn(None, SEQ_TARGETS, "int32", 1, "count", "target count", _check_count)
WEIGHTS = SequenceColumn(
    WEIGHT_COLUMN,
    SEQ_WEIGHTS,
    "float64",
    0.0,
    "refuse",
    "weight",
    conversation_weight,
    weight_array,
    check_weight_range,
)
SOURCES = SequenceColumn(SOURCE_COLUMN, SEQ_SOURCES, None, None, "pad", "source", _check_source)
# Every per-sequence column of rows and batches, in the order rows carry them (the lengths first,
# before them).
# seq_targets: a target count >= 1 in a batch (1 for a sequence without targets: a finite divisor);
# seq_weights: float64, which keeps weights outside float32's range (1e-46, 1e39); seq_sources: for
# per-source logs.
SEQUENCE_COLUMNS = (TARGETS, WEIGHTS, SOURCES)


def carried_column(name: str) -> SequenceColumn:
    """How packing carries data set column ``name``: its ``SEQUENCE_COLUMNS`` entry, or
    ``seq_<name>`` as it is (one value per sequence, any scalar, in no batch).
    """
    for column in SEQUENCE_COLUMNS:
        if column.column == name:
            return column
    return SequenceColumn(name, f"seq_{name}", None, None, "pad", "value", _check_scalar)


# The columns packing writes (a carried data set column may take none of these names).
PACKED_ROW_COLUMNS = (INPUT_IDS, LABELS, SEQ_LENGTHS, *(column.key for column in SEQUENCE_COLUMNS))
# The data set columns the trainers keep for the collator: a packed row's boundaries, each
# conversation's (or piece's) values, and the data set columns they come from; the images.
ROW_COLUMNS = (
    IMAGES,
    SEQ_LENGTHS,
    *(column.key for column in SEQUENCE_COLUMNS),
    *(column.column for column in SEQUENCE_COLUMNS if column.column),
)
# Float keys of a batch that are data, not activations: moved to the device in their own dtype.
FLOAT_SEQUENCE_KEYS = tuple(
    c.key for c in SEQUENCE_COLUMNS if c.dtype and np.dtype(c.dtype).kind == "f"
)


def datasets_of(argument) -> list:
    """The data sets of a trainer's ``train_dataset`` / ``eval_dataset`` argument (a dict of
    them too; none for None).
    """
    if argument is None:
        return []
    return list(argument.values()) if isinstance(argument, dict) else [argument]


def source_names(*arguments) -> tuple[str, ...]:
    """The sorted source names in the :data:`SOURCE_COLUMN` / :data:`SEQ_SOURCES` columns of
    trainers' data set arguments (``datasets.Dataset`` objects; none for other data).
    """
    names = set()
    for data in (data for argument in arguments for data in datasets_of(argument)):
        columns = getattr(data, "column_names", None) or []
        if SOURCE_COLUMN in columns:
            names.update(s for s in data[SOURCE_COLUMN] if isinstance(s, str))
        if SEQ_SOURCES in columns:
            names.update(s for row in data[SEQ_SOURCES] for s in row if isinstance(s, str))
    return tuple(sorted(names))
