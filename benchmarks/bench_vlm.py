"""Vision-language SFT on one GPU: packed rows with images against one conversation per row.

The model has the shapes of Qwen2.5-VL-3B (random init from its configuration: a 36-layer text
model of hidden size 2048 with multimodal rotary positions, a 32-block vision tower of hidden
size 1280 with window attention, 3.75B parameters), bf16, sdpa in both towers. Every run makes
forward and backward passes (no optimiser step: its time is the same for every run) over the same
conversations, from the same weights:

- ``packed``: the conversations of a step in one packed row (``collators.PackedCollator``, the
  row's images in order: ``pixel_values`` and ``image_grid_thw`` concatenated), the packed loss
  installed by ``apply_packed_loss(model, fused_linear=True)``: each conversation's multimodal
  positions as alone, attention kept per conversation, the mean over conversations of each one's
  mean token loss from the hidden states (no ``(N, V)`` logits).
- ``padded``: the same conversations one per row, micro-batches of ``--padded-batch`` padded rows
  (``collators.PaddedCollator``, the model's own positions), the same objective and loss
  (``count_num_items`` over the step's micro-batches), gradients accumulated.
- ``trl_style``: the padded micro-batches of ``padded`` with the model's own loss, the token mean
  of trl's unpacked vision-language training (``DataCollatorForVisionLanguageModeling``: one
  conversation per row, padded): another objective, here for its speed.

Data (``make_conversations``): generated chat with images, token ids and pixel values (no
processor or tokenizer is needed): a system prompt with probability 1/2 (lognormal, median 40
tokens), a user turn with 0 to 2 images (probabilities 0.2, 0.5, 0.3; each side 224, 336 or 448
pixels, 64 to 256 image tokens, each image between ``<|vision_start|>`` and ``<|vision_end|>``)
and a question (median 60 tokens), an answer (median 220, the only target), and with probability
0.4 a second text exchange. Pixel values are standard normal, the same for an image in every run.
The conversations are packed best-fit-decreasing into rows of ``--row-tokens`` tokens; each step
is one row, in shuffled order, and every run trains on the same steps (the padded runs on the
row's conversations in shuffled order).

Reported per run (a JSON object per line, ``"kind": "run"``): the warm-up steps, then the median
step time and its p20-p80, tokens/s counting real tokens only (text and image tokens, no
padding), and the peak allocated GPU memory (weights and gradients included). The check (``"kind":
"check"``), before the runs, on the first step's row: the packed loss and every gradient against
each conversation run alone (the model's own positions, its images alone, loss from its logits
in float32), and the padded ones likewise: bf16 rounds a row and a conversation alone
differently, and the padded arrangement shows how much by another route. Relative differences in
the 2-norm, over all parameters and per part (vision tower, language model, head).

On one H200 or H100, from the repository root (about 2 minutes: 20 s to build the model, the
check, 3 runs of 2 warm-up and 5 timed steps)::

    PYTHONPATH=. python benchmarks/bench_vlm.py
    PYTHONPATH=. python benchmarks/bench_vlm.py --tiny      # CPU, tiny model, seconds

Writes ``benchmarks/results/vlm_<device>.jsonl`` (``--tiny``: a temporary folder unless
``--out`` is given). Needs torch, transformers and numpy only (no trl, datasets or torchvision).

Dimensions: B rows, T tokens per row, P image patches, S sequences.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness
import numpy as np
import torch

from collators.collate import PackedCollator, PaddedCollator
from collators.planning import best_fit_decreasing
from packed_ce.integrations import apply_packed_loss, count_num_items, remove_packed_loss

IGNORE_INDEX = harness.IGNORE_INDEX
DISTRIBUTIONS = ("torch", "triton", "transformers", "numpy")
PATCH = 14  # pixels per patch side; 2 x 2 patches merge into one image token
PATCH_VALUES = 3 * 2 * PATCH * PATCH  # channels x temporal patch x patch: one row of pixel_values

# Qwen2.5-VL-3B-Instruct's configuration (hidden sizes, depths, heads, rotary sections, token ids)
QWEN25_VL_3B = dict(
    text=dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=128000,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    ),
    vision=dict(
        depth=32,
        hidden_size=1280,
        intermediate_size=3420,
        num_heads=16,
        out_hidden_size=2048,
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[7, 15, 23, 31],
        tokens_per_second=2,
    ),
    ids=dict(
        image_token_id=151655,
        video_token_id=151656,
        vision_start_token_id=151652,
        vision_end_token_id=151653,
        tie_word_embeddings=True,
    ),
    text_vocab=151643,  # text token ids are drawn below the special ones
)
TINY = dict(
    text=dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 3, 3]},
    ),
    vision=dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=PATCH,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=56,
        fullatt_block_indexes=[1],
    ),
    ids=dict(
        image_token_id=510,
        video_token_id=511,
        vision_start_token_id=508,
        vision_end_token_id=509,
        tie_word_embeddings=True,
    ),
    text_vocab=500,
)


@dataclass(frozen=True)
class Plan:
    model: dict
    dtype: torch.dtype
    row_tokens: int  # T of a packed row
    padded_batch: int  # conversations per padded micro-batch
    image_sides: tuple[int, ...]  # pixels, multiples of 2 patches
    text_scale: float  # multiplies the median text lengths
    warmup: int
    steps: int
    seconds: float  # no run or step starts after this many seconds
    tolerance: float  # the check's relative difference, packed or padded against alone
    # bf16: packed against alone may differ at most this many times as much as the padded
    # arrangement of the same conversations does (bf16's own rounding by another route); None:
    # the tolerance alone (float32)
    within_padded: float | None = None


GPU_PLAN = Plan(
    model=QWEN25_VL_3B,
    dtype=torch.bfloat16,
    row_tokens=8192,
    padded_batch=4,
    image_sides=(224, 336, 448),
    text_scale=1.0,
    warmup=2,
    steps=5,
    seconds=200.0,
    tolerance=2e-2,  # bf16: reported; the check compares with the padded arrangement
    within_padded=2.0,
)
TINY_PLAN = Plan(
    model=TINY,
    dtype=torch.float32,
    row_tokens=256,
    padded_batch=2,
    image_sides=(28, 56),
    text_scale=0.1,
    warmup=1,
    steps=2,
    seconds=120.0,
    tolerance=1e-4,
)


@dataclass
class Conversation:
    input_ids: np.ndarray  # (L,) int64
    labels: np.ndarray  # (L,) int64, IGNORE_INDEX but on the answer
    grids: list[tuple[int, int, int]]  # each image's (1, patches high, patches wide)
    seed: int  # of its pixel values


def _length(rng, median: float, sigma: float, scale: float) -> int:
    return max(1, int(rng.lognormal(np.log(median * scale), sigma)))


def make_conversations(count: int, plan: Plan, rng) -> list[Conversation]:
    """``count`` generated conversations with images (see the module docstring)."""
    ids, vocab = plan.model["ids"], plan.model["text_vocab"]
    conversations = []
    for index in range(count):
        ids_parts, trained = [], []

        def text(length, train=False):
            ids_parts.append(rng.integers(0, vocab, length))
            trained.append(np.full(length, train))

        if rng.random() < 0.5:
            text(_length(rng, 40, 0.6, plan.text_scale))
        grids = []
        for _ in range(rng.choice(3, p=[0.2, 0.5, 0.3])):
            high, wide = (int(rng.choice(plan.image_sides)) // PATCH for _ in range(2))
            grids.append((1, high, wide))
            tokens = [ids["vision_start_token_id"]]
            tokens += [ids["image_token_id"]] * (high * wide // 4)
            tokens += [ids["vision_end_token_id"]]
            ids_parts.append(np.array(tokens))
            trained.append(np.zeros(len(tokens), dtype=bool))
        text(_length(rng, 60, 1.0, plan.text_scale))
        text(_length(rng, 220, 0.8, plan.text_scale), train=True)
        if rng.random() < 0.4:
            text(_length(rng, 60, 1.0, plan.text_scale))
            text(_length(rng, 220, 0.8, plan.text_scale), train=True)
        input_ids = np.concatenate(ids_parts).astype(np.int64)
        labels = np.where(np.concatenate(trained), input_ids, IGNORE_INDEX)
        conversations.append(Conversation(input_ids, labels, grids, seed=index))
    return conversations


def image_inputs(conversations: list[Conversation], input_ids, plan: Plan, device) -> dict:
    """``pixel_values`` ``(P, 1176)``, ``image_grid_thw`` ``(I, 3)`` and ``mm_token_type_ids``
    ``(B, T)`` of the conversations' images, in their order (empty without images).
    """
    grids = [grid for c in conversations for grid in c.grids]
    if not grids:
        return {}
    pixels = []
    for conversation in conversations:
        generator = torch.Generator().manual_seed(conversation.seed)
        patches = sum(t * h * w for t, h, w in conversation.grids)
        pixels.append(torch.randn(patches, PATCH_VALUES, generator=generator))
    image = plan.model["ids"]["image_token_id"]
    return {
        "pixel_values": torch.cat(pixels).to(device, plan.dtype),
        "image_grid_thw": torch.tensor(grids, device=device),
        "mm_token_type_ids": (input_ids == image).to(torch.int32),
    }


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def packed_batch(conversations: list[Conversation], plan: Plan, device) -> dict:
    """One packed row of ``conversations`` and their images."""
    examples = [{"input_ids": c.input_ids, "labels": c.labels} for c in conversations]
    batch = _on(PackedCollator()(examples), device)
    batch.update(image_inputs(conversations, batch["input_ids"], plan, device))
    return batch


def padded_batches(conversations: list[Conversation], plan: Plan, device) -> list[dict]:
    """``conversations`` in padded micro-batches of ``plan.padded_batch``, with their images."""
    batches = []
    for start in range(0, len(conversations), plan.padded_batch):
        chunk = conversations[start : start + plan.padded_batch]
        examples = [{"input_ids": c.input_ids, "labels": c.labels} for c in chunk]
        batch = _on(PaddedCollator(pad_token_id=0)(examples), device)
        batch.update(image_inputs(chunk, batch["input_ids"], plan, device))
        batches.append(batch)
    return batches


def build_model(plan: Plan, device):
    from transformers import AutoConfig, AutoModelForImageTextToText

    shapes = plan.model
    config = AutoConfig.for_model(
        "qwen2_5_vl", text_config=shapes["text"], vision_config=shapes["vision"], **shapes["ids"]
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(
            config, dtype=plan.dtype, attn_implementation="sdpa"
        )
    # use_cache=False on every call: with a cache transformers ignores the packed positions
    return model.train()


# --------------------------------------------------------------------------------------------
# One step of each run: forward and backward, gradients accumulated over micro-batches


def packed_step(model, rows: dict) -> float:
    loss = model(**rows["packed"], use_cache=False).loss
    loss.backward()
    return float(loss.detach())


def padded_step(model, rows: dict) -> float:
    # the step's normaliser over its micro-batches: the mean over its conversations
    count = count_num_items(rows["padded"])
    total = 0.0
    for batch in rows["padded"]:
        loss = model(**batch, num_items_in_batch=count, use_cache=False).loss
        loss.backward()
        total += float(loss.detach())
    return total


def trl_style_step(model, rows: dict) -> float:
    # transformers' own loss: the token mean over the step's targets (trl's objective)
    count = sum(int((batch["labels"][:, 1:] != IGNORE_INDEX).sum()) for batch in rows["padded"])
    total = 0.0
    for batch in rows["padded"]:
        call = {k: batch[k] for k in batch if k not in ("cu_seqlens", "seq_targets")}
        call.pop("num_sequences", None)
        loss = model(**call, num_items_in_batch=count, use_cache=False).loss
        loss.backward()
        total += float(loss.detach())
    return total


RUNS = {"packed": packed_step, "padded": padded_step, "trl_style": trl_style_step}


@dataclass
class Clock:
    start: float
    budget: float

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def past_deadline(self) -> bool:
        return self.elapsed() > self.budget

    def log(self, message: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {message}", flush=True)


def run(name: str, model, steps: list[dict], plan: Plan, device, clock: Clock) -> dict:
    """``plan.warmup`` untimed-in-the-summary steps, then the timed ones (see the docstring)."""
    step = RUNS[name]
    packed = name == "packed"
    installed = getattr(model, "_packed_ce", None) is not None
    if name == "trl_style" and installed:
        remove_packed_loss(model)
    elif name != "trl_style" and not installed:
        apply_packed_loss(model, fused_linear=True)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    seconds, losses, skipped = [], [], 0
    for index, rows in enumerate(steps):
        if clock.past_deadline():
            skipped = len(steps) - index
            break
        model.zero_grad(set_to_none=True)
        harness.synchronize(device)
        began = time.perf_counter()
        losses.append(step(model, rows))
        harness.synchronize(device)
        seconds.append(time.perf_counter() - began)
        clock.log(f"{name} step {index}: {seconds[-1]:.3f} s, loss {losses[-1]:.4f}")
    model.zero_grad(set_to_none=True)
    timed = seconds[plan.warmup :]
    tokens = [rows["tokens"] for rows in steps[plan.warmup : len(seconds)]]
    result = {
        "kind": "run",
        "name": name,
        "layout": "one packed row" if packed else f"padded micro-batches of {plan.padded_batch}",
        "objective": "token mean (transformers' loss)"
        if name == "trl_style"
        else "mean over conversations (packed_ce)",
        "warmup_seconds": seconds[: plan.warmup],
        "step_seconds": timed,
        "losses": losses,
        "steps_not_run": skipped,
        "tokens_per_step": tokens,
    }
    if timed:
        result.update(harness.summarize(timed, unit="seconds"))
        result["tokens_per_second"] = sum(tokens) / sum(timed)
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated(device) / harness.GiB
    return result


# --------------------------------------------------------------------------------------------
# The check: packed and padded against each conversation alone, loss and every gradient


def _gradients(model) -> dict[str, torch.Tensor]:
    return {
        n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
    }


def _part(name: str) -> str:
    if ".visual." in f".{name}":
        return "vision"
    return "head" if name.startswith("lm_head") else "language"


def _differences(grads: dict, reference: dict) -> dict:
    """Relative 2-norm differences, all parameters and per part, in float64."""
    sums: dict[str, list[float]] = {}
    for name, ref in reference.items():
        got = grads.get(name, torch.zeros_like(ref))
        error = float((got.double() - ref.double()).norm() ** 2)
        norm = float(ref.double().norm() ** 2)
        for part in ("all", _part(name)):
            sums.setdefault(part, [0.0, 0.0])
            sums[part][0] += error
            sums[part][1] += norm
    return {part: (error / norm) ** 0.5 if norm else 0.0 for part, (error, norm) in sums.items()}


def alone_loss(model, conversations: list[Conversation], plan: Plan, device) -> torch.Tensor:
    """Each conversation alone (its own images, the model's own positions), the mean over them
    of each one's mean target loss, from its logits in float32.
    """
    losses = []
    for conversation in conversations:
        input_ids = torch.from_numpy(conversation.input_ids)[None].to(device)
        labels = torch.from_numpy(conversation.labels).to(device)
        inputs = image_inputs([conversation], input_ids, plan, device)
        logits = model(input_ids=input_ids, use_cache=False, **inputs).logits[0].float()
        losses.append(torch.nn.functional.cross_entropy(logits[:-1], labels[1:]))
    return torch.stack(losses).mean()


def check(model, conversations, rows: dict, plan: Plan, device, clock: Clock) -> dict:
    clock.log(f"check: {len(conversations)} conversations alone, packed, padded ...")
    if getattr(model, "_packed_ce", None) is not None:
        remove_packed_loss(model)
    model.zero_grad(set_to_none=True)
    alone = alone_loss(model, conversations, plan, device)
    alone.backward()
    reference = _gradients(model)
    model.zero_grad(set_to_none=True)
    apply_packed_loss(model, fused_linear=True)
    found = {}
    for name, step in (("packed", packed_step), ("padded", padded_step)):
        loss = step(model, rows)
        found[name] = (loss, _gradients(model))
        model.zero_grad(set_to_none=True)
    result = {"kind": "check", "conversations": len(conversations), "tolerance": plan.tolerance}
    result["loss_alone"] = expected = float(alone.detach())
    for name, (loss, grads) in found.items():
        result[f"rel_diff_loss_{name}"] = abs(loss - expected) / abs(expected)
        result[f"rel_diff_gradients_{name}"] = _differences(grads, reference)
    del reference, found
    if plan.within_padded is None:
        worst = max(
            max(result["rel_diff_loss_packed"], result["rel_diff_loss_padded"]),
            result["rel_diff_gradients_packed"]["all"],
        )
        result["passed"] = worst < plan.tolerance
    else:  # bf16 rounds a row and each conversation alone differently: as much as padded does
        bound = plan.within_padded
        result["within_padded"] = bound
        result["passed"] = (
            result["rel_diff_loss_packed"] <= bound * result["rel_diff_loss_padded"] + 1e-4
            and result["rel_diff_gradients_packed"]["all"]
            <= bound * result["rel_diff_gradients_padded"]["all"]
        )
    clock.log(
        f"check: loss {result['rel_diff_loss_packed']:.1e} (padded "
        f"{result['rel_diff_loss_padded']:.1e}), gradients "
        f"{result['rel_diff_gradients_packed']['all']:.1e} (padded "
        f"{result['rel_diff_gradients_padded']['all']:.1e}) relative to each one alone"
    )
    return result


def make_steps(conversations, plan: Plan, rng, device) -> tuple[list[dict], list[list[int]]]:
    lengths = [len(c.input_ids) for c in conversations]
    rows = best_fit_decreasing(lengths, plan.row_tokens)
    rows = [rows[i] for i in rng.permutation(len(rows))][: plan.warmup + plan.steps]
    steps = []
    for row in rows:
        chosen = [conversations[i] for i in row]
        # the padded micro-batches take the step's conversations in shuffled order, as a loader
        # of single conversations would (best-fit order would group like lengths)
        shuffled = [chosen[i] for i in rng.permutation(len(chosen))]
        steps.append(
            {
                "packed": packed_batch(chosen, plan, device),
                "padded": padded_batches(shuffled, plan, device),
                "tokens": sum(lengths[i] for i in row),
            }
        )
    return steps, rows


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (seconds)")
    parser.add_argument("--row-tokens", type=int, help="tokens of a packed row")
    parser.add_argument("--padded-batch", type=int, help="conversations per padded micro-batch")
    parser.add_argument("--steps", type=int, help="timed steps per run")
    parser.add_argument(
        "--runs", nargs="+", choices=tuple(RUNS), default=list(RUNS), help="runs to make"
    )
    parser.add_argument("--no-check", action="store_true", help="skip the check against alone")
    parser.add_argument("--out", type=Path, help=f"output folder (default {harness.RESULTS_DIR})")
    args = parser.parse_args()
    for name in ("row_tokens", "padded_batch", "steps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be a positive integer, got {value}")
    return args


def main() -> int:
    args = parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("bench_vlm: no CUDA device: run on a GPU machine, or --tiny here")
    device = torch.device("cpu" if args.tiny else "cuda")
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices: threads only spin
    plan = TINY_PLAN if args.tiny else GPU_PLAN
    changes = {
        key: getattr(args, key)
        for key in ("row_tokens", "padded_batch", "steps")
        if getattr(args, key) is not None
    }
    plan = dataclasses.replace(plan, **changes)
    out = args.out or (
        Path(tempfile.gettempdir()) / "packed_ce_bench" if args.tiny else harness.RESULTS_DIR
    )
    clock = Clock(start=time.monotonic(), budget=plan.seconds)
    env = harness.environment(device, DISTRIBUTIONS)
    clock.log(f"{env['device_name']}, torch {torch.__version__}")

    rng = np.random.default_rng(0)
    total = plan.warmup + plan.steps
    # about 700 tokens a conversation: enough of them to fill the steps' rows twice
    conversations = make_conversations(total * plan.row_tokens // 350 + 16, plan, rng)
    steps, rows = make_steps(conversations, plan, rng, device)
    clock.log(f"{len(conversations)} conversations; {len(steps)} steps of one packed row each")
    clock.log("building the model ...")
    model = build_model(plan, device)
    parameters = sum(p.numel() for p in model.parameters())
    vision = sum(p.numel() for n, p in model.named_parameters() if "visual" in n)
    clock.log(f"{parameters / 1e9:.2f}B parameters ({vision / 1e9:.2f}B in the vision tower)")

    lines = [
        {
            "kind": "environment",
            **env,
            "model": "Qwen2.5-VL-3B shapes, random init" if not args.tiny else "tiny Qwen2.5-VL",
            "parameters": parameters,
            "vision_parameters": vision,
            "dtype": str(plan.dtype),
            "attention": "sdpa",
            "row_tokens": plan.row_tokens,
            "padded_batch": plan.padded_batch,
            "warmup_steps": plan.warmup,
            "steps": plan.steps,
            "images_per_step": [len(s["packed"].get("image_grid_thw", [])) for s in steps],
        }
    ]
    if not args.no_check:
        first = [conversations[i] for i in rows[0]]
        lines.append(check(model, first, steps[0], plan, device, clock))
    results = {}
    for name in args.runs:
        clock.log(f"run {name} ...")
        results[name] = run(name, model, steps, plan, device, clock)
        lines.append(results[name])
    speeds = {n: r.get("tokens_per_second") for n, r in results.items()}
    summary = {"kind": "summary", "tokens_per_second": speeds}
    for other in ("padded", "trl_style"):
        if speeds.get("packed") and speeds.get(other):
            summary[f"speedup_packed_over_{other}"] = speeds["packed"] / speeds[other]
    lines.append(summary)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"vlm_{harness.device_slug(env)}.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    for name, speed in speeds.items():
        if speed:
            peak = results[name].get("peak_gib")
            memory = f", peak {peak:.1f} GiB" if peak else ""
            clock.log(f"{name}: {speed:,.0f} tokens/s{memory}")
    clock.log(f"wrote {path}")
    failed = not args.no_check and not lines[1]["passed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
