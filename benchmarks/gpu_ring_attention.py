"""The streamed context-parallel attention's kernels on one GPU: a simulated ring.

One process stands for rank ``r`` of ``W``: the row's queries, keys and values live on the GPU
whole, and each ring step's keys and values are taken from them (what the ring would have
brought). For each step the script runs what ``context_parallel/blocks.py`` runs on CUDA
(``FlexSteps``: flex attention with the step's block mask, and its backward by recomputation with
the row's output statistics) and times it; the gathered path (what the attention did before the
ring: one flex call of the rank's queries over the whole row's keys, rank-major, one block mask)
is timed beside it. The step results merged by their log-sum-exp must equal the gathered
output, and the step gradients the gathered ones (each key's summed over the steps that read
it); the script also runs the registered attention function itself on a one-rank row (the
autograd Function, the sinks) against the gathered reference.

Shapes: the Llama-3.2-1B attention (32 query heads sharing 8 key/value heads of 64), bf16 and
float32, conversations of 8k-32k tokens, causal; sliding windows and Gemma 2's softcap as extra
configurations (``--parts``). Run on one GPU:

    PYTHONPATH=$PWD python benchmarks/gpu_ring_attention.py \
        --out benchmarks/results/context_parallel_ring_blocks_1xh200.jsonl

Each configuration is one JSON line (``mode: "ring_blocks"``): the median milliseconds of every
step's forward and backward and their sums, the gathered forward and backward, the peak memory
of each (``torch.cuda.max_memory_allocated`` over the inputs), and the largest errors.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from collators.sharding import balanced_chunks  # noqa: E402
from packed_ce.integrations.context_parallel import blocks  # noqa: E402
from packed_ce.integrations.context_parallel.attention import attention  # noqa: E402
from packed_ce.integrations.context_parallel.layout import RowLayout  # noqa: E402
from packed_ce.targets import sequence_ids  # noqa: E402

HEADS, KV_HEADS, DIM = 32, 8, 64
CONFIGS = {  # name -> (window, softcap)
    "causal": (None, None),
    "window-4096": (4096, None),
    "softcap-50": (None, 50.0),
}


def conversation_lengths(length: int, seed: int = 0) -> np.ndarray:
    gen = np.random.default_rng(seed)
    lengths, left = [], length
    while left > 0:
        lengths.append(min(left, int(gen.integers(8192, 32769))))
        left -= lengths[-1]
    return np.array(lengths)


def simulated_layout(lengths: np.ndarray, world: int, rank: int, device) -> RowLayout:
    """Rank ``rank``'s :class:`RowLayout` of the row, as ``RowLayout.gather`` builds it, without
    a process group (``group`` None: nothing in the steps communicates)."""
    total = int(lengths.sum())
    chunks = balanced_chunks(lengths, total, world)  # (W, m)
    size = total // chunks.size
    rows = torch.from_numpy((chunks[:, :, None] * size + np.arange(size)).reshape(-1)).to(device)
    order = torch.empty_like(rows)
    order[rows] = torch.arange(total, device=device)
    positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(device)
    documents = sequence_ids(positions, None, positions)[0][rows]
    local = total // world
    mine = slice(rank * local, (rank + 1) * local)
    layout_chunks = tuple(map(tuple, chunks.tolist()))
    return RowLayout(
        None, rank, world, rows, documents, rows[mine], documents[mine], order, layout_chunks
    )


def gathered_block_mask(layout: RowLayout, window, device):
    """The block mask of the gathered path: this rank's queries over every rank's keys."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, documents = layout.rows, layout.documents
    queries, query_documents = layout.queries, layout.query_documents

    def mask_mod(b, h, q_idx, kv_idx):
        query, key = queries[q_idx], rows[kv_idx]
        visible = (query_documents[q_idx] == documents[kv_idx]) & (key <= query)
        if window is not None:
            visible = visible & (query - key < window)
        return visible

    return create_block_mask(
        mask_mod, None, None, layout.local, rows.numel(), device=device, _compile=True
    )


def timed(function, repeats: int) -> tuple[float, object]:
    """Median milliseconds of ``function()`` over ``repeats`` calls after one warm call."""
    result = function()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = function()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times), result


