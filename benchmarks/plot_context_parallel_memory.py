"""The table and the plot of ``bench_context_parallel_memory.py``'s JSON lines.

    python benchmarks/plot_context_parallel_memory.py \
        benchmarks/results/context_parallel_memory_cpu.jsonl   # -> the tables, the .pngs beside

One table and one plot per model (the first model's plot named as the results, the others with
the model's name appended).

Left: the peak per rank against the row's length, one line per number of ranks (and, dashed, the
gated delta net gathering the row). Right: the peak per rank times ``K`` over one rank's at the
same row: 1.0 is memory that follows the shard exactly.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only
import matplotlib.pyplot as plt  # noqa: E402


def load(path: Path) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [line for line in lines if line.get("mode") == "memory"]


def table(results: list[dict]) -> str:
    """Markdown: one row per length; MiB per rank for each K, and K x peak / one rank's peak."""
    streamed = {(r["length"], r["gpus"]): r for r in results if r.get("mixers") == "streamed"}
    gathered = {(r["length"], r["gpus"]): r for r in results if r.get("mixers") == "gathered"}
    ranks = sorted({gpus for _, gpus in streamed})
    gathered_ranks = sorted({gpus for _, gpus in gathered})
    header = ["row tokens", *(f"{k} rank{'s' * (k > 1)}" for k in ranks)]
    header += [f"K x peak / one rank's, K = {k}" for k in ranks if k > 1]
    header += [f"{k} ranks, mixer gathering the row" for k in gathered_ranks]
    rows = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    for length in sorted({length for length, _ in streamed}):
        one = streamed.get((length, 1))
        cells = [f"{length:,}"]
        cells += [
            f"{streamed[length, k]['peak_mib_per_rank']:,.0f}" if (length, k) in streamed else "-"
            for k in ranks
        ]
        for k in ranks[1:]:
            if one is None or (length, k) not in streamed:
                cells.append("-")
            else:
                ratio = k * streamed[length, k]["peak_mib_per_rank"] / one["peak_mib_per_rank"]
                cells.append(f"{ratio:.2f}")
        cells += [
            f"{gathered[length, k]['peak_mib_per_rank']:,.0f}" if (length, k) in gathered else "-"
            for k in gathered_ranks
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(results: list[dict], path: Path) -> Path:
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    for mixers, style in (("streamed", "-o"), ("gathered", "--s")):
        chosen = [r for r in results if r.get("mixers") == mixers]
        for gpus in sorted({r["gpus"] for r in chosen}):
            mine = sorted((r for r in chosen if r["gpus"] == gpus), key=lambda r: r["length"])
            label = f"{gpus} rank{'s' * (gpus > 1)}" + (
                ", mixer gathers" if mixers == "gathered" else ""
            )
            left.plot(
                [r["length"] for r in mine],
                [r["peak_mib_per_rank"] for r in mine],
                style,
                label=label,
            )
    left.set(
        xlabel="row tokens",
        ylabel="peak MiB per rank (forward + backward)",
        title="Memory per rank, streamed keys/values and states",
        xscale="log",
        yscale="log",
    )
    left.legend()
    streamed = {(r["length"], r["gpus"]): r for r in results if r.get("mixers") == "streamed"}
    for gpus in sorted({g for _, g in streamed if g > 1}):
        lengths = sorted(length for length, g in streamed if g == gpus and (length, 1) in streamed)
        ratios = [
            gpus * streamed[n, gpus]["peak_mib_per_rank"] / streamed[n, 1]["peak_mib_per_rank"]
            for n in lengths
        ]
        right.plot(lengths, ratios, "-o", label=f"K = {gpus}")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(
        xlabel="row tokens",
        ylabel="K x peak per rank / one rank's peak",
        xscale="log",
        title="1.0: memory per rank = one rank's / K",
        ylim=(0, None),
    )
    right.legend()
    fig.suptitle(f"{results[0]['model']} on the CPU (gloo), torch {results[0]['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path)
    args = parser.parse_args()
    results = load(args.results)
    for index, model in enumerate(dict.fromkeys(r["model"] for r in results)):
        mine = [r for r in results if r["model"] == model]
        print(f"{model}:\n{table(mine)}")
        suffix = "" if index == 0 else f"_{model.split(':')[0].split()[-1]}"
        print(plot(mine, args.results.with_name(args.results.stem + suffix + ".png")))


if __name__ == "__main__":
    main()
