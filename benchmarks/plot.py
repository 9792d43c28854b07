"""PNG plot of a cross-entropy benchmark result.

Left: the headline shape, every variant's median time against the floor and the target.
Right: the sweep, each implementation's fraction of the copy rate against the size N*V.

    python benchmarks/plot.py benchmarks/results/cross_entropy_<device>.json [--out PNG]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; the GPU machines have no display
import matplotlib.pyplot as plt  # noqa: E402

from make_tables import SWEEP_COLUMNS, TARGET_FRACTION  # noqa: E402

DTYPE_MARKERS = {"bfloat16": "o", "float16": "s", "float32": "^"}


def _headline_panel(ax, result: dict) -> None:
    head = result["headline"]
    rows = [row for row in head["rows"] if row["status"] == "ok"]
    labels = [row["label"] for row in rows]
    bars = ax.barh(labels, [row["median_ms"] for row in rows], color="tab:blue")
    ax.bar_label(
        bars, [f"{100 * row['fraction_of_copy']:.0f}%" for row in rows], padding=12, fontsize=8
    )
    ax.errorbar(
        [row["median_ms"] for row in rows],
        labels,
        xerr=[
            [row["median_ms"] - row["p20_ms"] for row in rows],
            [row["p80_ms"] - row["median_ms"] for row in rows],
        ],
        fmt="none",
        ecolor="black",
        capsize=2,
    )
    floor = head["floor_ms"]
    ax.axvline(floor, color="black", linestyle="--", label=f"floor {floor:.2f} ms")
    ax.axvline(
        floor / TARGET_FRACTION,
        color="tab:green",
        linestyle=":",
        label=f"{100 * TARGET_FRACTION:.0f}% of copy rate",
    )
    p = head["problem"]
    ax.set_title(f"forward+backward, N={p['n']}, V={p['vocab']}, {p['dtype']}")
    ax.set_xlabel("median ms (p20-p80), % of the copy rate at the bar's end")
    ax.invert_yaxis()  # first variant on top, as in the table
    ax.legend(loc="lower right", fontsize="small")


def _sweep_panel(ax, result: dict) -> None:
    for index, (key, title) in enumerate(SWEEP_COLUMNS):
        color = f"C{index}"
        for dtype, marker in DTYPE_MARKERS.items():
            rows = sorted(
                (
                    row
                    for row in result["sweep"]["rows"]
                    if row["key"] == key and row["dtype"] == dtype and row["status"] == "ok"
                ),
                key=lambda row: row["n"] * row["vocab"],
            )
            if rows:
                ax.plot(
                    [row["n"] * row["vocab"] for row in rows],
                    [100 * row["fraction_of_copy"] for row in rows],
                    marker=marker,
                    linestyle="",
                    color=color,
                    label=f"{title}, {dtype}",
                )
    ax.axhline(100 * TARGET_FRACTION, color="tab:green", linestyle=":")
    ax.axvline(2**31, color="gray", linewidth=0.8)  # int32 offsets end here
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N * V")
    ax.set_ylabel("% of the device-to-device copy rate")
    rows = result["sweep"]["rows"]
    vocabs = sorted({row["vocab"] for row in rows})
    tokens = sorted({row["n"] for row in rows})
    ax.set_title(f"sweep: V in {vocabs}, N in {tokens}", fontsize="medium")
    ax.legend(fontsize="x-small", ncol=2)


def plot_cross_entropy(result: dict, path: Path) -> Path:
    has_sweep = bool(result.get("sweep", {}).get("rows"))
    fig, axes = plt.subplots(1, 2 if has_sweep else 1, figsize=(15 if has_sweep else 8, 5.5))
    axes = list(axes) if has_sweep else [axes]
    _headline_panel(axes[0], result)
    if has_sweep:
        _sweep_panel(axes[1], result)
    fig.suptitle(
        f"{result['environment']['device_name']}: copy "
        f"{result['ceilings']['copy']['gbps']:.0f} GB/s"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--out", type=Path, help="PNG path (default: beside the JSON)")
    args = parser.parse_args()
    result = json.loads(args.result.read_text())
    print(plot_cross_entropy(result, args.out or args.result.with_suffix(".png")))


if __name__ == "__main__":
    main()