def peak_mib(function) -> float:
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    function()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def run_config(
    length: int, world: int, config: str, dtype, *, rank: int, repeats: int, device="cuda"
) -> dict:
    device = torch.device(device)
    window, softcap = CONFIGS[config]
    layout = simulated_layout(conversation_lengths(length), world, rank, device)
    local, groups, scale = layout.local, HEADS // KV_HEADS, DIM**-0.5
    gen = torch.Generator(device=device).manual_seed(0)
    row = {  # the row's tensors in rank-major order (rank s's tokens at [s L, (s + 1) L))
        name: torch.randn(heads, length, DIM, device=device, generator=gen).to(dtype)
        for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS), ("up", HEADS))
    }
    mine = slice(rank * local, (rank + 1) * local)
    query = row["q"][:, mine].reshape(KV_HEADS, groups, local, DIM)
    upstream = row["up"][:, mine].float().reshape(KV_HEADS, groups, local, DIM)
    kvs = [torch.stack((row["k"][:, s * local : (s + 1) * local],
                        row["v"][:, s * local : (s + 1) * local])) for s in range(world)]
    steps = blocks.FlexSteps(layout, window, scale, softcap, device)
    active = [step for step in range(world) if steps.active(step)]

    # streamed: each step's forward into the running output, then each step's backward
    def forward():
        out = torch.zeros(query.shape, dtype=torch.float32, device=device)
        lse = torch.full(query.shape[:-1], float("-inf"), device=device)
        for step in active:
            steps.forward(step, query, kvs[layout.source(step)], out, lse)
        return out, lse

    out, lse = forward()
    delta = (upstream * out).sum(-1)

    def backward():
        grad_query = torch.zeros_like(out)
        grad_kvs = [torch.zeros(kv.shape, dtype=torch.float32, device=device) for kv in kvs]
        for step in active:
            source = layout.source(step)
            steps.backward(step, query, kvs[source], lse, upstream, delta, grad_query, grad_kvs[source])
        return grad_query, grad_kvs

    step_ms, step_peaks = {}, []
    scratch_out, scratch_lse = out.clone(), lse.clone()  # merged into again and again: timing only
    for step in active:
        kv = kvs[layout.source(step)]
        grad_query = torch.zeros_like(out)
        grad_kv = torch.zeros(kv.shape, dtype=torch.float32, device=device)

        def step_backward():
            steps.backward(step, query, kv, lse, upstream, delta, grad_query, grad_kv)  # noqa: B023

        forward_ms, _ = timed(lambda: steps.forward(step, query, kv, scratch_out, scratch_lse), repeats)  # noqa: B023
        backward_ms, _ = timed(step_backward, repeats)
        step_ms[step] = (round(forward_ms, 2), round(backward_ms, 2))
        step_peaks.append(peak_mib(step_backward))
    grad_query, grad_kvs = backward()

    # gathered: one flex call over the whole row's keys (rank-major) and its autograd backward
    flex = blocks._flex_attention()
    block_mask = gathered_block_mask(layout, window, device)
    score_mod = None if softcap is None else blocks._softcap_mod(softcap)
    keys = row["k"].detach()[None].requires_grad_()
    values = row["v"].detach()[None].requires_grad_()
    queries = row["q"][:, mine].detach()[None].requires_grad_()

    def gathered():
        from torch.nn.attention.flex_attention import AuxRequest

        return flex(queries, keys, values, score_mod=score_mod, block_mask=block_mask,
                    scale=scale, enable_gqa=True, return_aux=AuxRequest(lse=True))

    gathered_forward_ms, (g_out, g_aux) = timed(gathered, repeats)
    up = row["up"][:, mine][None].to(g_out.dtype)

    def gathered_backward():
        o, _ = gathered()
        return torch.autograd.grad(o, (queries, keys, values), up)

    gathered_total_ms, g_grads = timed(gathered_backward, repeats)
    gathered_peak = peak_mib(gathered_backward)

    errors = {
        "out": relative(out.reshape(1, HEADS, local, DIM), g_out),
        "lse": relative(lse.reshape(1, HEADS, local), g_aux.lse),
        "grad_q": relative(grad_query.reshape(1, HEADS, local, DIM), g_grads[0]),
        "grad_k": relative(torch.cat([g[0] for g in grad_kvs], 1)[None], g_grads[1]),
        "grad_v": relative(torch.cat([g[1] for g in grad_kvs], 1)[None], g_grads[2]),
    }
    return {
        "mode": "ring_blocks",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "gpus": 1,
        "simulated_ranks": world,
        "rank": rank,
        "length": length,
        "dtype": str(dtype).split(".")[-1],
        "config": config,
        "steps_run": len(active),
        "streamed_step_ms": {str(s): {"forward": f, "backward": b} for s, (f, b) in step_ms.items()},
        "streamed_forward_ms": round(sum(f for f, _ in step_ms.values()), 2),
        "streamed_backward_ms": round(sum(b for _, b in step_ms.values()), 2),
        "gathered_forward_ms": round(gathered_forward_ms, 2),
        "gathered_backward_ms": round(gathered_total_ms - gathered_forward_ms, 2),
        "streamed_step_backward_peak_mib": max(step_peaks),
        "gathered_backward_peak_mib": gathered_peak,
        "relative_errors": {k: float(f"{v:.2e}") for k, v in errors.items()},
    }


