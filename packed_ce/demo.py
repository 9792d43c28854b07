"""What ``packed-ce demo`` and ``packed-ce pack`` do, and the small pieces they are built from.

The demo trains one tiny causal LM three ways from the same initial weights, on exactly the same
conversations at every step:

- **packed**: the step's conversations back to back in one row (:class:`collators.PackedCollator`),
  loss from :func:`apply_packed_loss` with ``is_packed=True``: the mean over conversations of
  each conversation's mean token loss;
- **padded**: the same conversations one per row (:class:`collators.PaddedCollator`), the same
  per-conversation average computed in plain PyTorch (:func:`per_sequence_mean_loss`): the
  unpacked baseline, independent of this package;
- **naive**: the packed row with transformers' own loss, a mean over all target tokens of the row,
  in which long conversations outweigh short ones.

In float32 the packed and padded runs must agree to 1e-5 at every step; the naive run drifts away.
Nothing here needs a network: the default corpus and tokenizer ship with ``collators``.
"""

from __future__ import annotations

import copy
import json
import math
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# The largest |packed - padded| loss difference the demo accepts, float32.
TOLERANCE = 1e-5

# The default model: a Llama small enough to train a few steps on a laptop CPU in seconds.
TINY_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)


def tiny_config(
    vocab_size: int,
    *,
    model_type: str = "llama",
    attn_implementation: str = "sdpa",
    **overrides,
):
    """A tiny causal-LM configuration (2 layers, hidden 64, 4 heads) for tests and the demo.

    Args:
        vocab_size: the tokenizer's vocabulary size.
        model_type: any decoder-only ``model_type`` of transformers ("llama", "qwen2", "mistral",
            "gemma2", ...).
        attn_implementation: "sdpa", "eager" or "flash_attention_2".
        **overrides: other configuration fields.

    Returns:
        ``transformers.PretrainedConfig`` with ``use_cache=False``.
    """
    from transformers import AutoConfig

    fields = {**TINY_MODEL, "vocab_size": vocab_size, "use_cache": False, **overrides}
    config = AutoConfig.for_model(model_type, **fields)
    config._attn_implementation = attn_implementation
    return config


def build_model(config, *, seed: int = 0, device: str | torch.device = "cpu"):
    """A causal LM with random float32 weights from ``config``, the same for the same ``seed``.

    Args:
        config: a ``transformers.PretrainedConfig``.
        seed: seeds the initialisation.
        device: where the model lives.

    Returns:
        ``transformers.PreTrainedModel`` in training mode.
    """
    from transformers import AutoModelForCausalLM

    # a private RNG state: the caller's random streams are left as they were
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device).train()


def load_model_config(spec: str | None, vocab_size: int, *, attn_implementation: str = "sdpa"):
    """The model configuration of ``--model-config``.

    Args:
        spec: None (the tiny Llama of :func:`tiny_config`), a JSON file with configuration fields
            (``model_type`` defaults to "llama", ``vocab_size`` to the tokenizer's), or a hub name
            (only its configuration is read; the weights are random).
        vocab_size: the tokenizer's vocabulary size.
        attn_implementation: the attention implementation to use.

    Returns:
        ``transformers.PretrainedConfig`` with ``use_cache=False``.

    Raises:
        ValueError: if the configuration's vocabulary is smaller than the tokenizer's.
    """
    from transformers import AutoConfig

    if spec is None:
        config = tiny_config(vocab_size, attn_implementation=attn_implementation)
    elif Path(spec).is_file():
        fields = json.loads(Path(spec).read_text())
        fields.setdefault("vocab_size", vocab_size)
        config = tiny_config(
            fields.pop("vocab_size"),
            model_type=fields.pop("model_type", "llama"),
            attn_implementation=attn_implementation,
            **fields,
        )
    else:
        config = AutoConfig.from_pretrained(spec)
        config.use_cache = False
        config._attn_implementation = attn_implementation
    if config.vocab_size < vocab_size:
        raise ValueError(
            f"--model-config has vocab_size={config.vocab_size}, smaller than the tokenizer's "
            f"{vocab_size}"
        )
    return config


def split_rows(rows: Sequence[Mapping[str, Sequence[int]]]) -> list[dict[str, list[int]]]:
    """The conversations of packed rows, in order: the inverse of packing.

    Args:
        rows: rows of :func:`collators.pack_dataset` (``input_ids``, ``labels``, ``seq_lengths``).

    Returns:
        One ``{"input_ids", "labels"}`` dict per conversation.

    Example:
        >>> row = {"input_ids": [1, 2, 3, 4, 5], "labels": [-100, 2, -100, 4, 5],
        ...        "seq_lengths": [2, 3]}
        >>> for conversation in split_rows([row]):
        ...     print(conversation)
        {'input_ids': [1, 2], 'labels': [-100, 2]}
        {'input_ids': [3, 4, 5], 'labels': [-100, 4, 5]}
    """
    conversations = []
    for row in rows:
        start = 0
        for length in row["seq_lengths"]:
            end = start + int(length)
            conversations.append(
                {
                    "input_ids": list(row["input_ids"][start:end]),
                    "labels": list(row["labels"][start:end]),
                }
            )
            start = end
    return conversations


