"""``packed-ce demo``: one tiny causal LM trained three ways from the same weights.

The demo trains one tiny causal LM three ways from the same initial weights, on exactly the same
conversations at every step:

- **packed**: the step's conversations back to back in one row (:class:`collators.PackedCollator`),
  loss from :func:`packed_ce.integrations.apply_packed_loss` with ``is_packed=True``: the mean
  over conversations of each conversation's mean token loss;
- **padded**: the same conversations one per row (:class:`collators.PaddedCollator`), the same
  per-conversation average computed in plain PyTorch (:func:`per_sequence_mean_loss`): the
  unpacked baseline, independent of ``packed_ce``;
- **naive**: the packed row with transformers' own loss, a mean over all target tokens of the row,
  in which long conversations outweigh short ones.

In float32 the packed and padded runs must agree to 1e-5 at every step; the naive run drifts away.
Nothing here needs a network: the default corpus and tokenizer ship with ``collators``.
"""

from __future__ import annotations

import copy
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from .data import load_data, pack, split_rows
from .models import build_model, load_model_config
from .report import save_plot, versions

# The largest |packed - padded| loss difference the demo accepts, float32.
TOLERANCE = 1e-5


def per_sequence_mean_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """The unpacked reference: each row's mean next-token loss, averaged over rows with a target
    (weighted: ``sum_r w_r mean_r / sum_r w_r``).

    Plain PyTorch, independent of this package: what training one conversation per row and
    averaging per conversation gives.

    Args:
        logits: ``(B, T, V)`` float.
        labels: ``(B, T)`` aligned with the inputs (shifted here); ``ignore_index`` where untrained.
        weights: ``(B,)`` each row's conversation weight (a ``weight`` column), or None: 1.

    Returns:
        0-d float32 loss; 0 when no row has a target and a weight > 0.
    """
    targets = labels[:, 1:]
    token_loss = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=ignore_index, reduction="none"
    )  # (B, T-1)
    counts = (targets != ignore_index).sum(dim=1)
    has_target = counts > 0
    row_means = token_loss.sum(dim=1)[has_target] / counts[has_target]
    if weights is None:
        weights = torch.ones_like(row_means)
    else:
        weights = weights.to(row_means)[has_target]
    if not bool((weights > 0).any()):
        return token_loss.sum() * 0.0
    return (row_means * weights).sum() / weights.sum()


@dataclass
class Variant:
    """One of the demo's training runs and what it recorded."""

    name: str
    description: str
    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # forward + backward + step, per step
    tokens: list[int] = field(default_factory=list)  # real (non-padding) tokens, per step
    slots: list[int] = field(default_factory=list)  # token positions computed, padding included

    def tokens_per_second(self) -> float:
        """Real tokens per second, leaving out the first step (warm-up)."""
        seconds = sum(self.seconds[1:]) if len(self.seconds) > 1 else sum(self.seconds)
        tokens = sum(self.tokens[1:]) if len(self.tokens) > 1 else sum(self.tokens)
        return tokens / seconds if seconds > 0 else math.nan


def _train_step(model, optimizer, batch: Mapping[str, Any], loss_of) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    return loss.item()


def step_batches(
    rows: Sequence[Mapping[str, Any]], rows_per_step: int, *, pad_token_id: int, device="cpu"
) -> list[dict[str, Any]]:
    """The batches of every step, packed and padded, from the same conversations.

    Args:
        rows: packed rows (``input_ids``, ``labels``, ``seq_lengths``), ``rows_per_step`` per step.
        rows_per_step: packed rows per step; the padded batch holds their conversations.
        pad_token_id: the padding token of the padded batches.
        device: where the batches' tensors go.

    Returns:
        One dict per step: ``packed`` and ``padded`` (collated batches), ``conversations`` and
        ``tokens`` (their number).
    """
    import collators

    packed_collator = collators.PackedCollator()
    padded_collator = collators.PaddedCollator(pad_token_id=pad_token_id)
    steps = []
    for start in range(0, len(rows) - rows_per_step + 1, rows_per_step):
        step_rows = rows[start : start + rows_per_step]
        conversations = split_rows(step_rows)
        steps.append(
            {
                "packed": {k: _to(v, device) for k, v in packed_collator(step_rows).items()},
                "padded": {k: _to(v, device) for k, v in padded_collator(conversations).items()},
                "conversations": len(conversations),
                "tokens": sum(len(c["input_ids"]) for c in conversations),
            }
        )
    return steps


def model_loss(model, batch):
    """The loss the model computes itself (its own, or the one ``apply_packed_loss`` installed)."""
    return model(**batch, use_cache=False).loss


