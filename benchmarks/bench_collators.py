"""Packing and collation on CPU: `collators` against TRL's `pack_dataset` and `DataCollatorWithFlattening`.

Workload: a long-tailed SFT length distribution, lognormal with median 500 tokens and sigma 1.1 (mean about
900), clipped to [8, 16384], 100k conversations by default; about a fifth of the tokens are prompt (label
-100). Two row sizes, 4096 and 8192.

- Packing: efficiency (real tokens / (rows * max_length)) and wall time of `collators.pack_dataset` and of
  TRL's `pack_dataset(strategy="bfd")`, run as TRL runs it by default (BFD within each `map` batch of 1000
  conversations) and over the whole data set in one batch (`map_kwargs={"batch_size": len(dataset)}`).
- Collation: tokens per second from a list of examples to a ready batch for `PackedCollator` and
  `DataCollatorWithFlattening(return_flash_attn_kwargs=True)` (the same outputs: ids, labels with the
  first label of each sequence ignored, position ids, varlen keywords), on the same batches of individual
  conversations, each batch about one row of `max_length` tokens; also `PackedCollator` on the packed rows
  themselves (`seq_lengths` given), the usual path after `pack_dataset`.

Run: `python benchmarks/bench_collators.py [--num-conversations N] [--repeats R]`. Prints a markdown table and
writes `benchmarks/results/collators.json` and `collators.md`. Times are the best of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from importlib import metadata
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

RESULTS = Path(__file__).resolve().parent / "results"
MAX_LENGTHS = (4096, 8192)


def make_dataset(num_conversations: int, seed: int = 0):
    """Token columns built in Arrow directly: 100M Python ints would dominate the benchmark's own setup."""
    import datasets

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(500), 1.1, num_conversations), 8, 16384).astype(np.int64)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int32)
    total = int(offsets[-1])
    input_ids = (np.arange(total, dtype=np.int64) * 7919 % 32000).astype(np.int32)
    # The first fifth of every conversation is prompt.
    position = np.arange(total) - np.repeat(offsets[:-1], lengths)
    labels = np.where(position < np.repeat(lengths // 5, lengths), -100, input_ids).astype(np.int32)
    table = pa.table(
        {
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(input_ids)),
            "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
        }
    )
    return datasets.Dataset(datasets.table.InMemoryTable(table)), lengths


def best_time(fn, repeats: int):
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def efficiency(packed, max_length: int) -> float:
    lengths = pc.list_value_length(packed.with_format("arrow")[:]["input_ids"])
    return pc.sum(lengths).as_py() / (len(packed) * max_length)


def bench_packing(dataset, max_length: int, repeats: int) -> list[dict]:
    from trl import pack_dataset as trl_pack_dataset

    from collators import pack_dataset

    rows = []
    seconds, (packed, stats) = best_time(lambda: pack_dataset(dataset, max_length, return_stats=True), repeats)
    rows.append(
        dict(method="collators.pack_dataset (BFD, whole data set)", max_length=max_length, seconds=seconds,
             rows=len(packed), efficiency=stats.efficiency, truncated=stats.num_truncated)
    )
    for label, map_kwargs in (
        ("trl.pack_dataset bfd (default: per map batch of 1000)", {}),
        ("trl.pack_dataset bfd (one map batch: whole data set)", {"batch_size": len(dataset)}),
    ):
        map_kwargs = dict(map_kwargs, keep_in_memory=True)
        seconds, packed = best_time(
            lambda: trl_pack_dataset(dataset, max_length, strategy="bfd", map_kwargs=map_kwargs), repeats
        )
        rows.append(dict(method=label, max_length=max_length, seconds=seconds, rows=len(packed),
                         efficiency=efficiency(packed, max_length), truncated=None))
    return rows


def bench_collation(dataset, max_length: int, repeats: int, num_batches: int = 200) -> list[dict]:
    from transformers import DataCollatorWithFlattening

    from collators import PackedCollator, pack_dataset

    packed = pack_dataset(dataset, max_length)
    # A random sample of rows mixes rows of long and of short conversations, as a shuffled loader would.
    picked = np.random.default_rng(0).choice(len(packed), size=min(num_batches, len(packed)), replace=False)
    packed_rows = packed.select(sorted(picked.tolist()))[:]
    row_batches = [
        [{"input_ids": ids, "labels": labels, "seq_lengths": lengths}]
        for ids, labels, lengths in zip(packed_rows["input_ids"], packed_rows["labels"], packed_rows["seq_lengths"])
    ]
    conversation_batches = []
    for ids, labels, lengths in zip(packed_rows["input_ids"], packed_rows["labels"], packed_rows["seq_lengths"]):
        bounds = np.concatenate(([0], np.cumsum(lengths))).tolist()
        conversation_batches.append(
            [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in zip(bounds[:-1], bounds[1:])]
        )
    num_tokens = sum(len(ids) for ids in packed_rows["input_ids"])

    ours = PackedCollator()
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    # Same batch content, so the timing compares like with like.
    for batch in conversation_batches[:5]:
        a, b = ours(batch), theirs(batch)
        for key in ("input_ids", "labels", "position_ids"):
            assert torch.equal(a[key], b[key]), key
        assert a["cu_seq_lens_q"].tolist() == b["cu_seq_lens_q"].tolist()

    results = []
    for label, collator, batches in (
        ("PackedCollator (conversations)", ours, conversation_batches),
        ("DataCollatorWithFlattening (conversations)", theirs, conversation_batches),
        ("PackedCollator (packed rows)", ours, row_batches),
    ):
        seconds, _ = best_time(lambda: [collator(batch) for batch in batches], repeats)
        results.append(dict(method=label, max_length=max_length, seconds=seconds, batches=len(batches),
                            tokens=num_tokens, tokens_per_second=num_tokens / seconds))
    return results


def machine() -> dict:
    cpu = platform.processor()
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    packages = ["torch", "transformers", "trl", "datasets", "tokenizers", "numpy", "pyarrow"]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        **{name: metadata.version(name) for name in packages},
    }


