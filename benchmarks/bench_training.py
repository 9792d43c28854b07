"""Whole SFT steps of a Llama-style model: what packing with the per-conversation mean buys.

Each step is forward, loss, backward and an AdamW step of a ~0.9B-parameter Llama-style model
(random init from a ``LlamaConfig``, bf16 weights and optimiser state), on the same
conversations for every run, from the same initial weights; every step is one packed row of up
to 8192 tokens:

- ``packed``: the step's conversations in one packed row (``collators.PackedCollator``),
  document-masked attention (``--attention``: flex attention by default on CUDA, or sdpa; either
  way transformers builds the block-diagonal causal mask from the restarting ``position_ids``,
  no ``attention_mask`` is passed and the cache is off), and
  ``packed_ce.fused_linear_cross_entropy(..., is_packed=True)`` with its defaults: the mean over
  conversations of each conversation's mean token loss.
- ``padded``: the same conversations one per row (``collators.PaddedCollator``), micro-batches of
  ``--padded-batch`` conversations in the step's (shuffled) order, sdpa with the padding mask,
  and the same objective written in plain PyTorch (each row's mean token loss, summed, divided
  by the step's number of conversations), gradients accumulated over the micro-batches. Before
  its timed steps every micro-batch goes forward and backward once, untimed by step (see
  ``see_every_shape``): every run is then timed on shapes it has seen, as in a long run.
- ``stock``: the packed rows of ``packed`` and transformers' own loss (``model(...,
  labels=...)``): the token mean that padding-free training gives without packed_ce. Another
  objective: it is here for its speed.
- ``packed_exact_length``: ``packed`` with rows of their exact length instead of a fixed one,
  one warm-up and 4 steps only, made last: with flex attention a new row length compiles again
  (tens of seconds), and torch.compile's automatic dynamic shapes (the default of the
  ``torch.compile(flex_attention)`` that transformers makes) may then compile a version for any
  length; the compiles counted per step show which happened (torch 2.11: one recompile at the
  first new length, none after it, and slower steps).

Data (``make_conversations``): synthetic multi-turn chat. Per conversation a system prompt with
probability 1/2 (lognormal length, median 40 tokens), then 1 + Geometric(0.45) user/assistant
exchanges (mean 2.2, at most 8), user turns lognormal with median 60 tokens and sigma 1.0,
assistant turns lognormal with median 220 and sigma 0.8, 4 template tokens per turn; cut at
``--max-conversation`` tokens. Only assistant turns are targets (the prompt, user turns and
templates are ignored). These parameters are chosen to resemble public multi-turn SFT chat sets
(a few exchanges, answers of a few hundred tokens, a long tail); they are not fitted to one.
Token ids are uniform random: the speed does not depend on them.

Steps: the conversations are packed best-fit-decreasing into rows of ``--row-tokens`` tokens;
each step is one row, in shuffled order, and every run trains on the same steps. Each packed
row is padded to a multiple of ``--pad-to-multiple`` (default: the row size, so every step has
the same shape and a compiled attention kernel never meets a new length); ``PackedCollator(
pad_to_multiple_of=...)`` is how a user does the same. The padding is a segment of its own
with no target: the loss does not change.

Reported per run: warm-up steps one by one (compilation, autotuning, allocator growth), then
the steady state: median step time and its p20-p80, tokens/s counting real tokens only (no
padding), the graphs torch.compile compiled in each step (flex attention and its block mask:
a compile after the warm-up is a recompile), the steps slower than twice the median, and the
peak of allocated GPU memory over the run (weights, gradients and optimiser state included).
Before the runs, with the initial weights, every conversation's mean loss from the packed row
is compared with the one from its padded row, every step's loss likewise (max relative
differences printed and asserted), and after them the first training step's loss of
``packed`` with that of ``padded``. A progress line per phase and per step is printed
(flushed) as the run goes, with the seconds since the start, so that a run stopped from
outside still shows where it was; no run and no step starts after ``Plan.seconds``, and what
was left out is said in the results.

On a GPU machine, from the repository root (sized to end within 3 minutes on an H100: a
few seconds of model set-up, about a minute of compilation, 13 steps per run)::

    PYTHONPATH=. python benchmarks/bench_training.py
    PYTHONPATH=. python benchmarks/bench_training.py --tiny      # CPU, tiny model, seconds

Writes ``benchmarks/results/training_<device>.json`` and ``.md`` (``--tiny``: a temporary
folder unless ``--out`` is given). Does not import ``datasets`` or ``trl``.

Dimensions: B rows, T tokens per row, H hidden size, V vocabulary, S sequences.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import harness
import make_tables

IGNORE_INDEX = harness.IGNORE_INDEX
DISTRIBUTIONS = ("torch", "triton", "transformers")


@dataclass(frozen=True)
class ChatShape:
    """Parameters of the synthetic multi-turn length distribution (tokens)."""

    system_median: float = 40.0
    user_median: float = 60.0
    user_sigma: float = 1.0
    assistant_median: float = 220.0
    assistant_sigma: float = 0.8
    exchange_p: float = 0.45  # exchanges = 1 + Geometric(p), at most max_exchanges
    max_exchanges: int = 8
    template_tokens: int = 4  # per turn: role header and end-of-turn


@dataclass(frozen=True)
class Plan:
    model: dict  # LlamaConfig keywords
    dtype: torch.dtype
    chat: ChatShape
    row_tokens: int
    max_conversation: int
    warmup: int
    steps: int
    exact_steps: int  # steady steps of the packed_exact_length run, after one warm-up step
    padded_batch: int
    seconds: float  # no run or step starts this long after the start (the results say so)


GPU_PLAN = Plan(
    # ~0.9B parameters: 16 layers of hidden 2048 (GQA 16/8 heads, SwiGLU 5632), vocabulary 32000
    model=dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=8192,
    ),
    dtype=torch.bfloat16,
    chat=ChatShape(),
    row_tokens=8192,
    max_conversation=4096,
    warmup=3,
    steps=10,
    exact_steps=4,
    padded_batch=4,
    # the runs then end within 4 minutes of the start even if a compile takes a minute
    seconds=180.0,
)
# Seconds on a CPU: a 2-layer model, conversations and rows scaled down by 16.
TINY_PLAN = Plan(
    model=dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=1024,
    ),
    dtype=torch.float32,
    chat=ChatShape(system_median=3, user_median=4, assistant_median=14, max_exchanges=4),
    row_tokens=256,
    max_conversation=128,
    warmup=1,
    steps=2,
    exact_steps=2,
    padded_batch=4,
    seconds=600.0,
)


# --------------------------------------------------------------------------------------------
# Data


def make_conversations(
    count: int, vocab: int, shape: ChatShape, max_length: int, rng: np.random.Generator
) -> list[dict]:
    """``count`` tokenized conversations ``{"input_ids", "labels"}`` (lists of int), labels
    ``-100`` outside the assistant turns, each at most ``max_length`` tokens with a target."""
    conversations = []
    while len(conversations) < count:
        segments = []  # (length, is_target)
        if rng.random() < 0.5:
            segments.append(
                (shape.template_tokens + _lognormal(rng, shape.system_median, 0.5), False)
            )
        exchanges = min(shape.max_exchanges, int(rng.geometric(shape.exchange_p)))
        for _ in range(exchanges):
            segments.append(
                (
                    shape.template_tokens + _lognormal(rng, shape.user_median, shape.user_sigma),
                    False,
                )
            )
            segments.append((shape.template_tokens, False))  # the assistant's role header
            segments.append((_lognormal(rng, shape.assistant_median, shape.assistant_sigma), True))
        labels = np.concatenate([np.full(n, 1 if target else 0) for n, target in segments])[
            :max_length
        ]
        if not labels[1:].any():  # cut before its first answer: nothing to learn
            continue
        ids = rng.integers(0, vocab, labels.size)
        conversations.append(
            {"input_ids": ids.tolist(), "labels": np.where(labels == 1, ids, IGNORE_INDEX).tolist()}
        )
    return conversations


def _lognormal(rng: np.random.Generator, median: float, sigma: float) -> int:
    return max(1, int(round(rng.lognormal(math.log(median), sigma))))


@dataclass
class Step:
    """One optimiser step's conversations, collated for every run (on the device)."""

    conversations: list[int]  # indices, in packed-row order
    packed: dict  # PackedCollator batch, padded to the plan's multiple
    packed_exact: dict  # the same row at its exact length
    padded: list[dict]  # PaddedCollator micro-batches
    padded_order: list[int]  # positions in `conversations` of the padded rows, in order
    real_tokens: int
    target_tokens: int


