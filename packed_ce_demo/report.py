"""The demo's report: the printed table and the loss plot."""

from __future__ import annotations

import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def plot_losses(runs: Mapping[str, Mapping[str, Any]], tolerance: float):
    """The loss curves of the three runs and their distance to the padded run.

    Args:
        runs: ``{"packed", "padded", "naive"}`` -> ``{"description": ..., "losses": [...]}``
            (the report's ``runs``, or the :class:`packed_ce_demo.training.Variant` as dicts).
        tolerance: drawn as the accepted distance.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state: nothing opens a window; a notebook shows
        it with ``display``).
    """
    from matplotlib.figure import Figure

    steps = range(1, len(runs["padded"]["losses"]) + 1)
    fig = Figure(figsize=(11, 4))
    curves, gaps = fig.subplots(1, 2)
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
        # float32 round-off (~1e-7, different on every CPU) is drawn at a floor a decade below
        # the tolerance, so the figure does not change from one machine to another
        gap = [max(abs(a - b), tolerance / 10) for a, b in zip(runs[name]["losses"], padded)]
        gaps.semilogy(steps, gap, "o-", color=color, label=f"|{name} - padded|")
    gaps.axhline(tolerance, color="gray", lw=1, ls="--", label=f"tolerance {tolerance:.0e}")
    gaps.set(
        xlabel="optimiser step",
        ylabel=f"|loss - padded loss| (below {tolerance / 10:.0e} drawn there)",
        title="Distance to the unpacked baseline",
    )
    gaps.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save_plot(report: Mapping[str, Any], path: str | Path) -> None:
    """:func:`plot_losses` of a demo report, as a PNG."""
    plot_losses(report["runs"], report["tolerance"]).savefig(path, dpi=110)


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
