"""The one harness of the benchmarks: inputs, timing, memory, ceilings, the run's header.

``bench_training.py`` times whole steps and uses the environment, summary and file helpers.

Timing follows the usual method for memory-bound kernels: CUDA events around every call, an
untimed setup before each call (the inputs reset the same way for every variant, the L2 cache
flushed, a head start for the host), many calls interleaved across the variants, the median
and the p20-p80 band. ``triton.testing.do_bench`` times the same way (its
``return_mode="median"`` exists from Triton 3.0 on) but has no hook to restore inputs that an
in-place kernel overwrites, hence this small timer. Off CUDA (the ``--smoke`` runs) the same
functions run with a host clock and report no memory: the numbers only show the code works.

Dimensions: N tokens, V vocabulary, S sequences.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Protocol

import torch

GiB = 2**30
MiB = 2**20
IGNORE_INDEX = -100
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Larger than the L2 of current GPUs (50 MB on H100, 60 MB on H200): writing it evicts what
# the previous call left there, so no call starts with its inputs in cache.
_FLUSH_BYTES = 256 * 2**20

# A device-side spin before every timed call (about 1 ms at H100 clocks). The host enqueues the
# whole call meanwhile, so the events measure device time and not Python launch overhead, as in
# a training step where the host runs ahead of the GPU. A call that syncs inside (validate=True)
# still pays its idle gap, as it does in training.
_HEAD_START_CYCLES = 2_000_000


def package_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def file_digest(*paths: Path) -> str:
    """First 12 hex digits of the sha256 of the files' contents, in the order given: names the
    source version a result belongs to."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(Path(path).read_bytes())
    return digest.hexdigest()[:12]


def package_digest(module) -> str:
    """:func:`file_digest` of every ``.py`` file of a package (sorted by path)."""
    return file_digest(*sorted(Path(module.__file__).parent.rglob("*.py")))


def environment(device: torch.device, distributions: tuple[str, ...]) -> dict:
    """Device and software the numbers were taken with."""
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "versions": {name: package_version(name) for name in distributions},
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            multiprocessors=props.multi_processor_count,
            memory_gib=round(props.total_memory / GiB, 1),
            l2_mib=round(getattr(props, "L2_cache_size", 0) / 2**20, 1),
            cuda=torch.version.cuda,
        )
    else:
        env["device_name"] = "cpu"
    return env


def device_slug(env: dict) -> str:
    """``'NVIDIA H100 80GB HBM3'`` -> ``'nvidia_h100_80gb_hbm3'``, for file names."""
    return re.sub(r"[^a-z0-9]+", "_", env["device_name"].lower()).strip("_")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@functools.cache
def _flush_buffer(device: torch.device) -> torch.Tensor:
    return torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=device)


def _before_call(setup: Callable[[], None] | None, device: torch.device) -> None:
    if setup is not None:
        setup()
    if device.type == "cuda":
        _flush_buffer(device).zero_()
        torch.cuda._sleep(_HEAD_START_CYCLES)


def _time_one(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(device ms, host ms) of one call; the host time is how long enqueuing it took."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        elapsed = (time.perf_counter() - start) * 1e3
        return elapsed, elapsed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host_start = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - host_start) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host_ms


def error_text(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line[:300]}"


def warm_up(
    fn: Callable[[], object],
    *,
    setup: Callable[[], None] | None,
    calls: int,
    device: torch.device,
) -> None:
    """Untimed calls: compilation, autotuning and allocator growth stay out of the numbers."""
    for _ in range(calls):
        _before_call(setup, device)
        fn()
    synchronize(device)


def summarize(samples: list[float], unit: str = "ms") -> dict:
    """Median, p20 and p80 of ``samples``, keyed ``median_<unit>``, ``p20_<unit>``, ..."""
    # "inclusive": deciles within the samples' range (the default extrapolates at small counts)
    deciles = (
        statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1 else samples * 9
    )
    return {
        f"median_{unit}": statistics.median(samples),
        f"p20_{unit}": deciles[1],
        f"p80_{unit}": deciles[7],
        "reps": len(samples),
    }


