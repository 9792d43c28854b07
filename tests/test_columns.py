"""The batch contract (``collators/columns.py``): every key a collator's batch or a packed row
carries is a named constant there, and no library module imports another's private name."""

from __future__ import annotations

import ast
from pathlib import Path

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
