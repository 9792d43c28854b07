"""The one table writer: markdown tables from the benchmark results (``results/*.json``).

Each benchmark prints its ``*_report`` of its own result; ``benchmarks/README.md`` holds
:func:`readme_section` of the stored results between its ``bench:start`` / ``bench:end``
markers::

    python benchmarks/make_tables.py                # rewrite the tables in benchmarks/README.md
    python benchmarks/make_tables.py --print-only   # print them

Cross entropy: every time is set against the floor, reading the logits once and writing the
gradient once (``floor_bytes``), at the device-to-device copy rate measured in the same run.
Fused linear: against ``6 N H V`` FLOPs at the bf16 matmul rate measured in the same run.
Training: whole SFT steps; see ``bench_training.py``. trl: whole trl steps and the longest
row that trains; see ``bench_trl.py``.

Only the standard library is imported here: rendering needs no GPU, torch or packed_ce.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"
README = BENCH_DIR / "README.md"
START, END = "<!-- bench:start -->", "<!-- bench:end -->"
MiB = 2**20
TARGET_FRACTION = 0.85  # of the copy rate, for packed_ce forward+backward
OVERHEAD_TARGET = 0.03  # is_packed=True over is_packed=False; the defaults over validate=False
SWEEP_COLUMNS = (  # (row key, column title) of the cross-entropy sweep table
    ("ours_packed", "packed_ce packed"),
    ("ours_unpacked", "packed_ce unpacked"),
    ("compile_fp32", "torch.compile"),
    ("liger", "Liger-Kernel"),
)
# The fused-linear targets at the headline: time against torch.compile, memory against
# cut-cross-entropy (as installed), and faster than Liger-Kernel.
FUSED_TIME_TARGET = 0.95
FUSED_MEMORY_TARGET = 1.25
FUSED_SWEEP_COLUMNS = (
    ("ours", "packed_ce fused"),
    ("ours_keep", "packed_ce, every row (drop_ignored_rows=False)"),
    ("compile_fp32", "torch.compile"),
    ("liger", "Liger-Kernel"),
    ("cce", "cut-cross-entropy"),
)


def _row(cells: list[str], width: int) -> str:
    """A table row of ``width`` cells, the missing ones empty."""
    return "| " + " | ".join(cells + [""] * (width - len(cells))) + " |"


def _timed_rows(rows: list[dict], width: int, cells, digits: int = 3) -> list[str]:
    """One table row of ``width`` cells per result row: label, median, p20-p80, then
    ``cells(row)``; a row that did not run gives its status and reason instead."""
    lines = []
    for row in rows:
        if row["status"] != "ok":
            lines.append(_row([row["label"], f"{row['status']}: {row.get('reason', '')}"], width))
            continue
        spread = f"{row['p20_ms']:.{digits}f}-{row['p80_ms']:.{digits}f}"
        lines.append(
            _row([row["label"], f"{row['median_ms']:.{digits}f}", spread, *cells(row)], width)
        )
    return lines


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def _time_cell(row: dict | None) -> str:
    """``'1.234 ms (87%)'``: median and fraction of the copy rate, or why there is none."""
    if row is None:
        return "-"
    if row["status"] != "ok":
        return f"{row['status']}: {row.get('reason', '')}"
    return f"{row['median_ms']:.3f} ms ({100 * row['fraction_of_copy']:.0f}%)"


def _memory_cell(row: dict) -> str:
    if "extra_bytes" not in row:
        return "-"
    return f"{row['extra_bytes'] / 2**30:.2f} GiB ({row['extra_grad_buffers']:.2f} x grad)"


def _versions(env: dict) -> str:
    return ", ".join(f"{name} {v}" for name, v in env["versions"].items() if v is not None)


def cross_entropy_ceilings(result: dict) -> str:
    env, ceilings = result["environment"], result["ceilings"]
    return (
        f"{env['device_name']} ({_versions(env)}; packed_ce kernel {result['kernel_sha256']}): "
        f"device-to-device copy {ceilings['copy']['gbps']:.0f} GB/s counting read + write, "
        f"bf16 {ceilings['matmul']['n']}^3 matmul {ceilings['matmul']['tflops']:.0f} TFLOP/s."
    )


def _options_note(rows: list[dict]) -> str:
    # Results taken before the rows named their options: then "validate=True (default)" was
    # the one row with the default, every other packed_ce row ran with validate=False.
    if any(row["key"] == "ours_packed_validate" for row in rows):
        return "packed_ce rows use validate=False unless marked"
    return "Each packed_ce row names its options; (defaults) marks what a user gets"


def cross_entropy_headline(result: dict) -> str:
    head = result["headline"]
    p = head["problem"]
    floor = head["floor_ms"]
    lines = [
        f"Forward+backward, N={p['n']}, V={p['vocab']}, {p['dtype']}, {p['sequences']} packed "
        f"sequences, {100 * p['ignored_fraction']:.0f}% of tokens without a target. Floor "
        f"{p['floor_bytes'] / 1e9:.2f} GB = {floor:.3f} ms at the copy rate; the target "
        f"({100 * TARGET_FRACTION:.0f}%) is {floor / TARGET_FRACTION:.3f} ms. "
        + _options_note(head["rows"])
        + "; extra memory is in (N, V) gradient buffers; host ms is how long "
        "the step holds the host (enqueuing, and any sync inside): a step whose host time "
        "exceeds its device time cannot keep the GPU busy on its own.",
        "",
        "| variant | median ms | p20-p80 ms | GB/s | % of copy | extra memory | host ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    return "\n".join(
        lines
        + _timed_rows(
            head["rows"],
            7,
            lambda row: [
                f"{row['gbps']:.0f}",
                f"{100 * row['fraction_of_copy']:.1f}%",
                _memory_cell(row),
                f"{row['host_ms']:.3f}",
            ],
        )
    )


def _overhead_line(overhead: dict, what: str) -> str:
    return (
        f"- {what}: {100 * overhead['overhead']:+.1f}% (per-rep pairs: median "
        f"{100 * overhead['pair_median']:+.1f}%, p20-p80 {100 * overhead['pair_p20']:+.1f}%.."
        f"{100 * overhead['pair_p80']:+.1f}%; target <= {100 * OVERHEAD_TARGET:.0f}%): "
        f"{_met(overhead['overhead'] <= OVERHEAD_TARGET)}"
    )


def cross_entropy_targets(result: dict) -> str:
    """The targets at the headline shape, each met or missed; rows named by their labels."""
    head = result["headline"]
    rows = {row["key"]: row for row in head["rows"]}
    lines = []
    ours = rows.get("ours_packed", {})
    if ours.get("status") == "ok":
        fraction = ours["fraction_of_copy"]
        lines.append(
            f"- {ours['label']}: {ours['median_ms']:.3f} ms = {100 * fraction:.1f}% of the copy "
            f"rate (target >= {100 * TARGET_FRACTION:.0f}%): {_met(fraction >= TARGET_FRACTION)}"
        )
    for key, what in (
        ("validate_overhead", "the defaults (validate=True) over validate=False"),
        ("packed_overhead", "is_packed=True over is_packed=False"),
        ("packed_overhead_inplace", "is_packed=True over is_packed=False, inplace_backward"),
    ):
        if head.get(key) is not None:
            lines.append(_overhead_line(head[key], what))
    # inplace_backward=True: no (N, V) buffer at all; False: the gradient itself, no more.
    for key, limit, wanted in (
        ("ours_packed_inplace", 0.5, "no extra (N, V) buffer"),
        ("ours_packed", 1.5, "one (N, V) buffer at most"),
    ):
        row = rows.get(key, {})
        if "extra_grad_buffers" in row:
            buffers = row["extra_grad_buffers"]
            lines.append(
                f"- {row['label']}: {buffers:.2f} (N, V) buffers extra ({wanted}): "
                f"{_met(buffers < limit)}"
            )
    for name, check in head.get("checks", {}).items():
        lines.append(
            f"- {name} loss and gradient against PyTorch fp32: loss rel. error "
            f"{check['loss_rel_error']:.1e}, gradient {check['grad_rel_error']:.1e}: "
            f"{'passed' if check['passed'] else 'FAILED'}"
        )
    return "\n".join(lines)


def cross_entropy_sweep(result: dict) -> str:
    sweep = result["sweep"]
    copy_gbps = result["ceilings"]["copy"]["gbps"]
    shapes: dict[tuple, dict] = {}
    for row in sweep["rows"]:
        shapes.setdefault((row["dtype"], row["n"], row["vocab"]), {})[row["key"]] = row
    titles = " | ".join(title for _, title in SWEEP_COLUMNS)
    lines = [
        f"Forward+backward, time (% of the copy rate); packed overhead = packed / unpacked - 1; "
        f"extra memory of packed_ce packed in (N, V) buffers; {100 * TARGET_FRACTION:.0f}% = "
        "the target.",
        "",
        f"| dtype | N | V | N*V > 2^31 | floor ms | {titles} | packed overhead | "
        f"extra memory | >= {100 * TARGET_FRACTION:.0f}% |",
        "|---|---:|---:|---|---:|" + "---:|" * len(SWEEP_COLUMNS) + "---:|---:|---|",
    ]
    for (dtype, n, vocab), rows in sorted(shapes.items()):
        any_row = next(iter(rows.values()))
        ours, unpacked = rows.get("ours_packed"), rows.get("ours_unpacked")
        overhead = meets = memory = "-"
        if ours and unpacked and ours["status"] == unpacked["status"] == "ok":
            overhead = f"{100 * (ours['median_ms'] / unpacked['median_ms'] - 1):+.1f}%"
            meets = _met(ours["fraction_of_copy"] >= TARGET_FRACTION)
        if ours and "extra_grad_buffers" in ours:
            memory = f"{ours['extra_grad_buffers']:.2f}"
        cells = " | ".join(_time_cell(rows.get(key)) for key, _ in SWEEP_COLUMNS)
        lines.append(
            f"| {dtype} | {n} | {vocab} | {'yes' if any_row['n_times_v_over_2_31'] else 'no'} | "
            f"{any_row['floor_bytes'] / copy_gbps / 1e6:.3f} | {cells} | {overhead} | {memory} | "
            f"{meets} |"
        )
    for skip in sweep["skipped"]:
        over = "yes" if skip["n"] * skip["vocab"] > 2**31 else "no"
        cells = [skip["dtype"], str(skip["n"]), str(skip["vocab"]), over, "-"]
        lines.append(_row(cells + [f"skipped: {skip['reason']}"], 5 + len(SWEEP_COLUMNS) + 3))
    return "\n".join(lines)


def cross_entropy_configs(result: dict) -> str:
    configs = result["configs"]
    p = configs["problem"]
    ok = [row for row in configs["rows"] if row["status"] == "ok"]
    best = min(ok, key=lambda row: row["median_ms"])["key"] if ok else None
    lines = [
        f"packed_ce is_packed=True forward+backward by launch config, N={p['n']}, "
        f"V={p['vocab']}, {p['dtype']}.",
        "",
        "| config | median ms | p20-p80 ms | % of copy | |",
        "|---|---:|---:|---:|---|",
    ]
    return "\n".join(
        lines
        + _timed_rows(
            configs["rows"],
            5,
            lambda row: [
                f"{100 * row['fraction_of_copy']:.1f}%",
                "best" if row["key"] == best else "",
            ],
        )
    )


def defaults_report(result: dict) -> str:
    """What the defaults (value checks on) cost over ``validate=False``, shape by shape."""
    lines = [
        cross_entropy_ceilings(result),
        "",
        "Forward+backward, bf16, `is_packed=True`: packed_ce with its defaults (`validate=True`: "
        "values checked on the device, no host sync) against `validate=False`; median ms (% of "
        f"the copy rate); overhead = defaults / validate=False - 1 (median of per-rep pairs), "
        f"target <= {100 * OVERHEAD_TARGET:.0f}%.",
        "",
        "| N x V | floor ms | packed_ce defaults | validate=False | Liger-Kernel | overhead | "
        f"<= {100 * OVERHEAD_TARGET:.0f}% |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for entry in result["defaults"]:
        p = entry["problem"]
        rows = {row["key"]: row for row in entry["rows"]}
        over = entry["validate_overhead"]
        lines.append(
            _row(
                [
                    f"{p['n']} x {p['vocab']}",
                    f"{entry['floor_ms']:.3f}",
                    _time_cell(rows.get("ours_packed")),
                    _time_cell(rows.get("ours_packed_no_sync")),
                    _time_cell(rows.get("liger")),
                    "-" if over is None else f"{100 * over['pair_median']:+.1f}%",
                    "-" if over is None else _met(over["pair_median"] <= OVERHEAD_TARGET),
                ],
                7,
            )
        )
    return "\n".join(lines)


def cross_entropy_report(result: dict) -> str:
    """Everything one run measured, the headline table last."""
    parts = [f"## cross entropy benchmark ({result['mode']})", cross_entropy_ceilings(result)]
    if "configs" in result:
        parts.append(cross_entropy_configs(result))
    if "sweep" in result:
        parts.append(cross_entropy_sweep(result))
    if "headline" in result:
        parts += [cross_entropy_targets(result), cross_entropy_headline(result)]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------
# Fused linear cross entropy


def _mib(row: dict) -> str:
    return f"{row['transient_bytes'] / MiB:.0f}" if "transient_bytes" in row else "-"


def fused_linear_headline(result: dict) -> str:
    head = result["headline"]
    p, rows = head["problem"], head["rows"]
    by_key = {row["key"]: row for row in rows}
    compiled, cce = by_key.get("compile_fp32", {}), by_key.get("cce", {})
    lines = [
        f"Forward+backward, N={p['n']}, H={p['hidden']}, V={p['vocab']}, {p['dtype']}, "
        f"{p['sequences']} packed sequences, {100 * p['ignored_fraction']:.0f}% of tokens without "
        f"a target. Floor: 6NHV = {p['flops'] / 1e12:.1f} TFLOP at the measured matmul rate = "
        f"{head['floor_ms']:.1f} ms. Transient memory excludes the inputs and the gradients of "
        "hidden and weight.",
        "",
        "| variant | median ms | p20-p80 ms | % of floor | vs torch.compile | transient MiB | "
        "vs cut-cross-entropy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def cells(row: dict) -> list[str]:
        speed = memory = "-"
        if compiled.get("status") == "ok":
            speed = f"{row['median_ms'] / compiled['median_ms']:.2f}x"
        if "transient_bytes" in row and "transient_bytes" in cce:
            memory = f"{row['transient_bytes'] / cce['transient_bytes']:.2f}x"
        return [f"{100 * row['fraction_of_floor']:.0f}%", speed, _mib(row), memory]

    return "\n".join(lines + _timed_rows(rows, 7, cells, digits=2))


def fused_linear_targets(result: dict) -> str:
    """The issue's targets at the headline shape, each met or missed."""
    head = result["headline"]
    rows = {row["key"]: row for row in head["rows"]}
    ours, compiled = rows.get("ours", {}), rows.get("compile_fp32", {})
    liger, cce = rows.get("liger", {}), rows.get("cce", {})
    lines = []
    if ours.get("status") == "ok" and compiled.get("status") == "ok":
        ratio = ours["median_ms"] / compiled["median_ms"]
        lines.append(
            f"- time: {ours['median_ms']:.2f} ms = {ratio:.3f}x torch.compile "
            f"({compiled['median_ms']:.2f} ms; target <= {FUSED_TIME_TARGET}x): "
            f"{_met(ratio <= FUSED_TIME_TARGET)}"
        )
    if ours.get("status") == "ok" and liger.get("status") == "ok":
        lines.append(
            f"- time against Liger-Kernel ({liger['median_ms']:.2f} ms; target: faster): "
            f"{_met(ours['median_ms'] < liger['median_ms'])}"
        )
    if "transient_bytes" in ours and "transient_bytes" in cce:
        ratio = ours["transient_bytes"] / cce["transient_bytes"]
        lines.append(
            f"- transient memory: {_mib(ours)} MiB = {ratio:.2f}x cut-cross-entropy "
            f"({_mib(cce)} MiB; target <= {FUSED_MEMORY_TARGET}x): "
            f"{_met(ratio <= FUSED_MEMORY_TARGET)}"
        )
    check = head["check"]
    lines.append(
        "- loss and gradients against float32 math: loss rel. error "
        f"{check['loss_rel_error']:.1e}, hidden {check['grad_hidden_rel_error']:.1e}, weight "
        f"{check['grad_weight_rel_error']:.1e}: {'passed' if check['passed'] else 'FAILED'}"
    )
    return "\n".join(lines)


