"""The batch contract (``collators/columns.py``): every key a collator's batch or a packed row
carries is a named constant there, and no library module imports another's private name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from datasets import Dataset

import collators
from collators import columns

ROOT = Path(__file__).parents[1]
CONTRACT = {value for name, value in vars(columns).items() if name.isupper() and isinstance(value, str)}


def test_every_key_of_batches_and_rows_is_in_the_contract():
    rows = [
        {"input_ids": [4, 5, 6, 7], "labels": [-100, 5, 6, 7], "seq_lengths": [2, 2], "seq_targets": [1, 2],
         "seq_weights": [1.0, 0.5], "seq_sources": ["a", None]},
    ]
    packed = collators.PackedCollator()(rows)
    padded = collators.PaddedCollator()([{"input_ids": [4, 5, 6], "labels": [-100, 5, 6], "weight": 2.0,
                                          "source": "b"}])
    conversations = Dataset.from_list([{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "weight": 2.0,
                                        "source": "b"}])
    packed_rows = collators.pack_dataset(conversations, max_length=4)
    shard = collators.shard_batch(packed, rank=0, world_size=2)
    keys = set(packed) | set(padded) | set(packed_rows[0]) | set(shard) | {"weight", "source"}
    assert keys - CONTRACT == set()
    assert set(columns.ROW_COLUMNS) <= CONTRACT


def test_no_module_imports_a_private_name_of_another():
    found = []
    for folder in ("packed_ce", "collators"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom):
                    found += [
                        f"{path.relative_to(ROOT)}: from {'.' * node.level}{node.module or ''} import {alias.name}"
                        for alias in node.names
                        if alias.name.startswith("_") and not alias.name.startswith("__")
                    ]
    assert not found


def test_a_new_column_kind_needs_the_table_only(monkeypatch):
    """A column added to `SEQUENCE_COLUMNS` (here a float `temperature` per conversation, padded with 1.0) reaches
    both packers, both collators, both shards and trl's collator wrapper, with its dtype and padding, and a batch
    lacking it in one example is refused."""
    import sys

    import numpy as np
    import torch

    from packed_ce.integrations.context_parallel import shard_for_rank
    from packed_ce.integrations.sft_data import SequenceColumns
    from packed_ce.integrations.trainer import EXACT_FLOAT_KEYS

    assert EXACT_FLOAT_KEYS == ("seq_weights",)  # the table's float columns
    extra = columns.SequenceColumn("temperature", "seq_temperatures", "float64", 1.0, "refuse", "temperature",
                                   columns.conversation_weight)
    original = columns.SEQUENCE_COLUMNS
    table = (*original, extra)
    for module in [m for name, m in sys.modules.items() if name.split(".")[0] in ("collators", "packed_ce")]:
        if getattr(module, "SEQUENCE_COLUMNS", None) is original:
            monkeypatch.setattr(module, "SEQUENCE_COLUMNS", table)

    conversations = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "temperature": 0.5},
                     {"input_ids": [4, 5, 6, 7, 8], "labels": [-100, 5, 6, 7, 8], "temperature": 2.0}]
    rows = collators.pack_dataset(Dataset.from_list(conversations), max_length=4, overflow="split")
    assert rows["seq_lengths"] == [[4], [3], [2]] and rows["seq_temperatures"] == [[2.0], [0.5], [2.0]]
    assert [row["seq_temperatures"] for row in collators.pack_stream(conversations, 4, overflow="split")] == \
        rows["seq_temperatures"]
    batch = collators.PackedCollator(pad_to_multiple_of=8)(list(rows))  # 9 tokens and 7 of padding
    assert batch["seq_temperatures"].dtype == torch.float64
    assert batch["seq_temperatures"].tolist() == [2.0, 0.5, 2.0, 1.0]  # the padding segment's 1.0
    assert collators.PaddedCollator()(conversations)["seq_temperatures"].tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"`examples\[1\]` lacks temperatures, unlike `examples\[0\]`"):
        collators.PackedCollator()([conversations[0], {"input_ids": [1, 2]}])
    # rank 1 of 2: tokens 4-7 (the 0.5 conversation's 3, the 2.0 piece's first) and 8-11 (its last, padding)
    shard = collators.shard_batch(batch, rank=1, world_size=2)
    assert shard["seq_temperatures"].tolist() == [0.5, 2.0, 2.0, 1.0]
    # 9 tokens padded to 12 by the shard: rank 0 of 3 holds tokens 0-1 (2.0) and 10-11 (padding)
    assert shard_for_rank(collators.PackedCollator()(list(rows)), 0, 3)["seq_temperatures"].tolist() == [2.0, 1.0]

    def trl_collator(examples):
        return {"cu_seq_lens_q": torch.tensor(np.cumsum([0] + [len(e["input_ids"]) for e in examples] + [1]),
                                             dtype=torch.int32)}

    trl_batch = SequenceColumns(trl_collator, padding_free=True)([dict(c) for c in conversations])
    assert trl_batch["seq_temperatures"].tolist() == [0.5, 2.0, 1.0]