def to_markdown(results: dict) -> str:
    info = results["machine"]
    lines = [
        f"Machine: {info['cpu']}, {info['cores']} cores; Python {info['python']}, torch {info['torch']}, "
        f"transformers {info['transformers']}, trl {info['trl']}, datasets {info['datasets']}.",
        f"Data: {results['num_conversations']:,} conversations, {results['num_tokens']:,} tokens, lognormal "
        "lengths (median 500, sigma 1.1) clipped to [8, 16384]. Best of "
        f"{results['repeats']} runs.",
        "",
        "| packing | max_length | rows | efficiency | time (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for row in results["packing"]:
        lines.append(
            f"| {row['method']} | {row['max_length']} | {row['rows']:,} | {row['efficiency']:.3%} | "
            f"{row['seconds']:.2f} |"
        )
    lines += ["", "| collation | max_length | Mtokens/s | vs DataCollatorWithFlattening |", "|---|---:|---:|---:|"]
    for max_length in MAX_LENGTHS:
        rows = [r for r in results["collation"] if r["max_length"] == max_length]
        base = next(r for r in rows if r["method"].startswith("DataCollatorWithFlattening"))
        for row in rows:
            lines.append(
                f"| {row['method']} | {max_length} | {row['tokens_per_second'] / 1e6:.1f} | "
                f"{row['tokens_per_second'] / base['tokens_per_second']:.1f}x |"
            )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-conversations", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.getLogger("collators").setLevel(logging.ERROR)  # the truncation warnings are counted in the table
    import datasets

    datasets.disable_progress_bars()

    dataset, lengths = make_dataset(args.num_conversations)
    results = {
        "machine": machine(),
        "num_conversations": args.num_conversations,
        "num_tokens": int(lengths.sum()),
        "repeats": args.repeats,
        "packing": [],
        "collation": [],
    }
    for max_length in MAX_LENGTHS:
        results["packing"] += bench_packing(dataset, max_length, args.repeats)
        results["collation"] += bench_collation(dataset, max_length, args.repeats)
    markdown = to_markdown(results)
    print(markdown)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "collators.json").write_text(json.dumps(results, indent=2) + "\n")
    (RESULTS / "collators.md").write_text(markdown)


if __name__ == "__main__":
    main()