def padded_loss(model, batch):
    """The unpacked baseline on a :class:`collators.PaddedCollator` batch."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
    ).logits
    # seq_weights: one per row, float64, from each conversation's weight column (if any)
    return per_sequence_mean_loss(logits, batch["labels"], batch.get("seq_weights"))


# name, description, the layout it trains on, its loss, whether packed_ce's loss is installed
RUNS: list[tuple[str, str, str, Callable, bool]] = [
    ("packed", "packed, packed_ce is_packed=True", "packed", model_loss, True),
    ("padded", "padded, per-sequence mean (plain PyTorch)", "padded", padded_loss, False),
    ("naive", "packed, transformers' token mean", "packed", model_loss, False),
]


def train_runs(
    initial: torch.nn.Module,
    steps: Sequence[Mapping[str, Any]],
    *,
    learning_rate: float = 1e-3,
    progress: bool = True,
) -> dict[str, Variant]:
    """Trains a copy of ``initial`` for each of :data:`RUNS` on ``steps`` (:func:`step_batches`).

    Returns:
        ``{"packed": ..., "padded": ..., "naive": ...}``, the :class:`Variant` of each run.
    """
    from tqdm.auto import tqdm

    from packed_ce.integrations import apply_packed_loss

    device = next(initial.parameters()).device
    runs = {}
    for name, description, layout, loss_of, packed_loss in RUNS:
        variant = runs[name] = Variant(name, description)
        model = copy.deepcopy(initial)
        if packed_loss:
            apply_packed_loss(model, is_packed=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
        for data in tqdm(steps, desc=f"training {name}", disable=not progress, leave=False):
            batch = data[layout]
            start = time.perf_counter()
            variant.losses.append(_train_step(model, optimizer, batch, loss_of))
            if device.type == "cuda":
                torch.cuda.synchronize()
            variant.seconds.append(time.perf_counter() - start)
            variant.tokens.append(data["tokens"])
            variant.slots.append(batch["input_ids"].numel())
    return runs


def run_demo(
    *,
    dataset: str | None = None,
    tokenizer: str | None = None,
    model_config: str | None = None,
    max_length: int = 512,
    steps: int = 12,
    rows_per_step: int = 2,
    learning_rate: float = 1e-3,
    attn_implementation: str = "sdpa",
    device: str = "cpu",
    seed: int = 0,
    output_dir: str | Path = "outputs/demo",
    progress: bool = True,
) -> dict[str, Any]:
    """Runs the demo and writes ``report.json`` and ``losses.png`` to ``output_dir``.

    Arguments are the options of ``packed-ce demo`` (see ``packed-ce demo --help``).

    Returns:
        The report (also written as JSON): data, packing and model facts, the per-step losses of
        the three runs, the largest packed-vs-padded difference and the throughputs.
    """
    messages, tok = load_data(dataset, tokenizer)
    packed, stats = pack(messages, tok, max_length)
    needed = steps * rows_per_step
    if packed.num_rows < needed:
        raise ValueError(
            f"--steps {steps} x {rows_per_step} rows per step needs {needed} packed rows; the data "
            f"gives {packed.num_rows} rows of {max_length} tokens"
        )
    # A fixed shuffle of the rows, so steps mix long and short conversations.
    order = torch.randperm(packed.num_rows, generator=torch.Generator().manual_seed(seed))[:needed]
    rows = packed.select(order.tolist())
    rows = [rows[i] for i in range(needed)]

    config = load_model_config(model_config, len(tok), attn_implementation=attn_implementation)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    steps_data = step_batches(rows, rows_per_step, pad_token_id=pad_id, device=device)
    initial = build_model(config, seed=seed, device=device)
    by_name = train_runs(initial, steps_data, learning_rate=learning_rate, progress=progress)

    packed_run, padded_run, naive_run = by_name["packed"], by_name["padded"], by_name["naive"]
    diff = [abs(a - b) for a, b in zip(packed_run.losses, padded_run.losses)]
    naive_diff = [abs(a - b) for a, b in zip(naive_run.losses, padded_run.losses)]
    padded_slots = sum(padded_run.slots)
    report = {
        "data": {
            "dataset": dataset or "chatterbot-corpus (English)",
            "tokenizer": tokenizer or "collators.load_default_tokenizer()",
            "conversations": stats.num_conversations,
            "tokens": stats.num_tokens,
            "truncated": stats.num_truncated,
            "dropped": stats.num_dropped,
        },
        "packing": {
            "max_length": max_length,
            "rows": stats.num_rows,
            "efficiency": stats.efficiency,
            "padded_efficiency_of_trained_steps": sum(padded_run.tokens) / padded_slots,
        },
        "model": {
            "model_type": config.model_type,
            "parameters": sum(p.numel() for p in initial.parameters()),
            "vocab_size": config.vocab_size,
            "attn_implementation": attn_implementation,
            "dtype": "float32",
            "device": str(device),
        },
        "training": {
            "steps": steps,
            "rows_per_step": rows_per_step,
            "learning_rate": learning_rate,
            "optimizer": "AdamW",
            "seed": seed,
            "conversations_per_step": [d["conversations"] for d in steps_data],
            "tokens_per_step": [d["tokens"] for d in steps_data],
        },
        "runs": {v.name: {"description": v.description, **asdict(v)} for v in by_name.values()},
        "max_abs_diff_packed_vs_padded": max(diff),
        "max_abs_diff_naive_vs_padded": max(naive_diff),
        "tolerance": TOLERANCE,
        "passed": max(diff) <= TOLERANCE,
        "tokens_per_second": {v.name: v.tokens_per_second() for v in by_name.values()},
        "versions": versions(),
    }
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    save_plot(report, output_dir / "losses.png")
    report["files"] = [str(output_dir / "report.json"), str(output_dir / "losses.png")]
    return report


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value