def fused_linear_sweep(result: dict) -> str:
    sweep = result["sweep"]
    shapes: dict[tuple, dict] = {}
    for row in sweep["rows"]:
        shapes.setdefault((row["n"], row["vocab"]), {})[row["key"]] = row
    titles = " | ".join(title for _, title in FUSED_SWEEP_COLUMNS)
    lines = [
        f"Forward+backward, H={result['headline']['problem']['hidden']}, "
        f"{result['headline']['problem']['dtype']}: median ms / transient MiB.",
        "",
        f"| N | V | floor ms | {titles} |",
        "|---:|---:|---:|" + "---:|" * len(FUSED_SWEEP_COLUMNS),
    ]
    tflops = result["ceilings"]["matmul"]["tflops"]
    for (n, vocab), rows in sorted(shapes.items()):
        floor = 6 * n * result["headline"]["problem"]["hidden"] * vocab / tflops / 1e9
        cells = []
        for key, _ in FUSED_SWEEP_COLUMNS:
            row = rows.get(key)
            if row is None:
                cells.append("-")
            elif row["status"] != "ok":
                cells.append(f"{row['status']}: {row.get('reason', '')}")
            else:
                cells.append(f"{row['median_ms']:.2f} / {_mib(row)}")
        lines.append(f"| {n} | {vocab} | {floor:.2f} | " + " | ".join(cells) + " |")
    for skip in sweep["skipped"]:
        lines.append(f"| {skip['n']} | {skip['vocab']} | - | skipped: {skip['reason']} |")
    return "\n".join(lines)


