"""Every public collator entry point on bad input: each row names the call, the bad input and the outcome.

The outcome is an exception type with the words of its message (which name the argument), or, where the
input is unusual but valid, the exact result.
"""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")  # not on every GPU image
from datasets import Dataset, IterableDataset

from collators import (
    PackedCollator,
    PackedIterableDataset,
    PaddedCollator,
    VisionCollator,
    load_default_image_dataset,
    load_default_processor,
    load_default_tokenizer,
    load_messages_dataset,
    pack_dataset,
    pack_stream,
    shard_batch,
    tokenize_conversation,
    tokenize_dataset,
    tokenize_vision_conversation,
)

IGNORE = -100
CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
ROWS = {"input_ids": [[1, 2, 3], [4, 5]], "labels": [[IGNORE, 2, 3], [IGNORE, 5]]}
EXAMPLE = {"input_ids": [5, 6, 7], "labels": [IGNORE, 6, 7]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_default_tokenizer(cache_dir=tmp_path_factory.mktemp("tokenizer"))


def rows(**changes):
    return Dataset.from_dict({**ROWS, **changes})


def iterable(records):
    return IterableDataset.from_generator(lambda: iter(records))


def packed_batch(pad=4):
    return PackedCollator(pad_to_multiple_of=pad)([EXAMPLE, {"input_ids": [8, 9, 10], "labels": [8, 9, 10]}])


def without(mapping, key):
    return {k: v for k, v in mapping.items() if k != key}


# (id, call, expected): `call` takes the tokenizer; `expected` is (exception type, words of the message) or a
# function that checks the result.
TABLE = [
    # tokenize_conversation / tokenize_dataset
    ("tokenize_conversation max_length=-1", lambda tok: tokenize_conversation(tok, CHAT, max_length=-1),
     (ValueError, "`max_length` must be an int >= 1, got -1")),
    ("tokenize_conversation max_length=0", lambda tok: tokenize_conversation(tok, CHAT, max_length=0),
     (ValueError, "`max_length` must be an int >= 1, got 0")),
    ("tokenize_conversation max_length=2.5", lambda tok: tokenize_conversation(tok, CHAT, max_length=2.5),
     (TypeError, "`max_length` must be an int, got float 2.5")),
    ("tokenize_conversation max_length=True", lambda tok: tokenize_conversation(tok, CHAT, max_length=True),
     (TypeError, "`max_length` must be an int, got bool")),
    ("tokenize_conversation max_length=np.int64(4)",
     lambda tok: tokenize_conversation(tok, CHAT, max_length=np.int64(4)),
     lambda out: len(out["input_ids"]) == len(out["labels"]) == 4),
    ("tokenize_conversation messages str",
     lambda tok: tokenize_conversation(tok, "Hello"), (ValueError, "`messages` must be a non-empty list")),
    ("tokenize_conversation messages empty",
     lambda tok: tokenize_conversation(tok, []), (ValueError, "`messages` must be a non-empty list")),
    ("tokenize_conversation message without role", lambda tok: tokenize_conversation(tok, [{"content": "x"}]),
     (ValueError, "`messages[0]` has no 'role'")),
    ("tokenize_conversation message without content", lambda tok: tokenize_conversation(tok, [{"role": "user"}]),
     (ValueError, "`messages[0]` has no 'content'")),
    ("tokenize_conversation no assistant turn",
     lambda tok: tokenize_conversation(tok, CHAT[:1]), (ValueError, "no assistant turn")),
    ("tokenize_conversation tokenizer without template",
     lambda tok: tokenize_conversation(types.SimpleNamespace(chat_template=None), CHAT),
     (ValueError, "`tokenizer` has no chat template")),
    ("tokenize_dataset list", lambda tok: tokenize_dataset([{"messages": CHAT}], tok),
     (TypeError, "`dataset` must be a datasets.Dataset or datasets.IterableDataset, got list")),
    ("tokenize_dataset no messages column", lambda tok: tokenize_dataset(Dataset.from_dict({"text": ["a"]}), tok),
     (ValueError, "`dataset` has no column 'messages'")),
    ("tokenize_dataset max_length=2.5",
     lambda tok: tokenize_dataset(Dataset.from_dict({"messages": [CHAT]}), tok, max_length=2.5),
     (TypeError, "`max_length` must be an int")),
    # pack_dataset: arguments
    ("pack_dataset list", lambda tok: pack_dataset([EXAMPLE], 8),
     (TypeError, "or datasets.IterableDataset, got list; pack other iterables of examples with pack_stream")),
    ("pack_dataset max_length=-1",
     lambda tok: pack_dataset(rows(), -1), (ValueError, "`max_length` must be an int >= 1, got -1")),
    ("pack_dataset max_length=0",
     lambda tok: pack_dataset(rows(), 0), (ValueError, "`max_length` must be an int >= 1, got 0")),
    ("pack_dataset max_length=2.5",
     lambda tok: pack_dataset(rows(), 2.5), (TypeError, "`max_length` must be an int, got float 2.5")),
    ("pack_dataset max_length='8'",
     lambda tok: pack_dataset(rows(), "8"), (TypeError, "`max_length` must be an int, got str")),
    ("pack_dataset max_length=nan",
     lambda tok: pack_dataset(rows(), math.nan), (TypeError, "`max_length` must be an int")),
    ("pack_dataset split max_length=1", lambda tok: pack_dataset(rows(), 1, overflow="split"),
     (ValueError, "`max_length` must be an int >= 2, got 1")),
    ("pack_dataset overflow='wrap'",
     lambda tok: pack_dataset(rows(), 8, overflow="wrap"), (ValueError, "`overflow` must be one of")),
    # pack_dataset: columns and values
    ("pack_dataset float input_ids", lambda tok: pack_dataset(rows(input_ids=[[1.5, 2.0, 3.0], [4.0, 5.0]]), 8),
     (TypeError, "`dataset` column 'input_ids' must hold lists of ints, got list<item: double>")),
    ("pack_dataset float labels", lambda tok: pack_dataset(rows(labels=[[0.5, 2, 3], [1, 5]]), 8),
     (TypeError, "`dataset` column 'labels' must hold lists of ints")),
    ("pack_dataset str input_ids", lambda tok: pack_dataset(rows(input_ids=[["a", "b", "c"], ["d", "e"]]), 8),
     (TypeError, "`dataset` column 'input_ids' must hold lists of ints")),
    ("pack_dataset negative token", lambda tok: pack_dataset(rows(input_ids=[[1, -2, 3], [4, 5]]), 8),
     (ValueError, "negative token id -2")),
    ("pack_dataset label -5", lambda tok: pack_dataset(rows(labels=[[IGNORE, -5, 3], [IGNORE, 5]]), 8),
     (ValueError, "the label -5 in `labels`")),
    ("pack_dataset lengths differ", lambda tok: pack_dataset(rows(labels=[[IGNORE, 2], [IGNORE, 5]]), 8),
     (ValueError, "row 0 has 3 input_ids but 2 labels")),
    ("pack_dataset missing labels", lambda tok: pack_dataset(rows().remove_columns("labels"), 8),
     (ValueError, "`dataset` lacks the column(s) ['labels']")),
    ("pack_dataset None row", lambda tok: pack_dataset(rows(input_ids=[[1, 2, 3], None], labels=[[1, 2, 3], None]), 8),
     (ValueError, "`dataset` column 'input_ids' has 1 missing rows")),
    ("pack_dataset weight nan", lambda tok: pack_dataset(rows(weight=[1.0, math.nan]), 8),
     (ValueError, "`dataset['weight']` must be finite and >= 0, got nan at index 1")),
    ("pack_dataset weight inf", lambda tok: pack_dataset(rows(weight=[math.inf, 1.0]), 8),
     (ValueError, "`dataset['weight']` must be finite and >= 0, got inf at index 0")),
    ("pack_dataset weight -1", lambda tok: pack_dataset(rows(weight=[1.0, -1.0]), 8),
     (ValueError, "`dataset['weight']` must be finite and >= 0, got -1.0")),
    ("pack_dataset weight str", lambda tok: pack_dataset(rows(weight=["a", "b"]), 8),
     (TypeError, "`dataset['weight'][0]` must be a real number, got str")),
    ("pack_dataset weight missing", lambda tok: pack_dataset(rows(weight=[1.0, None]), 8),
     (ValueError, "column 'weight' has 1 missing values")),
    ("pack_dataset empty", lambda tok: pack_dataset(rows().select([]), 8, return_stats=True),
     lambda out: out[0].num_rows == 0 and out[1].num_conversations == 0),
    ("pack_dataset no target after truncation",
     lambda tok: pack_dataset(rows(labels=[[IGNORE, IGNORE, IGNORE], [IGNORE, 5]]), 2, return_stats=True)[1],
     lambda stats: (stats.num_truncated, stats.num_without_targets, stats.num_packed) == (1, 1, 2)),
    ("pack_dataset IterableDataset",
     lambda tok: pack_dataset(iterable([{"input_ids": i, "labels": l} for i, l in zip(*ROWS.values())]), 8)[:],
     lambda out: out == pack_dataset(rows(), 8)[:]),
    ("pack_dataset IterableDataset with weights split",
     lambda tok: pack_dataset(
         iterable([{"input_ids": [1, 2, 3, 4], "labels": [1, 2, 3, 4], "weight": 2.0}]), 3, overflow="split"
     )[:],
     lambda out: out == {"input_ids": [[1, 2, 3], [3, 4]], "labels": [[1, 2, 3], [IGNORE, 4]],
                         "seq_lengths": [[3], [2]],
                         "seq_targets": [[3], [3]], "seq_weights": [[2.0], [2.0]]}),
    ("pack_dataset IterableDataset float ids",
     lambda tok: pack_dataset(iterable([{"input_ids": [1.5], "labels": [1]}]), 8),
     (TypeError, "`dataset[0]['input_ids']` must hold ints, got dtype float64")),
    ("pack_dataset IterableDataset no labels", lambda tok: pack_dataset(iterable([{"input_ids": [1]}]), 8),
     (ValueError, "`dataset` lacks the column(s) ['labels']")),
    ("pack_dataset IterableDataset empty", lambda tok: pack_dataset(iterable([]), 8).num_rows, lambda out: out == 0),
    ("pack_dataset IterableDataset buffer_size=0", lambda tok: pack_dataset(iterable([EXAMPLE]), 8, buffer_size=0),
     (ValueError, "`buffer_size` must be an int >= 1, got 0")),
    ("pack_dataset IterableDataset num_proc=2", lambda tok: pack_dataset(iterable([EXAMPLE]), 8, num_proc=2),
     (ValueError, "`num_proc` writes the rows of a Dataset; an IterableDataset is packed in one pass")),
    ("pack_dataset IterableDataset load_from_cache_file",
     lambda tok: pack_dataset(iterable([EXAMPLE]), 8, load_from_cache_file=True),
     (ValueError, "`load_from_cache_file`: an IterableDataset has no fingerprint")),
    ("pack_dataset Dataset buffer_size", lambda tok: pack_dataset(rows(), 8, buffer_size=64),
     (ValueError, "`buffer_size` is the window of an IterableDataset; a Dataset is packed whole")),
    # pack_stream / PackedIterableDataset: checked at the call
    ("pack_stream max_length=0",
     lambda tok: pack_stream([EXAMPLE], 0), (ValueError, "`max_length` must be an int >= 1, got 0")),
    ("pack_stream max_length=2.5", lambda tok: pack_stream([EXAMPLE], 2.5), (TypeError, "`max_length` must be an int")),
    ("pack_stream buffer_size=0",
     lambda tok: pack_stream([EXAMPLE], 8, buffer_size=0), (ValueError, "`buffer_size` must be an int >= 1")),
    ("pack_stream overflow",
     lambda tok: pack_stream([EXAMPLE], 8, overflow="cut"), (ValueError, "`overflow` must be one of")),
    ("pack_stream float ids", lambda tok: list(pack_stream([{"input_ids": [1.0, 2.0], "labels": [1, 2]}], 8)),
     (TypeError, "`examples[0]['input_ids']` must hold ints, got dtype float64")),
    ("pack_stream lengths differ", lambda tok: list(pack_stream([{"input_ids": [1, 2], "labels": [1]}], 8)),
     (ValueError, "`examples[0]` has 2 input_ids but 1 labels")),
    ("pack_stream weight nan", lambda tok: list(pack_stream([dict(EXAMPLE, weight=math.nan)], 8)),
     (ValueError, "`examples[0]['weight']` must be finite and >= 0, got nan")),
    ("pack_stream weight beyond float64", lambda tok: list(pack_stream([dict(EXAMPLE, weight=10**400)], 8)),
     (ValueError, "`examples[0]['weight']` is 10000000000000000..., beyond float64's range")),
    ("pack_stream weight in some", lambda tok: list(pack_stream([dict(EXAMPLE, weight=1.0), EXAMPLE], 8)),
     (ValueError, "`examples[1]` lacks ['weight'], unlike the first example")),
    ("PackedIterableDataset max_length=-1", lambda tok: PackedIterableDataset([EXAMPLE], -1),
     (ValueError, "`max_length` must be an int >= 1, got -1")),
    ("pack_stream without max_length", lambda tok: pack_stream([EXAMPLE]),
     (TypeError, "pack_stream needs `max_length`")),
    ("pack_stream max_length and max_tokens", lambda tok: pack_stream([EXAMPLE], 8, max_tokens=8),
     (TypeError, "pass `max_length` only")),
    ("PackedIterableDataset buffer_size=1.5", lambda tok: PackedIterableDataset([EXAMPLE], 8, buffer_size=1.5),
     (TypeError, "`buffer_size` must be an int")),
    # PackedCollator
    ("PackedCollator pad_to_multiple_of=0", lambda tok: PackedCollator(pad_to_multiple_of=0),
     (ValueError, "`pad_to_multiple_of` must be an int >= 1, got 0")),
    ("PackedCollator pad_to_multiple_of=2.5", lambda tok: PackedCollator(pad_to_multiple_of=2.5),
     (TypeError, "`pad_to_multiple_of` must be an int, got float")),
    ("PackedCollator no examples", lambda tok: PackedCollator()([]), (ValueError, "`examples` is empty")),
    ("PackedCollator only empty examples",
     lambda tok: PackedCollator()([{"input_ids": []}]), (ValueError, "`examples` holds no token")),
    ("PackedCollator not a dict",
     lambda tok: PackedCollator()([[1, 2, 3]]), (TypeError, "`examples[0]` must be a dict with 'input_ids'")),
    ("PackedCollator float ids", lambda tok: PackedCollator()([{"input_ids": [1.7, 2.2]}]),
     (TypeError, "`examples[0]['input_ids']` must hold ints, got dtype float64")),
    ("PackedCollator float tensor ids", lambda tok: PackedCollator()([{"input_ids": torch.tensor([1.0, 2.0])}]),
     (TypeError, "`examples[0]['input_ids']` must hold ints, got dtype float32")),
    ("PackedCollator nan labels", lambda tok: PackedCollator()([{"input_ids": [1, 2], "labels": [math.nan, 2.0]}]),
     (TypeError, "`examples[0]['labels']` must hold ints")),
    ("PackedCollator bool ids", lambda tok: PackedCollator()([{"input_ids": [True, False]}]),
     (TypeError, "`examples[0]['input_ids']` must hold ints, got dtype bool")),
    ("PackedCollator None in ids", lambda tok: PackedCollator()([{"input_ids": [1, None]}]),
     (TypeError, "`examples[0]['input_ids']` must hold ints, got dtype object")),
    ("PackedCollator ragged ids", lambda tok: PackedCollator()([{"input_ids": [[1, 2], [3]]}]),
     (ValueError, "`examples[0]['input_ids']` must be a flat sequence of ints")),
    ("PackedCollator (1, T) tensor is its row",
     lambda tok: PackedCollator()([{"input_ids": torch.tensor([[5, 6, 7]]), "labels": torch.tensor([[IGNORE, 6, 7]])}]),
     lambda batch: batch["cu_seqlens"].tolist() == [0, 3] and batch["input_ids"].tolist() == [[5, 6, 7]]),
    ("PackedCollator (2, T) tensor", lambda tok: PackedCollator()([{"input_ids": torch.ones(2, 3, dtype=torch.long)}]),
     (ValueError, "`examples[0]['input_ids']` must be 1-D (or one row of shape (1, T)), got shape (2, 3)")),
    ("PackedCollator (1, 1, T) array",
     lambda tok: PackedCollator()([{"input_ids": np.ones((1, 1, 3), dtype=np.int64)}]),
     (ValueError, "got shape (1, 1, 3)")),
    ("PackedCollator uint8 array ids",
     lambda tok: PackedCollator()([{"input_ids": np.array([5, 6, 7], dtype=np.uint8)}]),
     lambda batch: batch["input_ids"].dtype == torch.int64 and batch["input_ids"].tolist() == [[5, 6, 7]]),
    ("PackedCollator negative id", lambda tok: PackedCollator()([{"input_ids": [1, -1]}]),
     (ValueError, "`examples[0]` has a negative token id -1")),
    ("PackedCollator label -1", lambda tok: PackedCollator()([{"input_ids": [1, 2], "labels": [1, -1]}]),
     (ValueError, "`examples[0]` has the label -1 in `labels`")),
    ("PackedCollator labels shorter", lambda tok: PackedCollator()([{"input_ids": [1, 2], "labels": [1]}]),
     (ValueError, "`examples[0]` has 2 input_ids, 1 labels")),
    ("PackedCollator seq_lengths sum", lambda tok: PackedCollator()([dict(EXAMPLE, seq_lengths=[2])]),
     (ValueError, "`examples[0]` has 3 input_ids, 3 labels and seq_lengths [2]")),
    ("PackedCollator seq_lengths negative", lambda tok: PackedCollator()([dict(EXAMPLE, seq_lengths=[4, -1])]),
     (ValueError, "the lengths must be >= 0")),
    ("PackedCollator seq_lengths float", lambda tok: PackedCollator()([dict(EXAMPLE, seq_lengths=[1.5, 1.5])]),
     (TypeError, "`examples[0]['seq_lengths']` must hold ints")),
    ("PackedCollator seq_targets below own", lambda tok: PackedCollator()([dict(EXAMPLE, seq_targets=[1])]),
     (ValueError, "`examples[0]['seq_targets']` is [1], below the sequences' own target counts [2]")),
    ("PackedCollator seq_targets wrong length", lambda tok: PackedCollator()([dict(EXAMPLE, seq_targets=[5, 5])]),
     (ValueError, "`examples[0]['seq_targets']` must hold one target count per sequence")),
    ("PackedCollator seq_weights nan", lambda tok: PackedCollator()([dict(EXAMPLE, seq_weights=[math.nan])]),
     (ValueError, "`examples[0]['seq_weights']` must be finite and >= 0, got nan")),
    ("PackedCollator seq_weights negative", lambda tok: PackedCollator()([dict(EXAMPLE, seq_weights=[-0.5])]),
     (ValueError, "`examples[0]['seq_weights']` must be finite and >= 0, got -0.5")),
    ("PackedCollator seq_weights wrong length", lambda tok: PackedCollator()([dict(EXAMPLE, seq_weights=[1.0, 1.0])]),
     (ValueError, "`examples[0]['seq_weights']` must hold one weight per sequence")),
    ("PackedCollator weight str", lambda tok: PackedCollator()([dict(EXAMPLE, weight="high")]),
     (TypeError, "`examples[0]['weight']` must be a real number, got str")),
    ("PackedCollator weight inf", lambda tok: PackedCollator()([dict(EXAMPLE, weight=math.inf)]),
     (ValueError, "`examples[0]['weight']` must be finite and >= 0, got inf")),
    ("PackedCollator weight beyond float64", lambda tok: PackedCollator()([EXAMPLE, dict(EXAMPLE, weight=10**400)]),
     (ValueError, "`examples[1]['weight']` is 10000000000000000..., beyond float64's range: scale every weight down")),
    ("PackedCollator weight long double", lambda tok: PackedCollator()([dict(EXAMPLE, weight=np.longdouble("1e400"))]),
     (ValueError, "`examples[0]['weight']` is 1e+400, beyond float64's range")),
    ("PackedCollator seq_weights beyond float64",
     lambda tok: PackedCollator()([dict(EXAMPLE, seq_lengths=[1, 2], seq_weights=[1, 10**400])]),
     (ValueError, "`examples[0]['seq_weights'][1]` is 10000000000000000..., beyond float64's range")),
    ("PackedCollator seq_weights long double",
     lambda tok: PackedCollator()([dict(EXAMPLE, seq_weights=np.array([np.longdouble("1e400")]))]),
     (ValueError, "`examples[0]['seq_weights'][0]` is 1e+400, beyond float64's range")),
    ("PackedCollator weight beyond float64, negative", lambda tok: PackedCollator()([dict(EXAMPLE, weight=-10**400)]),
     (ValueError, "`examples[0]['weight']` must be finite and >= 0, got -1000000000000000...")),
    ("PackedCollator seq_weights None", lambda tok: PackedCollator()([dict(EXAMPLE, seq_weights=[None])]),
     (TypeError, "`examples[0]['seq_weights'][0]` must be a real number, got NoneType")),
    ("PackedCollator weight on a packed row",
     lambda tok: PackedCollator()([dict(EXAMPLE, seq_lengths=[1, 2], weight=1.0)]),
     (ValueError, "`examples[0]` is a packed row: give its weights per sequence in 'seq_weights'")),
    ("PackedCollator weights in some examples", lambda tok: PackedCollator()([EXAMPLE, dict(EXAMPLE, weight=1.0)]),
     (ValueError, "`examples[1]` has weights, unlike `examples[0]`")),
    ("PackedCollator weights zero", lambda tok: PackedCollator(pad_to_multiple_of=4)([dict(EXAMPLE, weight=0)]),
     lambda batch: batch["seq_weights"].tolist() == [0.0, 0.0] and batch["seq_targets"].tolist() == [2, 1]),
    # PaddedCollator
    ("PaddedCollator pad_to_multiple_of=-2", lambda tok: PaddedCollator(pad_to_multiple_of=-2),
     (ValueError, "`pad_to_multiple_of` must be an int >= 1, got -2")),
    ("PaddedCollator no examples", lambda tok: PaddedCollator()([]), (ValueError, "`examples` is empty")),
    ("PaddedCollator float ids", lambda tok: PaddedCollator()([{"input_ids": [1.5]}]),
     (TypeError, "`examples[0]['input_ids']` must hold ints")),
    ("PaddedCollator packed row", lambda tok: PaddedCollator()([dict(EXAMPLE, seq_lengths=[1, 2])]),
     (ValueError, "`examples[0]` is a packed row")),
    ("PaddedCollator labels longer", lambda tok: PaddedCollator()([{"input_ids": [1], "labels": [1, 2]}]),
     (ValueError, "`examples[0]` has 1 input_ids, 2 labels")),
    ("PaddedCollator weight nan", lambda tok: PaddedCollator()([dict(EXAMPLE, weight=math.nan)]),
     (ValueError, "`examples[0]['weight']` must be finite and >= 0")),
    ("PaddedCollator weight beyond float64", lambda tok: PaddedCollator()([dict(EXAMPLE, weight=10**400)]),
     (ValueError, "`examples[0]['weight']` is 10000000000000000..., beyond float64's range")),
    ("PaddedCollator (1, T) tensor",
     lambda tok: PaddedCollator()([{"input_ids": torch.tensor([[5, 6]])}, {"input_ids": [7]}]),
     lambda batch: batch["input_ids"].tolist() == [[5, 6], [7, 0]] and batch["seq_targets"].tolist() == [1, 1]),
    # shard_batch
    ("shard_batch rank=-1",
     lambda tok: shard_batch(packed_batch(), -1, 2), (ValueError, "`rank` must be an int >= 0, got -1")),
    ("shard_batch rank=world_size",
     lambda tok: shard_batch(packed_batch(), 2, 2), (ValueError, "`rank` must be in [0, world_size=2), got 2")),
    ("shard_batch world_size=0",
     lambda tok: shard_batch(packed_batch(), 0, 0), (ValueError, "`world_size` must be an int >= 1, got 0")),
    ("shard_batch world_size=1.5",
     lambda tok: shard_batch(packed_batch(), 0, 1.5), (TypeError, "`world_size` must be an int")),
    ("shard_batch list", lambda tok: shard_batch([EXAMPLE], 0, 1), (TypeError, "`batch` must be a dict of tensors")),
    ("shard_batch no labels",
     lambda tok: shard_batch(without(packed_batch(), "labels"), 0, 1), (ValueError, "`batch` lacks ['labels']")),
    ("shard_batch T not a multiple", lambda tok: shard_batch(packed_batch(pad=None), 0, 2),
     (ValueError, "not a multiple of 2 * world_size = 4: collate with PackedCollator(pad_to_multiple_of=4)")),
    ("shard_batch (2, T) ids",
     lambda tok: shard_batch(dict(packed_batch(), input_ids=torch.ones(2, 4, dtype=torch.long)), 0, 1),
     (ValueError, "of shape (1, T), got a torch.int64 tensor of shape (2, 4)")),
    ("shard_batch float ids", lambda tok: shard_batch(dict(packed_batch(), input_ids=torch.ones(1, 8)), 0, 1),
     (ValueError, "`batch['input_ids']` must be an integer tensor of shape (1, T), got a torch.float32")),
    ("shard_batch cu_seqlens short of T",
     lambda tok: shard_batch(dict(packed_batch(), cu_seqlens=torch.tensor([0, 3, 6])), 0, 1),
     (ValueError, "`batch['cu_seqlens']` must rise from 0 to T=8 without decreasing, got [0, 3, 6]")),
    ("shard_batch cu_seqlens decreasing",
     lambda tok: shard_batch(dict(packed_batch(), cu_seqlens=torch.tensor([0, 5, 3, 8])), 0, 1),
     (ValueError, "must rise from 0 to T=8 without decreasing")),
    ("shard_batch cu_seqlens float",
     lambda tok: shard_batch(dict(packed_batch(), cu_seqlens=torch.tensor([0.0, 8.0])), 0, 1),
     (ValueError, "`batch['cu_seqlens']` must be a 1-D integer tensor")),
    ("shard_batch seq_targets shape",
     lambda tok: shard_batch(dict(packed_batch(), seq_targets=torch.ones(2, dtype=torch.int32)), 0, 1),
     (ValueError, "`batch['seq_targets']` must be a tensor of shape (S,) = (3,)")),
    ("shard_batch seq_targets 0",
     lambda tok: shard_batch(dict(packed_batch(), seq_targets=torch.zeros(3, dtype=torch.int32)), 0, 1),
     (ValueError, "`batch['seq_targets']` must be >= 1")),
    ("shard_batch seq_weights nan",
     lambda tok: shard_batch(dict(packed_batch(), seq_weights=torch.tensor([1.0, math.nan, 0.0])), 0, 1),
     (ValueError, "`batch['seq_weights']` must be finite and >= 0")),
    # Offline defaults and loading
    ("load_default_tokenizer vocab_size=100", lambda tok: load_default_tokenizer(vocab_size=100),
     (ValueError, "`vocab_size` must be an int >= 259, got 100")),
    ("load_default_tokenizer vocab_size='big'", lambda tok: load_default_tokenizer(vocab_size="big"),
     (TypeError, "`vocab_size` must be an int, got str")),
    ("load_messages_dataset missing file", lambda tok: load_messages_dataset("no/such/chats.jsonl"),
     (FileNotFoundError, "`name_or_path` 'no/such/chats.jsonl': no such file or folder")),
    # vision-language conversations: the processor and the offline defaults
    ("tokenize_vision_conversation tokenizer", lambda tok: tokenize_vision_conversation(tok, CHAT),
     (TypeError, "`processor` must be the model's transformers processor")),
    ("tokenize_vision_conversation max_length=0",
     lambda tok: tokenize_vision_conversation(load_default_processor(), CHAT, max_length=0),
     (ValueError, "`max_length` must be an int >= 1")),
    ("tokenize_vision_conversation more image parts than images",
     lambda tok: tokenize_vision_conversation(load_default_processor(), [
         {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]},
         {"role": "assistant", "content": "ok"}], images=[]),
     (ValueError, "`messages` has more image parts than images (0)")),
    ("VisionCollator tokenizer", lambda tok: VisionCollator(tok),
     (TypeError, "`processor` must be the model's transformers processor")),
    ("VisionCollator pad_to_multiple_of=0", lambda tok: VisionCollator(load_default_processor(), pad_to_multiple_of=0),
     (ValueError, "`pad_to_multiple_of` must be an int >= 1")),
    ("load_default_processor unknown family", lambda tok: load_default_processor("mistral"),
     (ValueError, "`model_type` must be one of")),
    ("load_default_image_dataset num_conversations=-1", lambda tok: load_default_image_dataset(-1),
     (ValueError, "`num_conversations` must be an int >= 1")),
    ("load_default_image_dataset num_conversations=2.5", lambda tok: load_default_image_dataset(2.5),
     (TypeError, "`num_conversations` must be an int")),
]


@pytest.mark.parametrize("call, expected", [row[1:] for row in TABLE], ids=[row[0] for row in TABLE])
def test_bad_input(call, expected, tokenizer):
    if callable(expected):
        assert expected(call(tokenizer))
        return
    error, words = expected
    with pytest.raises(error) as info:
        call(tokenizer)
    assert words in str(info.value)


def test_table_covers_every_public_function():
    import collators

    called = " ".join(row[0] for row in TABLE)
    public = [name for name in collators.__all__ if callable(getattr(collators, name)) and name != "PackingStats"]
    # The offline data set has no argument to get wrong but `system_prompt`, a flag.
    assert [name for name in public if name not in called] == ["load_default_dataset"]