def make_steps(
    conversations: list[dict],
    count: int,
    plan: Plan,
    pad_to_multiple: int,
    device: torch.device,
    rng: np.random.Generator,
) -> list[Step]:
    """The first ``count`` packed rows (in shuffled order) and their padded micro-batches."""
    from collators import PackedCollator, PaddedCollator
    from collators.planning import best_fit_decreasing

    rows = best_fit_decreasing([len(c["input_ids"]) for c in conversations], plan.row_tokens)
    # best-fit-decreasing opens rows longest conversations first: shuffle so that the warm-up
    # steps are not the ones with the longest conversations
    order = rng.permutation(len(rows))
    if len(rows) < count:
        raise ValueError(f"{len(rows)} packed rows, {count} steps wanted: make more conversations")
    packed, exact, padded = (
        PackedCollator(pad_to_multiple_of=pad_to_multiple),
        PackedCollator(),
        PaddedCollator(),
    )
    steps = []
    for row in (rows[i] for i in order[:count]):
        examples = [conversations[i] for i in row]
        shuffled = rng.permutation(len(row)).tolist()  # a shuffled loader's order
        micro = [shuffled[i : i + plan.padded_batch] for i in range(0, len(row), plan.padded_batch)]
        steps.append(
            Step(
                conversations=list(row),
                packed=_to(packed(examples), device),
                packed_exact=_to(exact(examples), device),
                padded=[_to(padded([examples[i] for i in part]), device) for part in micro],
                padded_order=[i for part in micro for i in part],
                real_tokens=sum(len(e["input_ids"]) for e in examples),
                target_tokens=sum(
                    sum(label != IGNORE_INDEX for label in e["labels"][1:]) for e in examples
                ),
            )
        )
    return steps


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


