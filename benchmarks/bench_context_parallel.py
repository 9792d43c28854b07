"""Context parallelism on GPUs: the longest packed row that trains, and tokens/s per GPU.

Run one process per GPU (``torchrun --nproc_per_node K``); with K = 1 the model is the plain one
(transformers' flex attention over the packed row, conversations kept apart by its document
mask), with K > 1 the K ranks share each row through :func:`enable_context_parallel` (flex
attention over the gathered keys and values). Both: the Llama-3.2-1B shape in bf16, full
fine-tune with AdamW, gradient checkpointing, the fused linear cross entropy, rows of long
conversations (8k to 32k tokens, the second half of each trained). Each rank's summed
gradients are all-reduced by hand (no DDP buckets, the same optimiser on every rank).

- ``--mode longest``: rows of ``--lengths`` tokens, ascending, two optimiser steps each; a
  length fits when both steps train. The first out-of-memory ends the run (the rank that ran
  out writes it down; the others end on the NCCL timeout).
- ``--mode throughput``: ``--warmup`` then ``--steps`` timed steps at ``--lengths[0]``; reports
  the median step and tokens/s per GPU.
- ``--mode profile``: ``--warmup`` steps, then ``--steps`` steps under the torch profiler; the
  GPU time per step of each kind of kernel (attention forward and backward, matrix products,
  collectives, the loss, the optimiser, ...) on every rank, and the step's wall time.

``--sharding zigzag`` gives each rank chunks ``r`` and ``2W - 1 - r`` (the earlier layout) instead
of :func:`collators.shard_batch`'s chunks balanced by attention work, for comparison.

Every result is a JSON line appended to ``--out`` by rank 0 (or by the rank that ran out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_trl import MODELS  # noqa: E402

from collators import PackedCollator, shard_batch  # noqa: E402
from packed_ce.integrations import (  # noqa: E402
    apply_packed_loss,
    count_num_items,
    enable_context_parallel,
)

GiB = 2**30


def conversations_row(length: int, vocab: int, seed: int) -> list[dict]:
    """Conversations of 8k-32k tokens filling ``length`` tokens; the second half of each is the
    assistant's (trained)."""
    gen = torch.Generator().manual_seed(seed)
    examples, left = [], length
    while left > 0:
        size = min(left, int(torch.randint(8192, 32769, (1,), generator=gen)))
        ids = torch.randint(0, vocab, (size,), generator=gen)
        labels = ids.clone()
        labels[: size // 2] = -100
        examples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
        left -= size
    return examples


def build(model_name: str, world: int, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    attention = "flex_attention" if world == 1 else "sdpa"  # sdpa is replaced under CP
    config = LlamaConfig(**MODELS[model_name], use_cache=False, attn_implementation=attention)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    apply_packed_loss(model, fused_linear=True)
    if world > 1:
        enable_context_parallel(model)
    return model


def step(model, optimizer, batch: dict, rank: int, world: int) -> float:
    """One optimiser step; under DDP (``world > 1``) the shares' gradients are summed as DDP
    averages them, overlapped with the backward: each share times ``world``."""
    num_items = count_num_items(batch)  # every rank counts the row it shards; the model divides
    inputs = shard_batch(batch, rank, world) if world > 1 else batch
    loss = model(**inputs, num_items_in_batch=num_items).loss
    (loss * world).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return float(total)


def zigzag_chunks(lengths, num_tokens: int, world_size: int):
    """Chunks ``r`` and ``2W - 1 - r`` for rank ``r``: balanced for one causal conversation only."""
    import numpy as np

    return np.array([[r, 2 * world_size - 1 - r] for r in range(world_size)])


# Kernel names (lower case) -> the part of the step they belong to; the first match wins.
KERNEL_KINDS = (
    ("collectives", ("nccl",)),
    ("attention backward", ("flex_attention_backward", "tem_fused_flex_attention_backward", "attention_backward")),
    ("attention forward", ("flex_attention", "tem_fused", "attention")),
    ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_")),
    ("loss", ("cross_entropy", "_ce_", "fused_linear")),
    ("optimiser", ("multi_tensor", "adam")),
    ("copies and gathers", ("copy", "index", "gather", "scatter", "cat")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, patterns in KERNEL_KINDS:
        if any(pattern in lowered for pattern in patterns):
            return kind
    return "other kernels"


def profile(model, optimizer, batch: dict, rank: int, world: int, steps: int) -> dict:
    """GPU milliseconds per step of each kind of kernel on this rank, and the wall time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step(model, optimizer, batch, rank, world)
        torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        micros = getattr(event, "self_device_time_total", 0) or 0
        if micros > 0:
            kind = kernel_kind(event.key)
            kinds[kind] = kinds.get(kind, 0.0) + micros / 1000 / steps
            kernels.append((micros / 1000 / steps, event.count // steps, kind, event.key[:90]))
    top = [dict(ms=round(ms, 1), calls=calls, kind=kind, name=name) for ms, calls, kind, name in sorted(kernels)[::-1][:12]]
    return {"wall_ms": round(wall * 1000, 1), **{k: round(v, 1) for k, v in sorted(kinds.items())}, "top": top}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("longest", "throughput", "profile"), required=True)
    parser.add_argument("--sharding", choices=("balanced", "zigzag"), default="balanced")
    parser.add_argument("--model", default="1b", choices=sorted(MODELS))
    parser.add_argument("--lengths", type=int, nargs="+", required=True)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=90))
    if args.sharding == "zigzag":
        import collators.sharding

        collators.sharding.balanced_chunks = zigzag_chunks
    model = build(args.model, world, device)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index], gradient_as_bucket_view=True
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = getattr(model, "module", model).config.vocab_size
    props = torch.cuda.get_device_properties(device)
    base = dict(
        mode=args.mode, model=args.model, gpus=world, device=props.name,
        torch=torch.__version__, gradient_checkpointing=True, attention="flex_attention",
        sharding=args.sharding if world > 1 else None,
    )

    def record(**fields) -> None:
        with args.out.open("a") as out:
            out.write(json.dumps({**base, **fields}) + "\n")
        print(json.dumps({**base, **fields}), flush=True)

    if args.mode in ("throughput", "profile"):
        length = args.lengths[0]
        batch = {k: v.to(device) if torch.is_tensor(v) else v
                 for k, v in PackedCollator(pad_to_multiple_of=2 * world)(conversations_row(length, vocab, 0)).items()}
    if args.mode == "profile":
        for _ in range(args.warmup):
            step(model, optimizer, batch, rank, world)
        mine = profile(model, optimizer, batch, rank, world, args.steps)
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            record(length=length, steps=args.steps, ranks=every)
        dist.destroy_process_group()
        return 0
    if args.mode == "throughput":
        seconds = []
        for index in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step(model, optimizer, batch, rank, world)
            torch.cuda.synchronize()
            if index >= args.warmup:
                seconds.append(time.perf_counter() - start)
        median = statistics.median(seconds)
        if rank == 0:
            record(length=length, median_step_s=round(median, 4), steps=args.steps,
                   tokens_per_s_per_gpu=round(length / median / world, 1),
                   peak_gib=round(torch.cuda.max_memory_allocated(device) / GiB, 2))
        dist.destroy_process_group()
        return 0

    for length in args.lengths:
        batch = {k: v.to(device) if torch.is_tensor(v) else v
                 for k, v in PackedCollator(pad_to_multiple_of=2 * world)(conversations_row(length, vocab, 1)).items()}
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        try:
            for _ in range(2):
                loss = step(model, optimizer, batch, rank, world)
        except torch.OutOfMemoryError:
            record(length=length, fits=False, rank=rank, seconds=round(time.perf_counter() - start, 1))
            sys.stdout.flush()
            os._exit(3)  # the other ranks wait in a collective: they end on the NCCL timeout
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) / GiB, device=device)
        if world > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if rank == 0:
            record(length=length, fits=True, loss=round(loss, 4), peak_gib=round(float(peak), 2),
                   seconds=round(time.perf_counter() - start, 1))
        del batch
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
