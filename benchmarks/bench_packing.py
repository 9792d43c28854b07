"""Packing a tokenized data set on disk: `collators.pack_dataset` against trl's `pack_dataset(strategy="bfd")`.

Workload: tokenized conversations written once to an Arrow file (the format of `datasets`' cache) and
memory-mapped with `datasets.Dataset.from_file`, as a large SFT mix is after `tokenize_dataset`: `input_ids` and
`labels` int32 lists, lengths lognormal (median 300, sigma 1, mean about 495 tokens) clipped to [8, 16384], the
first fifth of each conversation prompt (label -100). Rows of `--max-length` tokens (8192); conversations longer
than that are truncated by both packers.

Each packer runs in a process of its own on a cold start (no cache file of an earlier run), so one cannot
inherit the other's memory. The child loads the data set, then waits; the parent reads its anonymous memory
at rest (`RssAnon` of `/proc/<pid>/status`: the memory-mapped input's pages are file-backed and do not
count), lets it pack, and samples `RssAnon` every few milliseconds until the packer returns. Reported: the
packing call's wall time, the peak of `RssAnon` above the process at rest, and the efficiency of the rows
(real tokens / (rows * max_length)). Both packers write their rows to an Arrow cache file beside the input.

trl packs each `map` batch of 1000 conversations on its own (its default), `collators.pack_dataset` the whole
data set at once (global best-fit decreasing).

`--stream`: the same file read as a stream (`Dataset.from_file(...).to_iterable_dataset()`) and packed by
`collators.pack_dataset` window by window, one run per `--windows` size (conversations; 0: the default), against
the whole-data-set packer on the same file: how memory behaves and how much a larger window tightens the rows.

Run: `python benchmarks/bench_packing.py [--sizes 50M,200M,1B] [--data-dir DIR]`. Writes
`results/packing.json`, `packing.md` and `packing.png` (time and memory against tokens) under `--out`
(`--stream`: `streaming_packing.json` and `.md`); `--data-dir` keeps the generated files between runs (8 bytes a
token).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
PACKERS = ("packed_ce", "trl")
STREAM = "packed_ce_stream"  # pack_dataset on the file read as a datasets.IterableDataset
GIB = 2**30
SAMPLE_SECONDS = 0.005
# Rows per record batch of the generated file: `datasets`' own writer batch size.
FILE_BATCH_ROWS = 1000


def parse_size(text: str) -> int:
    """`'50M'` -> 50_000_000 (suffixes k, M, B)."""
    scale = {"k": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def make_data(path: Path, num_tokens: int, seed: int = 0) -> dict:
    """Writes conversations totalling at least `num_tokens` tokens to `path` (Arrow stream format), a record
    batch at a time, so that generating 1B tokens needs no more memory than one batch."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("labels", pa.list_(pa.int32()))])
    written, conversations = 0, 0
    tmp = path.with_suffix(".tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        while written < num_tokens:
            lengths = np.clip(rng.lognormal(np.log(300), 1.0, FILE_BATCH_ROWS), 8, 16384).astype(np.int64)
            offsets = np.concatenate(([0], np.cumsum(lengths)))
            tokens = rng.integers(0, 32000, int(offsets[-1]), dtype=np.int32)
            position = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
            labels = np.where(position < np.repeat(lengths // 5, lengths), -100, tokens).astype(np.int32)
            bounds = pa.array(offsets.astype(np.int32))
            columns = [pa.ListArray.from_arrays(bounds, pa.array(values)) for values in (tokens, labels)]
            writer.write_batch(pa.record_batch(columns, schema=schema))
            written += int(offsets[-1])
            conversations += len(lengths)
    os.replace(tmp, path)
    info = {"num_tokens": written, "num_conversations": conversations, "mean_length": written / conversations}
    path.with_suffix(".json").write_text(json.dumps(info))
    return info


def rss_anon(pid: int) -> int:
    """Anonymous resident memory of process `pid` in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/<pid>/status (Linux only)")


def child(packer: str, data: Path, max_length: int, window: int) -> None:
    """One packing run: load, report ready, wait for the go, pack, report the time, then the rows' figures."""
    import datasets
    import pyarrow.compute as pc

    datasets.disable_progress_bars()
    # Imported before the clock starts (trl's modules load lazily, on first use).
    if packer == "packed_ce":
        from collators import pack_dataset

        def pack(dataset):
            return pack_dataset(dataset, max_length)
    elif packer == STREAM:
        from collators import pack_dataset

        def pack(dataset):
            options = {"buffer_size": window} if window else {}  # 0: the default (or a version without it)
            rows = data.parent / "cache-stream.arrow"
            return pack_dataset(dataset.to_iterable_dataset(), max_length, cache_file_name=str(rows), **options)
    else:
        from trl.data_utils import pack_dataset

        def pack(dataset):
            return pack_dataset(dataset, max_length, strategy="bfd")

    dataset = datasets.Dataset.from_file(str(data))
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.perf_counter()
    rows = pack(dataset)
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds}), flush=True)
    column = rows.data.table.column("input_ids")
    tokens = sum(pc.sum(pc.list_value_length(chunk)).as_py() or 0 for chunk in column.chunks)
    print(json.dumps({"rows": len(rows), "tokens": tokens, "efficiency": tokens / (len(rows) * max_length)}),
          flush=True)