def time_calls(
    fns: dict[str, Callable[[], object]],
    *,
    setup: Callable[[], None] | None,
    reps: int,
    device: torch.device,
) -> dict[str, dict]:
    """Times every function ``reps`` times, interleaved, after :func:`warm_up`.

    Rep ``i`` calls every function once, so a drift in clocks or temperature during the run
    affects all of them alike, and ``samples_ms[i]`` of two functions form a fair pair. The
    order rotates by one function per rep, so every function takes every place in the order
    about equally often and none gains from its neighbours (at its power limit a GPU may run a
    call after a light one at higher clocks; benchmarks/NOTES.md tells the gap that prompted it).

    Returns:
        ``{name: summary}`` with :func:`summarize`'s keys plus ``samples_ms`` and ``host_ms``
        (median host time to enqueue one call), or ``{name: {"error": text}}`` for a function
        that raised (it is not called again).
    """
    samples = {name: [] for name in fns}
    host = {name: [] for name in fns}
    errors: dict[str, str] = {}
    names = list(fns)
    for rep in range(reps):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            fn = fns[name]
            if name in errors:
                continue
            _before_call(setup, device)
            try:
                device_ms, host_ms = _time_one(fn, device)
            except Exception as error:  # an OOM at one size must not end the whole run
                errors[name] = error_text(error)
                continue
            samples[name].append(device_ms)
            host[name].append(host_ms)
    results = {}
    for name in fns:
        if name in errors:
            results[name] = {"error": errors[name]}
        else:
            results[name] = summarize(samples[name]) | {
                "samples_ms": samples[name],
                "host_ms": statistics.median(host[name]),
            }
    return results


def extra_memory_bytes(
    fn: Callable[[], object],
    *,
    setup: Callable[[], None] | None,
    device: torch.device,
) -> tuple[int | None, object]:
    """Peak bytes allocated during one call over what was allocated just before it.

    What was resident before (the inputs, buffers of other benchmarks) does not count, so this
    is the memory the call itself needs, including what it leaves behind (``logits.grad``).

    Returns:
        ``(bytes, fn's return value)``; bytes is None off CUDA.
    """
    _before_call(setup, device)
    if device.type != "cuda":
        return None, fn()
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    value = fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before, value


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> dict:
    """Device-to-device copy rate, counting the bytes read plus the bytes written."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    warm_up(lambda: dst.copy_(src), setup=None, calls=2, device=device)
    timing = time_calls({"copy": lambda: dst.copy_(src)}, setup=None, reps=reps, device=device)
    ms = timing["copy"]["median_ms"]
    moved = 2 * src.numel() * src.element_size()
    return {"bytes_moved": moved, "median_ms": ms, "gbps": moved / ms / 1e6}


def matmul_tflops(device: torch.device, n: int, reps: int) -> dict:
    """bf16 ``n x n x n`` matrix product rate on random data (zeros run faster than real data)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    warm_up(lambda: torch.matmul(a, b, out=c), setup=None, calls=2, device=device)
    timing = time_calls(
        {"matmul": lambda: torch.matmul(a, b, out=c)}, setup=None, reps=reps, device=device
    )
    ms = timing["matmul"]["median_ms"]
    return {"n": n, "dtype": "bfloat16", "median_ms": ms, "tflops": 2 * n**3 / ms / 1e9}


