r"""Context parallelism's memory per rank on the CPU: does it follow the shard, not the row?

For each number of ranks ``K`` and row length ``T``, ``K`` processes (gloo) share one packed row
of a tiny hybrid model (``--model hybrid``, Qwen3.5's layout: a gated delta net layer, then a
full-attention layer; hidden 64, 4 query heads sharing 2 key/value heads of 16, float32; or
``--model attention``, a tiny Llama of two full-attention layers; ``--model mamba2``, Nemotron-H's
layout: a Mamba 2 mixer layer, then a full-attention layer) and run one forward and
backward of the packed loss with :func:`enable_context_parallel`: the keys and values stream
around the ranks, the mixers pass their state. ``K = 1`` runs the same streamed path on
a one-rank group (a one-rank model is otherwise left as it was, and transformers' own attention
over a packed row materialises ``T x T`` on the CPU).

What is measured, per rank: the process's resident memory high-water mark during the step minus
its resident memory just before (Linux's ``VmHWM`` after resetting it through
``/proc/self/clear_refs``, ``VmRSS``; the allocator's free memory handed back first with
``malloc_trim``, so that the step cannot reuse memory the baseline counted; a fixed ``mmap``
threshold, see ``main``). ``tracemalloc`` would
not see torch's allocations; torch's own CPU profiler counts its allocations but not what the
allocator or gloo hold. The peak counts everything of the step: the activations kept for the
backward, the attention's blocks and the keys and values in transit, the mixers' halos and states,
the logits and the loss, the gradients. A first step on a short row warms every lazy
initialisation before the measured one.

    python benchmarks/bench_context_parallel_memory.py --ranks 1 2 4 \
        --lengths 16384 65536 131072 262144   # -> results/context_parallel_memory_cpu.jsonl
    python benchmarks/bench_context_parallel_memory.py --ranks 2 4 --mixers gathered \
        --lengths 16384 65536 131072   # the gated delta net gathering the row, for comparison
    python benchmarks/bench_context_parallel_memory.py --model attention \
        --lengths 16384 65536 262144   # attention alone
    python benchmarks/bench_context_parallel_memory.py --model mamba2 --lengths 16384 65536 131072 \
        --out benchmarks/results/context_parallel_memory_cpu_mamba2.jsonl   # Mamba 2 passing its state

Each result is one JSON line (``mode: "memory"``) appended to ``--out``;
``benchmarks/plot_context_parallel_memory.py`` draws them and prints the table.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collators import PackedCollator, shard_batch  # noqa: E402
from packed_ce.integrations import (  # noqa: E402
    apply_packed_loss,
    count_num_items,
    enable_context_parallel,
    tiny_causal_lm,
)
from packed_ce.integrations.context_parallel import context_parallel_of, state  # noqa: E402
from packed_ce.integrations.context_parallel.enable import stream_attention  # noqa: E402
from packed_ce.integrations.model.installation import base_model  # noqa: E402

VOCAB = 256
MiB = 2**20
COUNTS = (
    "resident memory high-water mark of one forward and backward of the whole model (activations "
    "kept for the backward, attention blocks and keys/values in transit, the mixers' halos and "
    "states, logits, loss, gradients) minus the resident memory before it"
)
MODELS = {  # name -> (description, tiny_causal_lm fields)
    "hybrid": (
        "tiny qwen3_5_text: gated delta net + full attention, hidden 64, float32",
        dict(
            model_type="qwen3_5_text",
            layer_types=["linear_attention", "full_attention"],
            head_dim=16,
            linear_num_key_heads=4,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
        ),
    ),
    "mamba2": (
        "tiny nemotron_h: Mamba 2 mixer (4 heads of 16, state 16, chunks of 128) + full "
        "attention, hidden 64, float32",
        dict(
            model_type="nemotron_h",
            layers_block_type=["linear_attention", "full_attention"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=1,
            ssm_state_size=16,
            chunk_size=128,
        ),
    ),
    "attention": ("tiny llama: two full-attention layers, hidden 64, float32", dict()),
}


def conversations(length: int, seed: int) -> list[dict]:
    """Conversations of 1k-4k tokens filling ``length``; the second half of each trained."""
    gen = torch.Generator().manual_seed(seed)
    examples, left = [], length
    while left > 0:
        size = min(left, int(torch.randint(1024, 4097, (1,), generator=gen)))
        ids = torch.randint(0, VOCAB, (size,), generator=gen)
        labels = ids.clone()
        labels[: size // 2] = -100
        examples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
        left -= size
    return examples


def resident_kib() -> dict[str, int]:
    status = open("/proc/self/status").read()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) for key in ("VmRSS", "VmHWM")}


def shard_of(length: int, rank: int, world: int) -> tuple[dict, torch.Tensor]:
    """This rank's shard of the row of ``length`` tokens, and the row's normaliser."""
    batch = PackedCollator(pad_to_multiple_of=2 * world)(conversations(length, seed=length))
    return shard_batch(batch, rank, world), count_num_items(batch)


def measured_step(model, shard: dict, count: torch.Tensor) -> dict:
    """One forward and backward; the peak of resident memory over the baseline (docstring)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = resident_kib()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as handle:  # resets VmHWM to VmRSS
        handle.write("5")
    start = time.perf_counter()
    loss = model(**shard, num_items_in_batch=count).loss
    loss.backward()
    seconds = time.perf_counter() - start
    peak = resident_kib()["VmHWM"]
    return {
        "peak_mib": round((peak - before) / 1024, 1),
        "baseline_mib": round(before / 1024, 1),
        "seconds": round(seconds, 1),
        "loss": float(loss),
    }


