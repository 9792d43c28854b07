"""Helpers shared by the benchmark scripts: environment, ceilings, timing, memory, JSON.

Timing follows the usual method for memory-bound kernels: CUDA events around every call, an
untimed setup before each call (fresh inputs, the L2 cache flushed, a head start for the host),
many calls, the median. ``triton.testing.do_bench`` times the same way (its
``return_mode="median"`` exists from Triton 3.0 on) but has no hook to restore inputs that an
in-place kernel overwrites, hence this small timer. Off CUDA (the ``--smoke`` runs) the same
functions run with a host clock and report no memory: the numbers only show the code works.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

GiB = 2**30

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


def file_digest(path: Path) -> str:
    """First 12 hex digits of the file's sha256: names the kernel version a result belongs to."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:12]


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


def summarize(samples_ms: list[float]) -> dict:
    # "inclusive": deciles within the samples' range (the default extrapolates at small counts)
    deciles = (
        statistics.quantiles(samples_ms, n=10, method="inclusive")
        if len(samples_ms) > 1
        else samples_ms * 9
    )
    return {
        "median_ms": statistics.median(samples_ms),
        "p20_ms": deciles[1],
        "p80_ms": deciles[7],
        "reps": len(samples_ms),
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
    affects all of them alike, and ``samples_ms[i]`` of two functions form a fair pair.

    Returns:
        ``{name: summary}`` with :func:`summarize`'s keys plus ``samples_ms`` and ``host_ms``
        (median host time to enqueue one call), or ``{name: {"error": text}}`` for a function
        that raised (it is not called again).
    """
    samples = {name: [] for name in fns}
    host = {name: [] for name in fns}
    errors: dict[str, str] = {}
    for _ in range(reps):
        for name, fn in fns.items():
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
