"""`packed-ce pack` end to end on a messages JSONL file: wall time and peak memory at each `--num-proc`.

Workload: synthetic chat written once as JSONL (`--data-dir`), in the default tokenizer's vocabulary (random token
ids of `collators.load_default_tokenizer()`, decoded to text): Geometric(0.5) user/assistant exchanges per
conversation (at least 1, mean 2), user turns lognormal (median 40 tokens, sigma 1.0), assistant turns lognormal
(median 150, sigma 0.8), a system prompt in half of them (median 30).

Each run is `python -m packed_ce_demo.cli pack --dataset FILE --output DIR --max-length 4096 --num-proc N --json`
in a process of its own with an empty `datasets` cache (`HF_DATASETS_CACHE` in a fresh temporary folder), so it
loads the JSON, tokenizes, packs and saves from scratch. Reported: wall time, the peak resident memory of the
command's processes (`ru_maxrss` of the largest: the main process or one worker), the tokens and rows it printed,
and how many cores two processes got just before (`parallel_speedup`: a shared machine may give fewer than it has).

Run: `python benchmarks/bench_pack_command.py [--tokens 28M] [--num-procs 2,1]`. Writes
`results/pack_command.json` under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]


def parse_size(text: str) -> int:
    """`'28M'` -> 28_000_000 (suffixes k, M, B)."""
    scale = {"k": 10**3, "M": 10**6, "B": 10**9}
    return int(float(text[:-1]) * scale[text[-1]]) if text[-1] in scale else int(text)


def make_data(path: Path, num_tokens: int, seed: int = 0) -> dict:
    """Writes conversations of about `num_tokens` content tokens to `path` (JSONL), a conversation a line."""
    import collators

    tokenizer = collators.load_default_tokenizer()
    vocab = np.array(sorted(set(range(len(tokenizer))) - set(tokenizer.all_special_ids)))
    rng = np.random.default_rng(seed)

    def text(median: float, sigma: float) -> str:
        count = max(1, int(rng.lognormal(np.log(median), sigma)))
        return tokenizer.decode(rng.choice(vocab, count).tolist())

    written, conversations = 0, 0
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        while written < num_tokens:
            messages = [{"role": "system", "content": text(30, 0.5)}] if rng.random() < 0.5 else []
            for _ in range(int(rng.geometric(0.5))):
                messages += [{"role": "user", "content": text(40, 1.0)},
                             {"role": "assistant", "content": text(150, 0.8)}]
            written += sum(len(tokenizer(m["content"], add_special_tokens=False)["input_ids"]) for m in messages)
            conversations += 1
            handle.write(json.dumps({"messages": messages}) + "\n")
    os.replace(tmp, path)
    info = {"content_tokens": written, "num_conversations": conversations, "bytes": path.stat().st_size}
    path.with_suffix(".json").write_text(json.dumps(info))
    return info


# Runs a command and prints, last on stderr, the largest ru_maxrss of its processes (KiB): a process of its own per
# run, since RUSAGE_CHILDREN keeps the largest over every child a process ever waited for.
PEAK_RSS = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(done.returncode)")


def run(data: Path, num_proc: int, max_length: int) -> dict:
    """One `packed-ce pack` in a fresh `datasets` cache: its time, peak memory and statistics."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "HF_DATASETS_CACHE": str(Path(folder) / "cache"), "PYTHONPATH": str(ROOT)}
        command = [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "packed_ce_demo.cli", "pack", "--dataset",
                   str(data), "--output", str(Path(folder) / "packed"), "--max-length", str(max_length),
                   "--num-proc", str(num_proc), "--json"]
        start = time.perf_counter()
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"packed-ce pack exited with {done.returncode}: {done.stderr[-2000:]}")
    stats = json.loads(done.stdout)
    return {"num_proc": num_proc, "seconds": seconds, "peak_rss_gib": int(done.stderr.split()[-1]) / 2**20,
            "num_tokens": stats["num_tokens"], "num_conversations": stats["num_conversations"],
            "num_rows": stats["num_rows"], "efficiency": stats["efficiency"],
            "tokens_per_second": stats["num_tokens"] / seconds}


def _spin(count: int) -> int:
    total = 0
    for value in range(count):
        total += value * value
    return total


def parallel_speedup(count: int = 30_000_000) -> float:
    """How many cores two processes got just now: two copies of a pure-Python loop in two processes against one in
    one (2.0 on two free cores). On a machine shared with other work it tells what `--num-proc 2` could gain."""
    import multiprocessing

    start = time.perf_counter()
    _spin(count)
    alone = time.perf_counter() - start
    start = time.perf_counter()
    with multiprocessing.Pool(2) as pool:
        pool.map(_spin, [count, count])
    return 2 * alone / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="28M", help="content tokens to generate (default: %(default)s)")
    parser.add_argument("--num-procs", default="2,1", help="--num-proc of each run, in order (default: %(default)s)")
    parser.add_argument("--max-length", type=int, default=4096)
    parser.add_argument("--data-dir", type=Path, default=Path("/tmp/bench_pack_command"))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--note", default="", help="a remark stored with the results (e.g. other load)")
    args = parser.parse_args()

    args.data_dir.mkdir(parents=True, exist_ok=True)
    data = args.data_dir / f"chats_{args.tokens}.jsonl"
    if data.exists() and data.with_suffix(".json").exists():
        info = json.loads(data.with_suffix(".json").read_text())
    else:
        start = time.perf_counter()
        info = make_data(data, parse_size(args.tokens))
        print(f"generated {info['num_conversations']:,} conversations in {time.perf_counter() - start:.0f} s",
              flush=True)
    results = {
        "data": info,
        "max_length": args.max_length,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "note": args.note,
        "runs": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for num_proc in (int(n) for n in args.num_procs.split(",")):
        probe = parallel_speedup()
        result = {**run(data, num_proc, args.max_length), "parallel_speedup_before": probe}
        results["runs"].append(result)
        print(f"--num-proc {num_proc}: {result['seconds']:.0f} s, {result['num_tokens']:,} tokens "
              f"({result['tokens_per_second']:,.0f}/s), {result['num_rows']:,} rows, peak "
              f"{result['peak_rss_gib']:.2f} GiB (two processes got {probe:.2f} cores)", flush=True)
        (args.out / "pack_command.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
