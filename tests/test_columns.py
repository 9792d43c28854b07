"""The batch contract (``packed_ce/columns.py``): every key a collator's batch or a packed row
carries is a named constant there, and no library module imports another's private name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from datasets import Dataset

import collators
from packed_ce import columns

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

    from collators.sharding import shard_for_rank
    from packed_ce.integrations.trainers.trl_data import SequenceColumns
    from packed_ce.integrations.trainers.transformers_trainer import EXACT_FLOAT_KEYS

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
    def per_token(values, cu_seqlens):
        return sorted(torch.repeat_interleave(torch.as_tensor(values), cu_seqlens.diff().long()).tolist())

    # every token of the row on one rank, each with its sequence's value (padding: 1.0)
    shards = [collators.shard_batch(batch, rank, 2) for rank in range(2)]
    assert sorted(sum((per_token(s["seq_temperatures"], s["cu_seqlens"]) for s in shards), [])) == per_token(
        batch["seq_temperatures"], batch["cu_seqlens"]
    )
    # 9 tokens padded to 12 by the trainers' shard: the padding segment's 3 tokens weigh 1.0
    unpadded = collators.PackedCollator()(list(rows))
    trainer_shards = [shard_for_rank(unpadded, rank, 3) for rank in range(3)]
    assert sorted(sum((per_token(s["seq_temperatures"], s["cu_seqlens"]) for s in trainer_shards), [])) == sorted(
        per_token(unpadded["seq_temperatures"], unpadded["cu_seqlens"]) + [1.0] * 3
    )

    def trl_collator(examples):
        return {"cu_seq_lens_q": torch.tensor(np.cumsum([0] + [len(e["input_ids"]) for e in examples] + [1]),
                                             dtype=torch.int32)}

    trl_batch = SequenceColumns(trl_collator, padding_free=True)([dict(c) for c in conversations])
    assert trl_batch["seq_temperatures"].tolist() == [0.5, 2.0, 1.0]