# --------------------------------------------------------------------------------------------
# Model and losses


def build_model(plan: Plan, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    # use_cache=False: with a cache transformers ignores the packed position_ids and the
    # conversations of a row would attend to each other
    config = LlamaConfig(**plan.model, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(plan.dtype).train()


def packed_loss(model, batch: dict, **options) -> torch.Tensor:
    """packed_ce's per-conversation mean on one packed row, the LM head fused with the loss."""
    import packed_ce

    hidden = model.model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"]
    ).last_hidden_state
    return packed_ce.fused_linear_cross_entropy(
        hidden,  # (1, T, H)
        model.lm_head.weight,  # (V, H)
        batch["labels"],  # (1, T), aligned with the inputs
        cu_seqlens=batch["cu_seqlens"],
        is_packed=True,
        shift=True,
        **options,
    )


def padded_row_means(model, batch: dict) -> torch.Tensor:
    """(B,) each padded row's mean token loss, in plain PyTorch (the independent reference)."""
    hidden = model.model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
    ).last_hidden_state
    logits = model.lm_head(hidden[:, :-1]).float()  # (B, T-1, V): token t predicts t+1
    targets = batch["labels"][:, 1:]
    token_loss = F.cross_entropy(
        logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none"
    )
    return token_loss.sum(1) / (targets != IGNORE_INDEX).sum(1)


def stock_loss(model, batch: dict) -> torch.Tensor:
    """transformers' own causal-LM loss on the packed row: the mean over all target tokens."""
    return model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]
    ).loss


def train_step(run: str, model, step: Step) -> torch.Tensor:
    """Forward and backward of one step (the caller steps the optimiser); the step's loss,
    detached, read by the caller after the step (no host sync in between)."""
    if run == "padded":
        total = 0.0
        for batch in step.padded:
            # sum of row means / conversations in the step: the step's per-conversation mean
            loss = padded_row_means(model, batch).sum() / len(step.conversations)
            loss.backward()
            total = total + loss.detach()
        return total
    if run == "stock":
        loss = stock_loss(model, step.packed)
    else:
        loss = packed_loss(
            model, step.packed_exact if run == "packed_exact_length" else step.packed
        )
    loss.backward()
    return loss.detach()


# --------------------------------------------------------------------------------------------
# Runs


RUNS = {
    "packed": "packed rows, document-masked attention, packed_ce is_packed=True (fused, defaults)",
    "padded": "padded rows, sdpa + padding mask, per-conversation mean in PyTorch",
    "stock": "packed rows, document-masked attention, transformers' token-mean loss",
    "packed_exact_length": "packed, rows at their exact length (new shapes)",
}