def write_json(path: Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``|value - reference| / |reference|`` in the 2-norm, computed in float64."""
    return ((value.double() - reference.double()).norm() / reference.double().norm()).item()


# --------------------------------------------------------------------------------------------
# Inputs: a packed SFT batch


def random_packing(n: int, generator: torch.Generator) -> torch.Tensor:
    """``cu_seqlens`` (S+1,) int32 of 8 to 20 sequences of random lengths filling ``n`` tokens."""
    sequences = int(torch.randint(8, 21, (), generator=generator))
    cuts = torch.randperm(n - 1, generator=generator)[: sequences - 1] + 1
    bounds = torch.cat([torch.tensor([0]), cuts.sort().values, torch.tensor([n])])
    return bounds.to(torch.int32)


def sft_labels(vocab: int, cu_seqlens: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(N,) int64 random labels with each sequence's prompt (10-30% of it, at least its first
    token) ignored, as a supervised fine-tuning collator leaves them."""
    n = int(cu_seqlens[-1])
    labels = torch.randint(0, vocab, (n,), generator=generator)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        prompt = float(torch.empty(()).uniform_(0.1, 0.3, generator=generator))
        labels[start : start + max(1, int(prompt * (end - start)))] = IGNORE_INDEX
    return labels


def shifted_targets(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(N,) target of token t = label of t+1 within its sequence; the last token of each has
    none. This is what the peers, which average per token and do not shift, are given."""
    targets = torch.roll(labels, -1)
    targets[cu_seqlens[1:].long() - 1] = IGNORE_INDEX
    return targets


def packed_batch(n: int, vocab: int, device: torch.device) -> dict[str, torch.Tensor]:
    """The labels of one packed batch in both conventions, the same for a given (N, V).

    Returns ``labels`` (N,) int64 aligned with the inputs (``shift=True``), ``cu_seqlens``
    (S+1,) int32, and ``targets`` (N,) int64, the labels after the shift.
    """
    generator = torch.Generator().manual_seed(n * 1_000_003 + vocab)
    cu_seqlens = random_packing(n, generator)
    labels = sft_labels(vocab, cu_seqlens, generator)
    return {
        "labels": labels.to(device),
        "cu_seqlens": cu_seqlens.to(device),
        "targets": shifted_targets(labels, cu_seqlens).to(device),
    }


def packed_keywords(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> dict:
    """The keywords every packed_ce call of the kernel benchmarks shares: boundaries, labels
    aligned with the inputs (``shift=True``), and the backend: none on CUDA (the default,
    ``"auto"``), ``"triton"`` off CUDA, where "auto" would take the PyTorch reference and the
    ``--smoke`` run is there to check the (interpreted) kernel path."""
    backend = {} if labels.is_cuda else {"backend": "triton"}
    return {"cu_seqlens": cu_seqlens, "shift": True, **backend}


# --------------------------------------------------------------------------------------------
# Measuring variants of one step


class Problem(Protocol):
    def reset(self) -> None:
        """Untimed, before every call: the same state for every variant (fresh inputs where a
        variant may overwrite them, no gradients left from the last call)."""

    def describe(self) -> dict:
        """The shape, for the result rows."""


@dataclass(frozen=True)
class Variant:
    """One implementation of the step: ``loss(problem)`` is called, then its backward."""

    key: str  # stable name in the JSON and the tables
    label: str
    loss: Callable | None  # None: skipped, for the reason below
    skipped: str | None = None
    # entered around each step: the launch-config override of the --configs table
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    # (N, V) buffers it holds at its peak, per element, for the memory skip rule
    logits_bytes_per_element: int = 0


def make_step(variant: Variant, problem: Problem) -> Callable[[], torch.Tensor]:
    """Forward and ``loss.backward()``: what one training step pays for the loss."""

    def step() -> torch.Tensor:
        with variant.context():
            loss = variant.loss(problem)
            loss.backward()
        return loss.detach()

    return step


def release_memory(problem: Problem, device: torch.device) -> None:
    problem.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    problem: Problem,
    variants: list[Variant],
    *,
    reps: int,
    warmup: int,
    device: torch.device,
    too_big: Callable[[Variant], str | None] = lambda variant: None,
    memory: bool = True,
) -> list[dict]:
    """One row per variant, all timed in the same run, interleaved rep by rep.

    A variant is warmed up (untimed) first; one that is skipped (``variant.loss is None``, or
    ``too_big(variant)`` gives a reason) or raises keeps a row with its status and reason, so a
    peer that cannot run at a shape is visible rather than missing.

    Returns:
        rows with ``key``, ``label``, the problem's ``describe()``, ``status`` ("ok", "skipped",
        "error"), and for "ok" rows :func:`time_calls`'s fields, ``loss`` and (on CUDA)
        ``extra_bytes``: the peak over what was allocated before the call.
    """
    shape = problem.describe()
    rows = {v.key: {"key": v.key, "label": v.label, **shape} for v in variants}
    steps = {}
    for variant in variants:
        row = rows[variant.key]
        reason = variant.skipped if variant.loss is None else too_big(variant)
        if reason is not None:
            row.update(status="skipped", reason=reason)
            continue
        step = make_step(variant, problem)
        try:
            warm_up(step, setup=problem.reset, calls=warmup, device=device)
        except Exception as error:  # a peer that fails (OOM, unsupported shape) stays a row
            row.update(status="error", reason=error_text(error))
            release_memory(problem, device)
            continue
        steps[variant.key] = step
    release_memory(problem, device)
    for key, timing in time_calls(steps, setup=problem.reset, reps=reps, device=device).items():
        row = rows[key]
        if "error" in timing:
            row.update(status="error", reason=timing["error"])
            continue
        row.update(status="ok", **timing)
        if memory:
            try:
                extra, loss = extra_memory_bytes(steps[key], setup=problem.reset, device=device)
            except Exception as error:
                row.update(memory_error=error_text(error))
            else:
                row.update(loss=float(loss))
                if extra is not None:
                    row.update(extra_bytes=extra)
        release_memory(problem, device)
    return list(rows.values())


def checked_rows(
    problem: Problem,
    check: Callable[[Problem], dict],
    variants: list[Variant],
    measure_rows: Callable[..., list[dict]],
    *,
    reps: int,
    warmup: int,
    device: torch.device,
) -> tuple[dict, list[dict]]:
    """The headline: ``check(problem)`` first (untimed: a variant that computes the wrong thing
    must not be reported as a fast one), then ``measure_rows`` (:func:`measure` with the
    script's own columns) of every variant."""
    checked = check(problem)
    release_memory(problem, device)
    return checked, measure_rows(problem, variants, reps=reps, warmup=warmup, device=device)


# --------------------------------------------------------------------------------------------
# A benchmark run: command line, device, result header


def smoke_requested() -> bool:
    """``--smoke`` on the command line. The Triton interpreter is chosen when the kernels are
    defined, that is when packed_ce is imported, so a script calls this before that import."""
    if "--smoke" in sys.argv:
        os.environ["TRITON_INTERPRET"] = "1"
        return True
    return False


def argument_parser(description: str, modes: dict[str, str]) -> argparse.ArgumentParser:
    """``--smoke``, ``--out`` and the script's other mutually exclusive ``modes`` (flag: help)."""
    # no abbreviations: "--smoke" is looked for in sys.argv before argparse runs
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    group = parser.add_mutually_exclusive_group()
    for mode, text in modes.items():
        group.add_argument(f"--{mode}", action="store_true", help=text)
    group.add_argument(
        "--smoke", action="store_true", help="tiny sizes on CPU through the Triton interpreter"
    )
    parser.add_argument("--out", type=Path, help=f"output folder (default {RESULTS_DIR})")
    return parser


def begin_run(
    benchmark: str, args: argparse.Namespace, modes: tuple[str, ...], distributions: tuple
) -> tuple[str, torch.device, Path, dict]:
    """The mode, the device, the JSON path and the result's header of one run.

    Off ``--smoke`` the run needs CUDA and says so in one line. Smoke numbers mean nothing: they
    go to a temporary folder unless ``--out`` is given.
    """
    import packed_ce

    mode = next((m for m in (*modes, "smoke") if getattr(args, m)), "full")
    device = torch.device("cpu" if mode == "smoke" else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{benchmark}: no CUDA device: run on a GPU machine, or --smoke here")
    out = args.out or (
        Path(tempfile.gettempdir()) / "packed_ce_bench" if mode == "smoke" else RESULTS_DIR
    )
    torch.manual_seed(0)
    env = environment(device, distributions) | {"packed_ce": packed_ce.__version__}
    suffix = "" if mode == "full" else f"_{mode}"
    header = {
        "benchmark": benchmark,
        "mode": mode,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "environment": env,
    }
    return mode, device, out / f"{benchmark}{suffix}_{device_slug(env)}.json", header
