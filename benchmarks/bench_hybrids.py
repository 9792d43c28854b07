"""A hybrid model packed against every conversation alone, on a GPU: the gradient each gives.

The model: ``bench_trl.py``'s ``--model`` (default ``qwen3_5-2b``, a Qwen3.5 2B-like layer mix of
gated-delta-rule and attention layers), random weights, built once in float32 and copied to
bfloat16. The data: ``--conversations`` synthetic multi-turn conversations of
``bench_training.py`` packed in one row (``collators.PackedCollator``). Measured, loss and every
parameter gradient (as one vector, relative to the reference's norm):

- ``packed``: ``apply_packed_loss`` on the packed row (the token mixers per conversation) against
  every conversation alone through transformers' own loss, in float32 and in bfloat16;
- ``own``: the same packed row without packed-ce (the family's own packed call, its token mixers
  over the whole row) against every conversation alone, in float32 and in bfloat16;
- ``alone_vs_float32``, ``own_vs_float32``, ``packed_vs_float32`` (bfloat16 after float32 in one
  run): every conversation alone, the family's own packed row and packed-ce's, each in bfloat16
  against every conversation alone in float32: bfloat16's own error, and how far each packed
  arrangement is from the float32 truth on the same scale.

One JSON line per dtype (``--dtypes``, float32 then bfloat16) is appended to ``--out``'s
``hybrids_exactness_<device>.jsonl`` as soon as that dtype is measured, and each phase's start is
printed with the seconds since the start: on a machine whose kernel caches are cold (fla
autotunes, tilelang compiles, for each dtype and for varlen and fixed-length calls) a run cut
short keeps what it measured and shows where its time went::

    PYTHONPATH=.:benchmarks python benchmarks/bench_hybrids.py --out benchmarks/results
"""

from __future__ import annotations

import argparse
import copy
import json
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3_5-2b", choices=tuple(MODELS))
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--attention", default="sdpa")
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16")
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    from collators import PackedCollator
    from packed_ce.integrations import apply_packed_loss

    device = torch.device("cuda")
    rng = np.random.default_rng(0)
    conversations = make_conversations(
        args.conversations, MODELS[args.model]["vocab_size"], ChatShape(), 1024, rng
    )
    batch = {
        k: v.to(device) if torch.is_tensor(v) else v
        for k, v in PackedCollator()(conversations).items()
    }
    start = time.perf_counter()

    def phase(name: str) -> None:
        print(f"[{time.perf_counter() - start:.0f} s] {name}", flush=True)

    phase("building the model")
    base = build_model(args.model, args.attention, device).float()
    truth32 = None
    for name in args.dtypes:
        dtype = getattr(torch, name)
        model = copy.deepcopy(base).to(dtype)
        phase(f"{name}: every conversation alone")
        truth = alone(model, conversations, device)
        result = {
            "model": args.model,
            "conversations": len(conversations),
            "tokens": int(batch["input_ids"].shape[1]),
            "dtype": name,
        }
        if dtype != torch.float32 and truth32 is not None:
            result["alone_vs_float32"] = errors(truth, truth32)
        truth32 = truth if dtype == torch.float32 else truth32
        phase(f"{name}: the family's own packed row")
        own = own_packed(model, batch)
        result["own"] = errors(own, truth)
        apply_packed_loss(model)
        phase(f"{name}: packed-ce's packed row")
        ours = packed(model, batch)
        result["packed"] = errors(ours, truth)
        if "alone_vs_float32" in result:
            # each arrangement against the float32 truth: within bf16's own error when as close
            # to it as every conversation alone in bf16 is
            result["own_vs_float32"] = errors(own, truth32)
            result["packed_vs_float32"] = errors(ours, truth32)
        del model
        result["seconds"] = round(time.perf_counter() - start, 1)
        result["environment"] = harness.environment(
            device, ("torch", "triton", "transformers", "fla-core", "tilelang", "causal-conv1d")
        )
        line = json.dumps(result)
        print(line, flush=True)
        if args.out:
            slug = harness.device_slug(result["environment"])
            with (Path(args.out) / f"hybrids_exactness_{slug}.jsonl").open("a") as handle:
                handle.write(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