def measure(packer: str, data: Path, max_length: int, window: int = 0) -> dict:
    """Runs `child` in a process of its own and samples its anonymous memory while it packs."""
    for stale in data.parent.glob("cache-*.arrow*"):  # an earlier run's rows would be reused
        stale.unlink()
    command = [sys.executable, __file__, "--child", packer, "--data", str(data), "--max-length", str(max_length),
               "--window", str(window)]
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError(f"{packer}: the child failed before packing (exit {process.wait()})")
    at_rest = rss_anon(process.pid)
    peak = at_rest
    process.stdin.write("go\n")
    process.stdin.flush()
    # Sampled from here until the child prints its time (a reader thread waits for that line).
    import threading

    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.append(process.stdout.readline()))
    reader.start()
    while reader.is_alive():
        try:
            peak = max(peak, rss_anon(process.pid))
        except (FileNotFoundError, ProcessLookupError):
            break
        time.sleep(SAMPLE_SECONDS)
    reader.join()
    result = json.loads(lines[0])
    result.update(json.loads(process.stdout.readline()))
    if process.wait() != 0:
        raise RuntimeError(f"{packer}: the child exited with {process.returncode}")
    return {**result, "anon_at_rest_gib": at_rest / GIB, "peak_anon_gib": (peak - at_rest) / GIB}


def stream_runs(data: Path, max_length: int, windows: list[int]) -> dict:
    """The whole-data-set packer, then the stream at each window, on the same file."""
    runs = {"packed_ce": measure("packed_ce", data, max_length)}
    for window in windows:
        runs[f"{STREAM} window {window or 'default'}"] = measure(STREAM, data, max_length, window)
    return runs


def write_results(out: Path, results: dict, name: str = "packing") -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [
        f"Packing a memory-mapped tokenized data set into rows of {results['max_length']} tokens "
        f"({results['machine']}).",
        "",
        "| tokens (conversations) | packer | seconds | peak anon memory (GiB above rest) | rows | efficiency |",
        "|---|---|---|---|---|---|",
    ]
    for size in results["sizes"]:
        for packer, run in size["runs"].items():
            lines.append(
                f"| {size['num_tokens'] / 1e6:,.0f}M ({size['num_conversations']:,}) | {packer} | "
                f"{run['seconds']:.1f} | {run['peak_anon_gib']:+.2f} | {run['rows']:,} | {run['efficiency']:.2%} |"
            )
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    if name == "packing":
        plot(out / "packing.png", results)


def plot(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for packer in PACKERS:
        sizes = [s for s in results["sizes"] if packer in s["runs"]]
        tokens = [s["num_tokens"] / 1e6 for s in sizes]
        left.plot(tokens, [s["runs"][packer]["seconds"] for s in sizes], "o-", label=packer)
        right.plot(tokens, [s["runs"][packer]["peak_anon_gib"] for s in sizes], "o-", label=packer)
    left.set(xlabel="tokens (millions)", ylabel="seconds", title="time to pack")
    right.set(xlabel="tokens (millions)", ylabel="GiB above the process at rest", title="peak anonymous memory",
              ylim=(0, None))
    for axis in (left, right):
        axis.grid(alpha=0.3)
        axis.legend()
    fig.suptitle(f"pack_dataset, rows of {results['max_length']} tokens, memory-mapped input")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50M,200M,1B", help="token counts (default: %(default)s)")
    parser.add_argument("--packers", default=",".join(PACKERS), help="default: %(default)s")
    parser.add_argument("--max-length", type=int, default=8192)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/bench_packing"),
                        help="where the generated data sets are kept (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="a remark stored with the results (e.g. other load)")
    parser.add_argument("--stream", action="store_true", help="pack the file read as a stream, per --windows")
    parser.add_argument("--windows", default="1024,4096,16384,65536",
                        help="--stream: window sizes in conversations, 0 for the default (default: %(default)s)")
    parser.add_argument("--child", choices=(*PACKERS, STREAM), help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--window", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.data, args.max_length, args.window)
        return
    name = "streaming_packing" if args.stream else "packing"

    packers = args.packers.split(",")
    results = {
        "max_length": args.max_length,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / GIB:.0f} GiB",
        "note": args.note,
        "versions": {name: metadata.version(name) for name in ("datasets", "pyarrow", "trl", "numpy")},
        "sizes": [],
    }
    for text in args.sizes.split(","):
        folder = args.data_dir / f"tokens_{text}"
        folder.mkdir(parents=True, exist_ok=True)
        data = folder / "data.arrow"
        if data.exists() and data.with_suffix(".json").exists():
            info = json.loads(data.with_suffix(".json").read_text())
        else:
            start = time.perf_counter()
            info = make_data(data, parse_size(text))
            print(f"generated {info['num_tokens']:,} tokens in {time.perf_counter() - start:.0f} s", flush=True)
        if args.stream:
            runs = stream_runs(data, args.max_length, [int(w) for w in args.windows.split(",")])
        else:
            runs = {packer: measure(packer, data, args.max_length) for packer in packers}
        for packer, run in runs.items():
            print(f"{text:>6} {packer:>9}: {run['seconds']:7.1f} s  {run['peak_anon_gib']:+6.2f} GiB  "
                  f"{run['rows']:>9,} rows  efficiency {run['efficiency']:.2%}", flush=True)
        for stale in folder.glob("cache-*.arrow*"):
            stale.unlink()
        results["sizes"].append({**info, "runs": runs})
        write_results(args.out, results, name)  # after every size, so a long run keeps what it measured
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