def worker(
    rank: int, world: int, port: int, length: int, out: str, mixers: str, model_name: str
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=30))
    try:
        description, fields = MODELS[model_name]
        model = tiny_causal_lm(VOCAB, max_position_embeddings=2 * length, **fields)
        apply_packed_loss(model, backend="torch")
        enable_context_parallel(model)
        if world == 1:  # the streamed path through a ring of one (module docstring)
            stream_attention(base_model(model), context_parallel_of(model))
        if mixers == "gathered":  # the mixers gather the row's inputs, as before
            state.streamed_mixer = lambda *args: None
        shard, count = shard_of(8192, rank, world)  # lazy initialisations, on a short row
        model(**shard, num_items_in_batch=count).loss.backward()
        model.zero_grad(set_to_none=True)
        result = measured_step(model, *shard_of(length, rank, world))
        results = [None] * world
        dist.all_gather_object(results, result)
        if rank == 0:
            line = {
                "mode": "memory",
                "device": "cpu",
                "gpus": world,
                "length": length,
                "mixers": mixers,
                "peak_mib_per_rank": max(r["peak_mib"] for r in results),
                "ranks_peak_mib": [r["peak_mib"] for r in results],
                "ranks_baseline_mib": [r["baseline_mib"] for r in results],
                "seconds": max(r["seconds"] for r in results),
                "loss": round(sum(r["loss"] for r in results), 6),
                "counts": COUNTS,
                "model": description,
                "torch": torch.__version__,
            }
            with open(out, "a") as handle:
                handle.write(json.dumps(line) + "\n")
            print(json.dumps({k: v for k, v in line.items() if k not in ("counts", "model")}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[16384, 65536, 131072, 262144])
    parser.add_argument("--model", choices=sorted(MODELS), default="hybrid")
    parser.add_argument("--mixers", choices=("streamed", "gathered"), default="streamed")
    parser.add_argument("--out", default="benchmarks/results/context_parallel_memory_cpu.jsonl")
    args = parser.parse_args()
    # glibc serves allocations above its mmap threshold from their own mappings, returned to the
    # system when freed; its default threshold rises to the largest block freed, after which the
    # attention's 16 MiB blocks stayed in the heap and the high-water mark counted the heap's
    # fragments (tens of MiB per step, measured). A fixed threshold, set before the ranks start.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    for length in args.lengths:
        for world in args.ranks:
            mp.spawn(
                worker,
                args=(world, free_port(), length, args.out, args.mixers, args.model),
                nprocs=world,
                join=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
