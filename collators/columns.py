"""The batch contract: every key a row, a batch or a data set column carries, in one place.

A misspelt key is then a NameError, not a column silently missing.
"""

from __future__ import annotations

IGNORE_INDEX = -100  # a label that is no target (PyTorch's and transformers' value)

# Tokens, one per position: a tokenised conversation, a packed row, a batch.
INPUT_IDS = "input_ids"
LABELS = "labels"  # aligned with input_ids; IGNORE_INDEX where nothing is learnt
SHIFT_LABELS = "shift_labels"  # already shifted: the target of each token (collators.shard_batch)
POSITION_IDS = "position_ids"  # restart at 0 for each sequence
ATTENTION_MASK = "attention_mask"  # PaddedCollator's (B, T) only: a packed row has none

# A packed row's columns, one value per sequence of the row.
SEQ_LENGTHS = "seq_lengths"
SEQ_TARGETS = "seq_targets"  # the whole conversation's target count (a split one's pieces share it)
SEQ_WEIGHTS = "seq_weights"
SEQ_SOURCES = "seq_sources"

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
# What a context-parallel shard is (collators.shard_batch): a ShardRecord the model's forward checks.
SHARD = "context_parallel_shard"

# The trainers' evaluation batches: each example's token count, (B,) int64, to find the copies
# accelerate adds to the last batch (packed_ce.integrations.evaluation).
EXAMPLE_TOKENS = "example_tokens"

# The columns packing writes (a carried data set column may take none of these names).
PACKED_ROW_COLUMNS = (INPUT_IDS, LABELS, SEQ_LENGTHS, SEQ_TARGETS, SEQ_WEIGHTS, SEQ_SOURCES)
# The data set columns the trainers keep for the collator: a packed row's boundaries, and each
# conversation's (or piece's) target count, weight and source.
ROW_COLUMNS = (SEQ_LENGTHS, SEQ_TARGETS, SEQ_WEIGHTS, SEQ_SOURCES, WEIGHT_COLUMN, SOURCE_COLUMN)


def datasets_of(argument) -> list:
    """The data sets of a trainer's ``train_dataset`` / ``eval_dataset`` argument (a dict of
    them too; none for None)."""
    if argument is None:
        return []
    return list(argument.values()) if isinstance(argument, dict) else [argument]


def source_names(*arguments) -> tuple[str, ...]:
    """The sorted source names in the :data:`SOURCE_COLUMN` / :data:`SEQ_SOURCES` columns of
    trainers' data set arguments (``datasets.Dataset`` objects; none for other data)."""
    names = set()
    for data in (data for argument in arguments for data in datasets_of(argument)):
        columns = getattr(data, "column_names", None) or []
        if SOURCE_COLUMN in columns:
            names.update(s for s in data[SOURCE_COLUMN] if isinstance(s, str))
        if SEQ_SOURCES in columns:
            names.update(s for row in data[SEQ_SOURCES] for s in row if isinstance(s, str))
    return tuple(sorted(names))