def per_sequence_mean_loss(
    logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """The unpacked reference: each row's mean next-token loss, averaged over rows with a target.

    Plain PyTorch, independent of this package: what training one conversation per row and
    averaging per conversation gives.

    Args:
        logits: ``(B, T, V)`` float.
        labels: ``(B, T)`` aligned with the inputs (shifted here); ``ignore_index`` where untrained.

    Returns:
        0-d float32 loss; 0 when no row has a target.
    """
    targets = labels[:, 1:]
    token_loss = F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), targets, ignore_index=ignore_index, reduction="none"
    )  # (B, T-1)
    counts = (targets != ignore_index).sum(dim=1)
    has_target = counts > 0
    row_means = token_loss.sum(dim=1)[has_target] / counts[has_target]
    return row_means.mean() if row_means.numel() else token_loss.sum() * 0.0


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


def load_data(dataset: str | None, tokenizer: str | None):
    """The conversations and tokenizer of ``--dataset`` and ``--tokenizer`` (None: the defaults)."""
    from transformers import AutoTokenizer

    import collators

    messages = (
        collators.load_default_dataset()
        if dataset is None
        else collators.load_messages_dataset(dataset)
    )
    if tokenizer is None:
        tok = collators.load_default_tokenizer()
    else:
        tok = AutoTokenizer.from_pretrained(tokenizer)
    return messages, tok


def pack(messages, tokenizer, max_length: int, *, overflow: str = "truncate"):
    """Tokenizes and packs conversations into rows of ``max_length`` tokens.

    Returns:
        ``(packed, stats)``: the packed rows (``datasets.Dataset`` with ``input_ids``, ``labels``,
        ``seq_lengths``) and the ``collators.PackingStats``.
    """
    import collators

    tokenized = collators.tokenize_dataset(messages, tokenizer)
    return collators.pack_dataset(tokenized, max_length, overflow=overflow, return_stats=True)


def _train_step(model, optimizer, batch: Mapping[str, Any], loss_of) -> float:
    optimizer.zero_grad(set_to_none=True)
    loss = loss_of(model, batch)
    loss.backward()
    optimizer.step()
    return loss.item()


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
    from tqdm.auto import tqdm

    import collators
    from .integrations import apply_packed_loss

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
    packed_collator = collators.PackedCollator()
    padded_collator = collators.PaddedCollator(pad_token_id=pad_id)

    def model_loss(model, batch):
        return model(**batch, use_cache=False).loss

    def padded_loss(model, batch):
        logits = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
        ).logits
        return per_sequence_mean_loss(logits, batch["labels"])

    variants = [
        (Variant("packed", "packed, packed_ce is_packed=True"), "packed", model_loss, True),
        (
            Variant("padded", "padded, per-sequence mean (plain PyTorch)"),
            "padded",
            padded_loss,
            False,
        ),
        (Variant("naive", "packed, transformers' token mean"), "packed", model_loss, False),
    ]
    steps_data = []
    for step in range(steps):
        step_rows = rows[step * rows_per_step : (step + 1) * rows_per_step]
        conversations = split_rows(step_rows)
        steps_data.append(
            {
                "packed": {k: _to(v, device) for k, v in packed_collator(step_rows).items()},
                "padded": {k: _to(v, device) for k, v in padded_collator(conversations).items()},
                "conversations": len(conversations),
                "tokens": sum(len(c["input_ids"]) for c in conversations),
            }
        )

    initial = build_model(config, seed=seed, device=device)
    for variant, layout, loss_of, packed_loss in variants:
        model = copy.deepcopy(initial)
        if packed_loss:
            apply_packed_loss(model, is_packed=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
        for data in tqdm(
            steps_data, desc=f"training {variant.name}", disable=not progress, leave=False
        ):
            batch = data[layout]
            start = time.perf_counter()
            variant.losses.append(_train_step(model, optimizer, batch, loss_of))
            if str(device).startswith("cuda"):
                torch.cuda.synchronize()
            variant.seconds.append(time.perf_counter() - start)
            variant.tokens.append(data["tokens"])
            variant.slots.append(batch["input_ids"].numel())

    by_name = {variant.name: variant for variant, *_ in variants}
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
        "versions": _versions(),
    }
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    plot_losses(report, output_dir / "losses.png")
    report["files"] = [str(output_dir / "report.json"), str(output_dir / "losses.png")]
    return report


def _to(value, device):
    return value.to(device) if isinstance(value, torch.Tensor) else value


