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
    num_items = count_num_items(batch)  # summed over the ranks, each row counted once
    inputs = shard_batch(batch, rank, world) if world > 1 else batch
    loss = model(**inputs, num_items_in_batch=num_items).loss
    loss.backward()
    if world > 1:
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)  # the shares' gradients add up to the row's
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    total = loss.detach().clone()
    if world > 1:
        dist.all_reduce(total)
    return float(total)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("longest", "throughput"), required=True)
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
    model = build(args.model, world, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    vocab = model.config.vocab_size
    props = torch.cuda.get_device_properties(device)
    base = dict(
        mode=args.mode, model=args.model, gpus=world, device=props.name,
        torch=torch.__version__, gradient_checkpointing=True, attention="flex_attention",
    )

    def record(**fields) -> None:
        with args.out.open("a") as out:
            out.write(json.dumps({**base, **fields}) + "\n")
        print(json.dumps({**base, **fields}), flush=True)

    if args.mode == "throughput":
        length = args.lengths[0]
        batch = {k: v.to(device) if torch.is_tensor(v) else v
                 for k, v in PackedCollator(pad_to_multiple_of=2 * world)(conversations_row(length, vocab, 0)).items()}
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