def fused_linear_report(result: dict) -> str:
    """Everything one run measured, the headline table last."""
    env, matmul = result["environment"], result["ceilings"]["matmul"]
    parts = [
        f"## fused linear cross entropy benchmark ({result['mode']})",
        f"{env['device_name']} ({_versions(env)}): bf16 {matmul['n']}^3 matmul "
        f"{matmul['tflops']:.0f} TFLOP/s.",
    ]
    if "sweep" in result:
        parts += ["#### sweep", fused_linear_sweep(result)]
    parts += ["#### headline", fused_linear_headline(result), fused_linear_targets(result)]
    return "\n\n".join(parts)


# --------------------------------------------------------------------------------------------
# Whole training steps


def _seconds(run: dict) -> str:
    if "median_seconds" not in run:
        return "-"
    return f"{run['median_seconds']:.3f} ({run['p20_seconds']:.3f}-{run['p80_seconds']:.3f})"


def training_report(result: dict) -> str:
    """The runs of one ``bench_training.py`` result, the objective check and the speed-up."""
    env, model, data, check = (result[k] for k in ("environment", "model", "data", "check"))
    runs = result["runs"]
    padded = runs.get("padded", {}).get("median_seconds")
    lines = [
        f"{env['device_name']} ({_versions(env)}). Llama-style model, "
        f"{model['parameters'] / 1e9:.2f}B parameters ({model['config']['num_hidden_layers']} "
        f"layers, hidden {model['config']['hidden_size']}, vocabulary "
        f"{model['config']['vocab_size']}), {model['dtype']} weights and AdamW state. Each step: "
        f"{data['conversations_per_step']:.1f} conversations, {data['real_tokens_per_step']:.0f} "
        f"real tokens ({data['target_tokens_per_step']:.0f} targets), packed in one row of "
        f"{data['row_tokens']} tokens padded to a multiple of {data['pad_to_multiple']}; padded: "
        f"micro-batches of {data['padded_batch']} conversations, "
        f"{data['padded_tokens_per_step']:.0f} tokens with padding. {result['warmup_steps']} "
        "warm-up steps per run (1 for the exact-length run), reported apart; steady state: "
        "median (p20-p80) of the other steps; tokens/s: real tokens only, the median over the "
        "steady steps; compiles: graphs "
        "torch.compile compiled in each warm-up step, then in all steady steps together "
        "(recompiles); slow steps: steady steps over twice the median; peak: allocated GPU "
        "memory over the run, weights, gradients and optimiser state included.",
        "",
        "| run | attention | warm-up steps s | steady step s | tokens/s | vs padded "
        "| compiles warm-up; steady | slow steps | peak GiB | first-step loss |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for run in runs.values():
        speed = "-"
        if padded and "median_seconds" in run:
            speed = f"{padded / run['median_seconds']:.2f}x"
        tokens = f"{run['tokens_per_second']:,.0f}" if run.get("tokens_per_second") else "-"
        peak = f"{run['peak_gib']:.1f}" if "peak_gib" in run else "-"
        warmup = ", ".join(f"{s:.2f}" for s in run["warmup_seconds"]) or "-"
        compiles = f"{', '.join(map(str, run['warmup_compiles'])) or '-'}; {run['recompiles']}"
        loss = f"{run['losses'][0]:.4f}" if run["losses"] else "-"
        lines.append(
            f"| {run['label']} | {run['attention']} | {warmup} | {_seconds(run)} | {tokens} "
            f"| {speed} | {compiles} | {run.get('slow_steps', '-')} | {peak} | {loss} |"
        )
    # results before the check covered every step hold no "steps": they checked the first one
    checked = (
        f"the {check['steps']} steps" if check.get("steps", 1) > 1 else "the first step"
    )
    lines += [
        "",
        f"- same objective, initial weights, {check['conversations']} conversations of "
        f"{checked}: each conversation's mean loss, packed row vs padded row, max relative "
        f"difference {check['max_rel_diff_per_conversation']:.1e}; a step's loss "
        f"{check['rel_diff_loss']:.1e} at most"
        + (
            f"; first training step's loss, packed run vs padded run, "
            f"{check['rel_diff_first_step_loss']:.1e}"
            if "rel_diff_first_step_loss" in check
            else ""
        )
        + f" (tolerance {check['tolerance']:g}): {'passed' if check['passed'] else 'FAILED'}",
        f"- transformers' token mean (another objective) vs the per-conversation mean on the same "
        f"steps: relative difference {check['rel_diff_stock_token_mean']:.1e} at most",
    ]
    first_sight = runs.get("padded", {}).get("shapes_seen_before")
    if first_sight:
        seconds = first_sight["seconds"]
        lines.append(
            f"- padded: before its timed steps, every micro-batch once (forward and backward, "
            f"no optimiser step): {first_sight['micro_batches']} micro-batches of "
            f"{first_sight['shapes']} shapes, {sum(seconds):.1f} s, at first sight "
            f"{first_sight['median_seconds']:.3f} s per micro-batch (median), "
            f"{max(seconds):.2f} s at most"
        )
    exact = runs.get("packed_exact_length")
    if exact:
        steps = ", ".join(
            f"{tokens} tokens {seconds:.2f} s ({graphs} compiled)"
            for tokens, seconds, graphs in zip(
                exact["row_lengths"],
                exact["warmup_seconds"] + exact["step_seconds"],
                exact["warmup_compiles"] + exact["step_compiles"],
            )
        )
        lines.append(f"- rows at their exact length, step by step: {steps}")
    for run, reason in result.get("skipped_runs", {}).items():
        lines.append(f"- {run}: {reason}")
    for name, run in runs.items():
        if run.get("steps_not_run"):
            lines.append(f"- {name}: {run['steps_not_run']} steps not run (time budget)")
    if "speedup_packed_over_padded" in result:
        lines.append(
            f"- packing at the same objective: {result['speedup_packed_over_padded']:.2f}x the "
            "padded steady-state step rate"
        )
    if "speedup_packed_over_stock" in result:
        lines.append(
            f"- packed_ce's per-conversation mean: {result['speedup_packed_over_stock']:.2f}x "
            "the steady-state step rate of the stock padding-free token mean (another objective)"
        )
    return "\n".join(lines)


def _model_text(result: dict) -> str:
    parts = []
    for name, config in result["models"].items():
        tied = ", tied embeddings" if config.get("tie_word_embeddings") else ""
        parts.append(
            f"{name}: {config.get('model_type', 'llama')}, {config['num_hidden_layers']} layers, hidden "
            f"{config['hidden_size']}, vocabulary {config['vocab_size']}{tied}"
        )
    return "; ".join(parts)


def _adapter_label(found: dict) -> str:
    """What trained in a search: nothing added for every parameter, else LoRA or QLoRA."""
    if found.get("quantized"):
        return " QLoRA"
    return " LoRA" if found["lora"] else ""


# What trains in a bench_trl.py result (its --adapter)
ADAPTER_TEXT = {
    "full": "every parameter trained",
    "lora": "LoRA r=16 on every linear layer, base frozen",
    "qlora": "QLoRA: LoRA r=16 on every linear layer of the base model in 4 bits (nf4, bf16 "
    "compute)",
}


ADAPTER_HEADINGS = {"lora": "LoRA", "qlora": "QLoRA"}


def trl_steps_report(result: dict) -> str:
    """The runs of one ``bench_trl.py`` throughput result: speed, memory, the objective check
    and, where profiled, the share of packed-ce's own kernels in a step."""
    env, runs = result["environment"], result["runs"]
    done = {name: run for name, run in runs.items() if "error" not in run}
    first = next(iter(done.values()), None)
    lines = [
        f"{env['device_name']} ({_versions(env)}). {_model_text(result)}; random init, "
        + ADAPTER_TEXT[result.get("adapter", "full")]
        + ", "
        f"{'bf16' if env['device_name'] != 'cpu' else 'fp32'}, {result['attention']}, "
        f"gradient checkpointing {'on' if result['gradient_checkpointing'] else 'off'}; trl "
        "packing=True (bfd), padding_free=True, one packed row per step"
        + (
            f" of up to {first['job']['row_length']} tokens ({first['real_tokens_per_step']:.0f} "
            "real tokens on average)"
            if first and first.get("real_tokens_per_step")
            else ""
        )
        + f". {result['warmup_steps']} warm-up steps per run, reported apart; steady: the "
        "median step (p20-p80), each from the end of the previous one; tokens/s: real tokens "
        "(no padding) of all steady steps over their time; vs stock: tokens/s over the stock "
        "trainer's with the same kernels; peak: allocated GPU memory from the first step on.",
        "",
        "| run | warm-up steps s | steady step s | steps | real tokens/s | vs stock | peak GiB "
        "| first-step loss | objective |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, run in runs.items():
        if "error" in run:
            lines.append(f"| {RUN_LABELS.get(name, name)} | {run['error']} |" + " |" * 7)
            continue
        peer = done.get("stock_liger" if name.endswith("_liger") else "stock")
        speed = "-"
        if peer and run.get("tokens_per_second") and peer.get("tokens_per_second"):
            speed = f"{run['tokens_per_second'] / peer['tokens_per_second']:.3f}x"
        check = run["check"]
        objective = (
            f"{check['expected'].replace('_', ' ')}: "
            f"{'passed' if check['passed'] else 'FAILED'} ({check['rel_diff_expected']:.1e})"
        )
        peak = f"{run['peak_gib']:.2f}" if "peak_gib" in run else "-"
        tokens = f"{run['tokens_per_second']:,.0f}" if run.get("tokens_per_second") else "-"
        lines.append(
            f"| {run['label']} | {', '.join(f'{s:.2f}' for s in run['warmup_seconds']) or '-'} "
            f"| {_seconds(run)} | {len(run['step_seconds'])} | {tokens} | {speed} | {peak} "
            f"| {run['losses'][0]:.5f} | {objective} |"
        )
    lines.append("")
    for name, run in done.items():
        check = run["check"]
        lines.append(
            f"- {name}, objective check on its first step ({check['conversations']} "
            f"conversations, {check['targets']} targets), initial weights: loss "
            f"{check['first_step_loss']:.6f}; float32 reference: per-conversation mean "
            f"{check['per_conversation_mean']:.6f}, token mean {check['token_mean']:.6f} (apart "
            f"by {check['separation']:.1e}); expected the {check['expected'].replace('_', ' ')}, "
            f"relative difference {check['rel_diff_expected']:.1e} (tolerance "
            f"{check['tolerance']:g}), to the other {check['rel_diff_other']:.1e}: "
            f"{'passed' if check['passed'] else 'FAILED'}"
        )
    for name, run in done.items():
        profile = run.get("profile")
        if not profile:
            continue
        share = profile["own_share_of_device_time"]
        waits, reads = (
            ", ".join(f"{k} {v}" for k, v in sorted(profile[key].items())) or "none"
            for key in ("host_waits_by_origin", "scalar_reads_by_origin")
        )
        lines.append(
            f"- {name}, one profiled step: packed-ce's own kernels {profile['own_ms']:.2f} ms"
            + (f" = {share:.2%} of the step's device time" if share is not None else "")
            + f" ({profile['device_ms']:.1f} ms of kernels; wall {profile['wall_ms']:.1f} ms "
            f"under the profiler); packed_ce's whole path, with the PyTorch kernels and GEMMs "
            f"it launches, {profile['packed_ce_path_ms']:.2f} ms; host waits "
            f"(synchronize calls) by the package that made them: {waits}; reads of a device "
            f"value (.item() and the like): {reads}"
        )
    for name, reason in result.get("skipped_runs", {}).items():
        lines.append(f"- {name}: {reason}")
    return "\n".join(lines)


RUN_LABELS = {
    "packed": "PackedSFTTrainer",
    "stock": "SFTTrainer",
    "packed_liger": "PackedSFTTrainer + Liger",
    "stock_liger": "SFTTrainer + Liger",
}


def _against_stock(found: dict, searches: dict) -> tuple[str, str]:
    """A search's longest row as a multiple of stock trl's in the same result (same Liger
    setting), and its peak GiB at that row, as table cells."""
    liger = "_liger" if found["run"].endswith("_liger") else ""
    peer = searches.get(f"{found['model']}_stock{liger}", {})
    ratio = "-"
    if found["longest_fits"] and peer.get("longest_fits"):
        ratio = f"{found['longest_fits'] / peer['longest_fits']:.2f}x"
    fitting = [p for p in found["probes"] if p["row_length"] == found["longest_fits"]]
    peak = f"{fitting[0]['peak_gib']:.1f}" if fitting and "peak_gib" in fitting[0] else "-"
    return ratio, peak


def trl_longest_report(result: dict) -> str:
    """The longest packed row each run trains, from one ``bench_trl.py --longest`` result."""
    env = result["environment"]
    lines = [
        f"{env['device_name']} ({_versions(env)}). {_model_text(result)}; {result['attention']}, "
        f"gradient checkpointing, trl packing=True (bfd), padding_free=True, one row per step "
        f"padded to the probed length; a length fits when {result['probe_steps']} steps train "
        "without running out of memory. Lengths double from the first, then go where the "
        "peak memory of the two longest that fit reaches 95% of the device's, and bisect "
        "(split at that prediction where it lies inside the bracket)."
        + (
            " 8b: LoRA (" + ", ".join(f"{k}={v}" for k, v in result["lora"].items()) + ")."
            if "8b" in result["models"]
            else ""
        ),
        "",
        "| model | run | longest that fits | shortest that fails | vs stock | peak GiB at the "
        "longest | probes (tokens: outcome, s) | stopped |",
        "|---|---|---:|---:|---:|---:|---|---|",
    ]
    searches = result["searches"]
    for found in searches.values():
        probes = ", ".join(
            f"{p['row_length']}: {p['status']} {p['seconds']:.0f}" for p in found["probes"]
        )
        ratio, peak = _against_stock(found, searches)
        lines.append(
            f"| {found['model']}{_adapter_label(found)} | {found['label']} "
            f"| {found['longest_fits'] or '-'} | {found['shortest_fails'] or '-'} | {ratio} "
            f"| {peak} | {probes or '-'} | {found.get('stopped', '-')} |"
        )
    errors = [
        f"- {key}: {p['row_length']} tokens: {p['error']}"
        for key, found in searches.items()
        for p in found["probes"]
        if p["status"] == "error"
    ]
    warmups = ", ".join(
        f"{w['model']} {w['row_length']}: {w['status']} {w['seconds']:.0f} s"
        for w in result.get("warmups", [])
    )
    if warmups:
        lines += ["", f"Warm-up probes (flex attention compiles; not part of a search): {warmups}."]
    return "\n".join(lines + ([""] + errors if errors else []))


def search_resolution(result: dict) -> float:
    """The ``--resolution`` of a longest-row result (stored since it became a field; before
    that, read from its command line, where 0.125 was the default)."""
    if "resolution" in result:
        return result["resolution"]
    words = result["command"].split()
    return float(words[words.index("--resolution") + 1]) if "--resolution" in words else 0.125


def trl_longest_summary(results: list[dict]) -> str:
    """One device's longest-row searches, from every stored result of it, in one table; each
    run is set against stock trl of the same result (same process, same Liger setting)."""
    env = results[0]["environment"]
    lines = [
        f"{env['device_name']} ({_versions(env)}). Flex attention, gradient checkpointing, trl "
        "packing (bfd) + padding_free, one row per step padded to the probed length; a length "
        f"fits when {results[0]['probe_steps']} steps train without running out of memory. 1b: "
        "Llama-3.2-1B shape fully fine-tuned; 8b: Llama-3-8B shape with LoRA (r=16, all linear "
        "layers). Each line of the table is one search; searches of one result ran one after "
        "the other in one process; the first probe and the resolution (the largest gap left "
        "between fits and fails, as a share of the longest that fits) are the search's.",
        "",
        "| model | run | longest that fits | shortest that fails | vs stock | peak GiB | first "
        "probe | resolution | probes | stopped |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        searches = result["searches"]
        for found in searches.values():
            ratio, peak = _against_stock(found, searches)
            first = found["probes"][0]["row_length"] if found["probes"] else "-"
            lines.append(
                f"| {found['model']}{_adapter_label(found)} "
                f"| {RUN_LABELS.get(found['run'], found['run'])} "
                f"| {found['longest_fits'] or '-'} | {found['shortest_fails'] or '-'} | {ratio} "
                f"| {peak} | {first} | {search_resolution(result):g} | {len(found['probes'])} "
                f"| {found.get('stopped', '-')} |"
            )
    return "\n".join(lines)


def load_trl_results(results_dir: Path, benchmark: str) -> list[dict]:
    """The newest full ``bench_trl.py`` result per device, models, attention and set of runs
    (or searches)."""
    newest: dict[tuple, dict] = {}
    for path in sorted(Path(results_dir).glob("trl_*.json")):
        result = json.loads(path.read_text())
        if result.get("benchmark") != benchmark or result.get("mode") != "full":
            continue  # a run's own file, or tiny numbers that mean nothing
        runs = tuple(sorted(result.get("runs") or result.get("searches") or ()))
        device = result["environment"]["device_name"]
        adapter = result.get("adapter", "full")
        order = bool(result.get("reverse"))  # a run in both orders: both are kept
        # the kernels a hybrid family's token mixers ran on (none recorded: transformers' PyTorch)
        fla = result["environment"].get("versions", {}).get("fla-core")
        key = (device, tuple(result["models"]), adapter, order, result["attention"], runs, fla)
        if key not in newest or result["created"] > newest[key]["created"]:
            newest[key] = result
    return [newest[key] for key in sorted(newest, key=str)]


def load_results(
    results_dir: Path, benchmark: str, modes: tuple[str, ...] = ("full", "quick")
) -> list[dict]:
    """The newest result of ``benchmark`` for each device, of the first mode in ``modes`` that
    has one (full before quick by default)."""
    newest: dict[str, dict] = {}
    for path in sorted(Path(results_dir).glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("benchmark") != benchmark or result.get("mode") not in modes:
            continue  # smoke and tiny numbers mean nothing
        device = result["environment"]["device_name"]
        rank = (-modes.index(result["mode"]), result["created"])
        kept = newest.get(device)
        if kept is None or rank > (-modes.index(kept["mode"]), kept["created"]):
            newest[device] = result
    return [newest[device] for device in sorted(newest)]


def readme_section(results_dir: Path = RESULTS_DIR) -> str:
    """The tables of ``benchmarks/README.md``, from the stored results, device by device."""
    parts = []
    for result in load_results(results_dir, "training"):
        parts += [f"### Whole SFT steps, {result['environment']['device_name']}"]
        parts.append(training_report(result))
    for result in load_trl_results(results_dir, "trl_steps"):
        adapter = result.get("adapter", "full")
        what = "" if adapter == "full" else f", {ADAPTER_HEADINGS[adapter]}"
        what += ", in reverse order" if result.get("reverse") else ""
        fla = result["environment"].get("versions", {}).get("fla-core")
        what += f", token mixers through fla-core {fla}" if fla else ""
        parts.append(f"### Whole trl steps{what}, {result['environment']['device_name']}")
        parts.append(trl_steps_report(result))
    longest: dict[str, list[dict]] = {}
    for result in load_trl_results(results_dir, "trl_longest"):
        longest.setdefault(result["environment"]["device_name"], []).append(result)
    for device, results in longest.items():
        results.sort(key=lambda result: (list(result["models"]), result["created"]))
        parts.append(f"### The longest row that trains, {device}")
        parts.append(trl_longest_summary(results))
    for result in load_results(results_dir, "cross_entropy", modes=("defaults",)):
        parts.append(f"### The default path, {result['environment']['device_name']}")
        parts.append(defaults_report(result))
    for result in load_results(results_dir, "cross_entropy"):
        if "headline" not in result:
            continue
        parts.append(f"### cross_entropy, {result['environment']['device_name']}")
        parts.append(cross_entropy_ceilings(result))
        parts += [cross_entropy_headline(result), cross_entropy_targets(result)]
        if "sweep" in result:
            parts.append(cross_entropy_sweep(result))
    for result in load_results(results_dir, "fused_linear"):
        parts.append(f"### fused_linear_cross_entropy, {result['environment']['device_name']}")
        # the report's first paragraph is its own title, replaced by the heading above
        parts.append(fused_linear_report(result).split("\n\n", 1)[1])
    if not parts:
        parts.append("No benchmark results yet: run `make bench` on a GPU machine.")
    return "\n\n".join(parts)


def update_readme(readme: Path, section: str) -> None:
    """Replaces what lies between the ``bench:start`` and ``bench:end`` markers."""
    text = Path(readme).read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} has no {START} ... {END} markers")
    Path(readme).write_text(text[: start + len(START)] + "\n" + section + "\n" + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description="benchmarks/README.md tables from the results")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--readme", type=Path, default=README, help="file with the markers")
    parser.add_argument("--print-only", action="store_true", help="print, write nothing")
    args = parser.parse_args()
    section = readme_section(args.results)
    if args.print_only:
        print(section)
        return
    try:
        update_readme(args.readme, section)
    except (OSError, ValueError) as error:
        sys.exit(f"make_tables: {error}")
    print(f"wrote the tables into {args.readme}")


if __name__ == "__main__":
    main()