@dataclass
class Clock:
    """Seconds since the start: progress lines and the deadline after which nothing starts."""

    start: float  # time.monotonic() at the start
    budget: float  # seconds after the start past which no run or step starts

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def past_deadline(self) -> bool:
        return self.elapsed() > self.budget

    def log(self, message: str) -> None:
        # flushed: a run stopped from outside (or piped) still shows where it was
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled so far in this process: transformers compiles flex
    attention and its block mask; a step that adds some has compiled (or recompiled)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def see_every_shape(model, steps: list[Step], device: torch.device, clock: Clock) -> dict:
    """Forward and backward of every padded micro-batch once, untimed by step, the gradients
    dropped and no optimiser step (the weights do not change).

    Each micro-batch of the padded run has a shape of its own (rows of its longest
    conversation), and the first step with new shapes took seconds where the same step with
    seen shapes took a few tenths (first H100 run: 0.34 to 1.95 s per step, no torch.compile
    involved): a per-shape set-up in the attention or GEMM libraries. A long run meets its
    shapes again, so the timed steps run on shapes seen here; what a first sight costs is
    reported apart.
    """
    seconds = []
    for step in steps:
        for batch in step.padded:
            harness.synchronize(device)
            start = time.perf_counter()
            padded_row_means(model, batch).sum().backward()
            harness.synchronize(device)
            seconds.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    shapes = {tuple(b["input_ids"].shape) for step in steps for b in step.padded}
    clock.log(
        f"padded: {len(seconds)} micro-batches of {len(shapes)} shapes seen once, "
        f"{sum(seconds):.1f} s (median {statistics.median(seconds):.3f} s, "
        f"max {max(seconds):.3f} s per micro-batch)"
    )
    return {
        "micro_batches": len(seconds),
        "shapes": len(shapes),
        "seconds": seconds,
        "median_seconds": statistics.median(seconds),
    }


def run_training(
    run: str,
    model,
    initial: dict,
    steps: list[Step],
    warmup: int,
    attention: str,
    device: torch.device,
    clock: Clock,
) -> dict:
    """Up to ``len(steps)`` optimiser steps from the initial weights, each timed on its own;
    none starts past the clock's deadline."""
    model.load_state_dict(initial)
    model.set_attn_implementation("sdpa" if run == "padded" else attention)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-5, **({"fused": True} if device.type == "cuda" else {})
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    first_sight = see_every_shape(model, steps, device, clock) if run == "padded" else None
    seconds, compiles, losses = [], [], []
    for index, step in enumerate(steps):
        if clock.past_deadline():
            clock.log(f"{run}: past {clock.budget:.0f} s, {len(steps) - index} steps not run")
            break
        graphs = compiled_graphs()
        harness.synchronize(device)
        start = time.perf_counter()
        loss = train_step(run, model, step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        harness.synchronize(device)
        seconds.append(time.perf_counter() - start)
        compiles.append(compiled_graphs() - graphs)
        losses.append(loss.item())
        row = (
            f", row of {step.packed_exact['input_ids'].shape[1]} tokens"
            if run == "packed_exact_length"
            else ""
        )
        clock.log(
            f"{run} {'warm-up' if index < warmup else 'step'} {index + 1}/{len(steps)}: "
            f"{seconds[-1]:.3f} s, {compiles[-1]} graphs compiled, loss {losses[-1]:.4f}{row}"
        )
    del optimizer
    steady = seconds[warmup:]
    tokens = [step.real_tokens for step in steps[warmup : len(seconds)]]
    result = {
        "label": RUNS[run],
        "attention": "sdpa" if run == "padded" else attention,
        "warmup_seconds": seconds[:warmup],
        "warmup_compiles": compiles[:warmup],
        "step_seconds": steady,
        "step_compiles": compiles[warmup:],
        "recompiles": sum(compiles[warmup:]),
        "steps_not_run": len(steps) - len(seconds),
        "losses": losses,
        # per step, then the median: one slow step moves it no more than the median step time
        "tokens_per_second": (
            statistics.median(t / s for t, s in zip(tokens, steady)) if steady else None
        ),
    }
    if first_sight is not None:
        result["shapes_seen_before"] = first_sight
    if run == "packed_exact_length":
        result["row_lengths"] = [
            step.packed_exact["input_ids"].shape[1] for step in steps[: len(seconds)]
        ]
    if steady:
        result |= harness.summarize(steady, unit="seconds")
        result["slow_steps"] = sum(s > 2 * result["median_seconds"] for s in steady)
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / harness.GiB
    return result


def check_objective(model, initial: dict, steps: list[Step], attention: str) -> dict:
    """With the initial weights, untimed, on every step: each conversation's mean loss from the
    packed row against the one from its padded row, and each step's loss both ways.

    The packed forwards run with gradients enabled, as in training, though nothing calls
    backward: transformers' compiled flex attention is specialised on the grad mode, so a check
    under ``no_grad`` would compile it a second time (tens of seconds on the GPU)."""
    model.load_state_dict(initial)
    model.set_attn_implementation(attention)
    packed_means, packed_losses, stock_losses = [], [], []
    for step in steps:
        batch = step.packed
        # reduction="none": w_t * l_t per token, w_t = 1 / (targets of its conversation), so a
        # conversation's sum is its mean token loss
        weighted = packed_loss(model, batch, reduction="none").detach().reshape(-1).float()
        lengths = batch["cu_seqlens"].diff().long()
        sequence = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=lengths.device), lengths
        )
        means = torch.zeros(lengths.numel(), device=weighted.device).index_add_(
            0, sequence, weighted
        )
        packed_means.append(means[: len(step.conversations)])  # the padding segment is last
        packed_losses.append(packed_loss(model, batch).detach().float())
        stock_losses.append(stock_loss(model, batch).detach().float())
    model.set_attn_implementation("sdpa")
    padded_means = []
    with torch.no_grad():  # sdpa: nothing compiled
        for step in steps:
            rows = torch.cat([padded_row_means(model, b).float() for b in step.padded])
            order = torch.tensor(step.padded_order, device=rows.device)
            padded_means.append(torch.empty_like(rows).index_copy_(0, order, rows))
    packed, padded = torch.cat(packed_means), torch.cat(padded_means)
    padded_steps = torch.stack([means.mean() for means in padded_means])  # (steps,)
    return {
        "steps": len(steps),
        "conversations": padded.numel(),
        "packed_conversation_losses": packed.tolist(),
        "padded_conversation_losses": padded.tolist(),
        "max_rel_diff_per_conversation": relative(packed, padded).max().item(),
        "rel_diff_loss": relative(torch.stack(packed_losses), padded_steps).max().item(),
        "rel_diff_stock_token_mean": relative(torch.stack(stock_losses), padded_steps).max().item(),
    }