def ring_of_one(length: int, dtype, device="cuda") -> dict:
    """The registered attention function (the autograd Function over a ring of one, the sinks),
    forward and backward, against the gathered flex reference with sinks from its logsumexp."""
    device = torch.device(device)
    layout = simulated_layout(conversation_lengths(length), 1, 0, device)
    gen = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, HEADS, length, DIM, device=device, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(1, KV_HEADS, length, DIM, device=device, generator=gen).to(dtype).requires_grad_()
            for _ in "kv")
    sinks = torch.randn(HEADS, device=device, generator=gen).requires_grad_()
    up = torch.randn(1, length, HEADS, DIM, device=device, generator=gen).to(dtype)
    out, _ = attention(torch.nn.Module(), q, k, v, None, scaling=DIM**-0.5, s_aux=sinks,
                       packed_ce_row_layout=layout)
    got = torch.autograd.grad((out.float() * up).sum(), (q, k, v, sinks))
    from torch.nn.attention.flex_attention import AuxRequest

    ref_out, aux = blocks._flex_attention()(q, k, v, block_mask=gathered_block_mask(layout, None, device),
                                            scale=DIM**-0.5, enable_gqa=True, return_aux=AuxRequest(lse=True))
    ref_out = ref_out.float() * torch.sigmoid(aux.lse - sinks[None, :, None])[..., None]
    expected = torch.autograd.grad((ref_out.transpose(1, 2) * up).sum(), (q, k, v, sinks))
    return {
        "mode": "ring_of_one",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "length": length,
        "dtype": str(dtype).split(".")[-1],
        "relative_errors": {
            "out": float(f"{relative(out.float(), ref_out.transpose(1, 2)):.2e}"),
            **{f"grad_{n}": float(f"{relative(a, b):.2e}") for n, a, b in zip(("q", "k", "v", "sinks"), got, expected)},
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])  # simulated ranks
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--parts", nargs="+", default=["causal", "extras", "float32", "ring-of-one"],
                        choices=("causal", "extras", "float32", "ring-of-one"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_ring_attention.py needs a CUDA GPU")
        return 1
    # every configuration adds compiled entries (the steps' and the gathered path's masks, score
    # mods, shapes); past dynamo's default of 8 flex attention falls back to eager, whose math
    # path materialises the scores (a 128 GiB allocation at 65,536 tokens)
    torch._dynamo.config.recompile_limit = 64
    runs = []
    if "causal" in args.parts:
        runs += [(n, world, "causal", torch.bfloat16) for n in args.lengths for world in args.worlds]
    if "extras" in args.parts:
        runs += [(args.lengths[-1], 4, c, torch.bfloat16) for c in CONFIGS if c != "causal"]
    if "float32" in args.parts:
        runs += [(args.lengths[0], 4, "causal", torch.float32)]
    # the timings first (flex attention compiles for each new step shape and dtype, tens of
    # seconds each: a run cut short keeps what it measured), the registered function's check last
    start = time.perf_counter()
    lines = (run_config(*run, rank=0, repeats=args.repeats) for run in runs)
    if "ring-of-one" in args.parts:
        dtypes = (torch.bfloat16, torch.float32)
        lines = itertools.chain(lines, (ring_of_one(16384, dtype) for dtype in dtypes))
    print(f"{len(runs)} configurations; parts {' '.join(args.parts)}", flush=True)
    for line in lines:  # each line written as it comes: a run cut short keeps the ones before
        with open(args.out, "a") as handle:
            handle.write(json.dumps(line) + "\n")
        print(f"[{time.perf_counter() - start:.0f} s] {json.dumps(line)}", flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
