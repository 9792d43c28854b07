"""A hybrid model packed against every conversation alone, on a GPU: the gradient each gives.

The model: ``bench_trl.py``'s ``--model`` (default ``qwen3_5-2b``, a Qwen3.5 2B-like layer mix of
gated-delta-rule and attention layers), random weights, built once in float32 and copied to
bfloat16. The data: ``--conversations`` synthetic multi-turn conversations of
``bench_training.py`` packed in one row (``collators.PackedCollator``), and ``--samples - 1``
more rows of the same conversations' shapes with other tokens (one row says little of bf16's
spread; the same shapes need no new compile). Measured, loss and every
parameter gradient (as one vector, relative to the reference's norm):

- ``packed``: ``apply_packed_loss`` on the packed row (the token mixers per conversation) against
  every conversation alone through transformers' own loss, in float32 and in bfloat16;
- ``own``: the same packed row without packed-ce (the family's own packed call, its token mixers
  over the whole row) against every conversation alone, in float32 and in bfloat16;
- ``alone_vs_float32``, ``own_vs_float32``, ``packed_vs_float32`` (bfloat16 after float32 in one
  run): every conversation alone, the family's own packed row and packed-ce's, each in bfloat16
  against every conversation alone in float32: bfloat16's own error, and how far each packed
  arrangement is from the float32 truth on the same scale.

One JSON line per dtype and row (``--dtypes``, float32 then bfloat16; ``sample``; and
``triton_f32_default``, Triton's precision of float32 dots, unset meaning TF32 on Hopper) is
appended to ``--out``'s ``hybrids_exactness_<device>.jsonl`` as soon as it is measured, and each
phase's start is
printed with the seconds since the start: on a machine whose kernel caches are cold (fla
autotunes, tilelang compiles, for each dtype and for varlen and fixed-length calls) a run cut
short keeps what it measured and shows where its time went::

    PYTHONPATH=.:benchmarks python benchmarks/bench_hybrids.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import harness
from bench_training import ChatShape, make_conversations
from bench_trl import MODELS, build_model


def alone(model, conversations, device) -> tuple[torch.Tensor, dict]:
    """The mean over conversations of transformers' loss of each alone, and its gradients."""
    model.zero_grad(set_to_none=True)
    total = 0.0
    for conversation in conversations:
        ids = torch.tensor([conversation["input_ids"]], device=device)
        labels = torch.tensor([conversation["labels"]], device=device)
        logits = model(input_ids=ids, use_cache=False).logits
        loss = ForCausalLMLoss(logits, labels, logits.shape[-1]) / len(conversations)
        loss.backward()
        total += loss.detach().float()
    return total, {n: p.grad.float().clone() for n, p in model.named_parameters()}


def packed(model, batch) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def own_packed(model, batch) -> tuple[torch.Tensor, dict]:
    """The family's own packed call: its logits, the per-conversation mean over cu_seqlens."""
    import packed_ce

    model.zero_grad(set_to_none=True)
    call = {k: v for k, v in batch.items() if k in ("input_ids", "position_ids")}
    logits = model(**call, use_cache=False).logits
    loss = packed_ce.cross_entropy(
        logits.float(), batch["labels"], cu_seqlens=batch["cu_seqlens"], is_packed=True, shift=True
    )
    loss.backward()
    return loss.detach(), {n: p.grad.float().clone() for n, p in model.named_parameters()}


def errors(actual, expected) -> dict:
    (loss, grads), (loss_ref, grads_ref) = actual, expected
    flat = torch.cat([grads[n].reshape(-1) - grads_ref[n].reshape(-1) for n in grads_ref])
    norm = torch.cat([grads_ref[n].reshape(-1) for n in grads_ref]).norm()
    return {
        "loss": float((loss - loss_ref).abs() / loss_ref.abs()),
        "gradients": float(flat.norm() / norm),
    }


def redrawn(conversations: list[dict], vocab: int, seed: int) -> list[dict]:
    """``conversations`` with new tokens drawn from ``seed``: the same lengths and trained spans,
    so the kernels meet the shapes they were compiled and autotuned for."""
    rng = np.random.default_rng(seed)
    out = []
    for conversation in conversations:
        ids = rng.integers(0, vocab, len(conversation["input_ids"]))
        trained = np.asarray(conversation["labels"]) != -100
        out.append({"input_ids": ids.tolist(), "labels": np.where(trained, ids, -100).tolist()})
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_5-2b", choices=tuple(MODELS))
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16")
    )
    parser.add_argument(
        "--samples", type=int, default=1, help="rows of the same shapes with other tokens"
    )
    parser.add_argument("--device", default="cuda", help="cpu: a check of the script itself")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from collators import PackedCollator
    from packed_ce.integrations import apply_packed_loss

    device = torch.device(args.device)
    vocab = MODELS[args.model]["vocab_size"]
    rng = np.random.default_rng(0)
    first = make_conversations(args.conversations, vocab, ChatShape(), 1024, rng)
    samples = [first] + [redrawn(first, vocab, seed) for seed in range(1, args.samples)]
    batches = [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in PackedCollator()(rows).items()}
        for rows in samples
    ]
    start = time.perf_counter()

    def phase(name: str) -> None:
        print(f"[{time.perf_counter() - start:.0f} s] {name}", flush=True)

    phase("building the model")
    base = build_model(args.model, args.attention, device).float()
    environment = harness.environment(
        device, ("torch", "triton", "transformers", "fla-core", "tilelang", "causal-conv1d")
    )
    truths32 = []  # each sample's conversations alone in float32: what bf16 is read against
    for name in args.dtypes:
        dtype = getattr(torch, name)
        model = copy.deepcopy(base).to(dtype)
        truths, results = [], []
        for index, rows in enumerate(samples):
            result = {
                "model": args.model,
                "conversations": len(rows),
                "tokens": int(batches[index]["input_ids"].shape[1]),
                "dtype": name,
                "sample": index,
                # Triton's precision of float32 dots (fla's): unset is TF32 on Hopper
                "triton_f32_default": os.environ.get("TRITON_F32_DEFAULT"),
            }
            phase(f"{name}, sample {index}: every conversation alone")
            truths.append(alone(model, rows, device))
            against32 = dtype != torch.float32 and len(truths32) > index
            if against32:
                result["alone_vs_float32"] = errors(truths[-1], truths32[index])
            phase(f"{name}, sample {index}: the family's own packed row")
            own = own_packed(model, batches[index])
            result["own"] = errors(own, truths[-1])
            if against32:
                result["own_vs_float32"] = errors(own, truths32[index])
            results.append(result)
            del own
        apply_packed_loss(model)
        for index, result in enumerate(results):
            phase(f"{name}, sample {index}: packed-ce's packed row")
            ours = packed(model, batches[index])
            result["packed"] = errors(ours, truths[index])
            if "alone_vs_float32" in result:
                # each arrangement against the float32 truth: within bf16's own error when as
                # close to it as every conversation alone in bf16 is
                result["packed_vs_float32"] = errors(ours, truths32[index])
            del ours
            result["seconds"] = round(time.perf_counter() - start, 1)
            result["environment"] = environment
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                slug = harness.device_slug(environment)
                with (Path(args.out) / f"hybrids_exactness_{slug}.jsonl").open("a") as handle:
                    handle.write(line + "\n")
        if dtype == torch.float32:
            truths32 = truths
        del model, truths
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