def relative(a, b):
    """``|a - b| / |b|``, of floats or elementwise of tensors."""
    return abs(a - b) / abs(b)


# --------------------------------------------------------------------------------------------
# Command line


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on CPU, in seconds")
    parser.add_argument(
        "--attention",
        choices=("flex_attention", "sdpa"),
        help="attention of the packed runs (default: flex_attention on CUDA, sdpa on CPU)",
    )
    parser.add_argument("--steps", type=int, help="steady-state steps per run")
    parser.add_argument("--warmup", type=int, help="warm-up steps per run, reported apart")
    parser.add_argument(
        "--pad-to-multiple",
        type=int,
        help="pad each packed row to a multiple of this many tokens (default: the row size, "
        "one shape for every step; 1: exact lengths)",
    )
    parser.add_argument(
        "--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS), help="runs to make"
    )
    parser.add_argument("--out", type=Path, help=f"output folder (default {harness.RESULTS_DIR})")
    args = parser.parse_args()
    for name in ("steps", "warmup", "pad_to_multiple"):
        value = getattr(args, name)
        if value is not None and value < (1 if name != "warmup" else 0):
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return args


def main() -> int:
    args = parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("bench_training: no CUDA device: run on a GPU machine, or --tiny here")
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        # matrices of 32 x 64: threads gain nothing, and on a busy machine their spinning cost
        # seconds per step
        torch.set_num_threads(1)
    plan = TINY_PLAN if args.tiny else GPU_PLAN
    plan = dataclasses.replace(
        plan,
        steps=args.steps if args.steps is not None else plan.steps,
        warmup=args.warmup if args.warmup is not None else plan.warmup,
    )
    attention = args.attention or ("flex_attention" if device.type == "cuda" else "sdpa")
    if attention == "flex_attention" and device.type != "cuda":
        # torch's flex attention has no backward on the CPU
        sys.exit("bench_training: --attention flex_attention trains on CUDA only: use sdpa here")
    pad_to_multiple = args.pad_to_multiple or plan.row_tokens
    out = args.out or (
        Path(tempfile.gettempdir()) / "packed_ce_bench" if args.tiny else harness.RESULTS_DIR
    )
    clock = Clock(start=time.monotonic(), budget=plan.seconds)
    env = harness.environment(device, DISTRIBUTIONS)
    clock.log(f"{env['device_name']}, torch {torch.__version__}")

    rng = np.random.default_rng(0)
    total_steps = plan.warmup + plan.steps
    # conversations average about 900 tokens: twice as many as fill the steps' rows
    conversations = make_conversations(
        total_steps * plan.row_tokens // 450 + 64,
        plan.model["vocab_size"],
        plan.chat,
        plan.max_conversation,
        rng,
    )
    steps = make_steps(conversations, total_steps, plan, pad_to_multiple, device, rng)
    clock.log(f"{len(conversations)} conversations; {total_steps} steps of one packed row each")

    clock.log("building the model ...")
    model = build_model(plan, device)
    parameters = sum(p.numel() for p in model.parameters())
    # on the host: the GPU's peak memory then counts only what training holds
    initial = {name: tensor.to("cpu", copy=True) for name, tensor in model.state_dict().items()}
    clock.log(f"model: {parameters / 1e9:.2f}B parameters, {plan.dtype}")

    compiling = attention == "flex_attention"
    clock.log(f"objective check{' (flex attention compiles here)' if compiling else ''} ...")
    check = check_objective(model, initial, steps, attention)
    clock.log(
        f"objective check, {check['conversations']} conversations of {check['steps']} steps: "
        f"max relative difference per conversation {check['max_rel_diff_per_conversation']:.1e}, "
        f"per step {check['rel_diff_loss']:.1e}"
    )
    tolerance = 1e-4 if plan.dtype == torch.float32 else 2e-2  # bf16: 8 significant bits
    runs = {}
    skipped = {}
    for run in args.runs:
        if clock.past_deadline():
            skipped[run] = f"not started: the run was past {plan.seconds:.0f} s"
            clock.log(f"run {run}: {skipped[run]}")
            continue
        clock.log(f"run {run} ...")
        if run == "packed_exact_length":  # one warm-up step: each new length is the point
            runs[run] = run_training(
                run, model, initial, steps[: 1 + plan.exact_steps], 1, attention, device, clock
            )
        else:
            runs[run] = run_training(
                run, model, initial, steps, plan.warmup, attention, device, clock
            )
    if runs.get("packed", {}).get("losses") and runs.get("padded", {}).get("losses"):
        check["rel_diff_first_step_loss"] = relative(
            runs["packed"]["losses"][0], runs["padded"]["losses"][0]
        )
    check["tolerance"] = tolerance
    check["passed"] = all(
        check[key] <= tolerance
        for key in ("max_rel_diff_per_conversation", "rel_diff_loss", "rel_diff_first_step_loss")
        if key in check
    )

    lengths = [len(c["input_ids"]) for c in conversations]
    result = {
        "benchmark": "training",
        "mode": "tiny" if args.tiny else "full",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "environment": env,
        "model": {
            "config": plan.model,
            "parameters": parameters,
            "dtype": str(plan.dtype).removeprefix("torch."),
        },
        "data": {
            "chat_shape": dataclasses.asdict(plan.chat),
            "max_conversation": plan.max_conversation,
            "conversation_tokens_median": statistics.median(lengths),
            "conversation_tokens_mean": statistics.fmean(lengths),
            "row_tokens": plan.row_tokens,
            "pad_to_multiple": pad_to_multiple,
            "conversations_per_step": statistics.fmean(len(s.conversations) for s in steps),
            "real_tokens_per_step": statistics.fmean(s.real_tokens for s in steps),
            "target_tokens_per_step": statistics.fmean(s.target_tokens for s in steps),
            "padded_batch": plan.padded_batch,
            "padded_tokens_per_step": statistics.fmean(
                sum(b["input_ids"].numel() for b in s.padded) for s in steps
            ),
        },
        "warmup_steps": plan.warmup,
        "attention": attention,
        "check": check,
        "runs": runs,
        "skipped_runs": skipped,
        "seconds": clock.elapsed(),
    }
    # speed-ups of packing at the same objective (padded), and over the stock token mean
    for other in ("padded", "stock"):
        if all("median_seconds" in runs.get(name, {}) for name in ("packed", other)):
            result[f"speedup_packed_over_{other}"] = (
                runs[other]["median_seconds"] / runs["packed"]["median_seconds"]
            )
    json_path = harness.write_json(out / f"training_{harness.device_slug(env)}.json", result)
    table = make_tables.training_report(result)
    json_path.with_suffix(".md").write_text(table + "\n")
    print(f"\nwrote {json_path} and {json_path.with_suffix('.md')}\n")
    print(table)
    if not check["passed"]:
        print(
            f"FAILED: packed and padded losses differ by more than {tolerance:g}", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