def _versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def plot_losses(report: Mapping[str, Any], path: str | Path) -> None:
    """The loss curves of the three runs and their distance to the padded run, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    steps = range(1, len(runs["padded"]["losses"]) + 1)
    fig, (curves, gaps) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {
        "padded": ("k", "-", 3.0),
        "packed": ("tab:blue", "--", 1.5),
        "naive": ("tab:red", ":", 1.5),
    }
    for name, (color, line, width) in styles.items():
        curves.plot(
            steps,
            runs[name]["losses"],
            line,
            color=color,
            lw=width,
            label=runs[name]["description"],
        )
    curves.set(
        xlabel="optimiser step", ylabel="training loss", title="Loss per step, same conversations"
    )
    curves.legend(fontsize=8)
    padded = runs["padded"]["losses"]
    for name in ("packed", "naive"):
        color = styles[name][0]
        gap = [max(abs(a - b), 1e-9) for a, b in zip(runs[name]["losses"], padded)]
        gaps.semilogy(steps, gap, "o-", color=color, label=f"|{name} - padded|")
    gaps.axhline(report["tolerance"], color="gray", lw=1, ls="--", label="tolerance 1e-5")
    gaps.set(
        xlabel="optimiser step",
        ylabel="|loss - padded loss| (0 drawn at 1e-9)",
        title="Distance to the unpacked baseline",
    )
    gaps.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(report: Mapping[str, Any]) -> str:
    """The demo's printed table."""
    data, packing, model = report["data"], report["packing"], report["model"]
    training, runs, speed = report["training"], report["runs"], report["tokens_per_second"]
    padded_efficiency = packing["padded_efficiency_of_trained_steps"]
    lines = [
        f"data       {data['dataset']}: {data['conversations']:,} conversations, "
        f"{data['tokens']:,} tokens ({data['truncated']} truncated, {data['dropped']} dropped)",
        f"packing    {packing['rows']} rows of {packing['max_length']} tokens, efficiency "
        f"{packing['efficiency']:.1%} (padding the trained steps: {padded_efficiency:.1%})",
        f"model      {model['model_type']}, {model['parameters']:,} parameters, vocab "
        f"{model['vocab_size']}, {model['dtype']}, {model['attn_implementation']}, "
        f"{model['device']}",
        f"training   {training['steps']} steps of {training['rows_per_step']} packed rows, "
        f"{training['optimizer']} lr {training['learning_rate']}, seed {training['seed']}",
        "",
        f"{'step':>4} {'convs':>5} {'tokens':>6}  {'packed':>10} {'padded':>10} {'naive':>10}  "
        f"{'|packed-padded|':>15} {'|naive-padded|':>14}",
    ]
    losses = zip(runs["packed"]["losses"], runs["padded"]["losses"], runs["naive"]["losses"])
    counts = zip(training["conversations_per_step"], training["tokens_per_step"])
    for step, ((p, u, n), (conversations, tokens)) in enumerate(zip(losses, counts), start=1):
        lines.append(
            f"{step:>4} {conversations:>5} {tokens:>6}  {p:>10.6f} {u:>10.6f} {n:>10.6f}  "
            f"{abs(p - u):>15.2e} {abs(n - u):>14.2e}"
        )
    verdict = "OK" if report["passed"] else "FAILED"
    lines += [
        "",
        "packed = packed rows, per-sequence mean (packed_ce, is_packed=True)",
        "padded = one conversation per row, per-sequence mean in plain PyTorch (unpacked baseline)",
        "naive  = packed rows, transformers' token mean",
        "",
        f"max |packed - padded| = {report['max_abs_diff_packed_vs_padded']:.2e}  "
        f"(tolerance {report['tolerance']:.0e}: {verdict})",
        f"max |naive  - padded| = {report['max_abs_diff_naive_vs_padded']:.2e}",
        f"throughput (real tokens/s, forward+backward+step): packed {speed['packed']:,.0f}, "
        f"padded {speed['padded']:,.0f} ({speed['packed'] / speed['padded']:.2f}x)",
    ]
    if "files" in report:
        lines.append("wrote " + ", ".join(report["files"]))
    return "\n".join(lines)


def pack_to_disk(
    *,
    dataset: str | None,
    tokenizer: str | None,
    max_length: int,
    output: str | Path,
    overflow: str = "truncate",
) -> dict[str, Any]:
    """Tokenizes and packs a data set and saves it with ``datasets.Dataset.save_to_disk``.

    Returns:
        The packing statistics (the fields of ``collators.PackingStats`` and ``efficiency``) and
        the output path, as a dict.
    """
    messages, tok = load_data(dataset, tokenizer)
    packed, stats = pack(messages, tok, max_length, overflow=overflow)
    packed.save_to_disk(str(output))
    return {**asdict(stats), "efficiency": stats.efficiency, "output": str(output)}
