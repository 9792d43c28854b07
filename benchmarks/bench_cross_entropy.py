"""Forward+backward of ``packed_ce.cross_entropy`` against eager PyTorch, torch.compile and
Liger-Kernel, with the device's two ceilings measured in the same run.

On a GPU machine, from the repository root::

    PYTHONPATH=. python benchmarks/bench_cross_entropy.py            # ceilings, headline, sweep
    PYTHONPATH=. python benchmarks/bench_cross_entropy.py --quick    # a smaller sweep
    PYTHONPATH=. python benchmarks/bench_cross_entropy.py --configs  # launch-config table
    PYTHONPATH=. python benchmarks/bench_cross_entropy.py --defaults # default vs validate=False
    PYTHONPATH=. python benchmarks/bench_cross_entropy.py --smoke    # CPU + Triton interpreter

Cross entropy over a large vocabulary is memory-bound: the least traffic is reading the logits
once and writing their gradient once, ``2 * N * V * itemsize`` bytes (4*N*V in bf16). Every time
is set against that floor at the device-to-device copy rate measured in the same run.

What is timed is one training step's worth of loss work: the call, then ``loss.backward()``
into a leaf ``logits`` whose ``.grad`` was reset. Before each call, for every variant alike, the
logits are redrawn from a normal distribution (untimed): in-place kernels
(``inplace_backward=True``, Liger-Kernel) overwrite them, and random data, unlike zeros, runs at
the speed real data does. ``harness.py`` says how each call is timed.

packed_ce runs with the defaults a user calls (``validate=True``: values checked on the device,
no host sync) and, marked, with ``validate=False`` (values unchecked); it gets the aligned
labels with ``shift=True`` and ``cu_seqlens`` and does the shift and the per-sequence weights
itself. The peers get the labels already shifted (the same target rows) and average per token.
cut-cross-entropy has no logits-input loss (it fuses the classifier matmul with the loss), so
it is measured by ``bench_fused_linear.py``, not here.

Writes ``<out>/cross_entropy[_quick|_configs|_smoke]_<device>.json`` (and a ``.png`` plot for
runs with a headline) and prints the tables, the headline last.

Dimensions: N tokens, V vocabulary, S sequences.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import harness

harness.smoke_requested()  # before packed_ce is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import make_tables  # noqa: E402
import packed_ce  # noqa: E402
from harness import GiB, Variant  # noqa: E402
from packed_ce.kernels import cross_entropy as ce_kernels  # noqa: E402

DISTRIBUTIONS = ("torch", "triton", "transformers", "liger-kernel", "cut-cross-entropy", "numpy")


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of one run: the GPU plans below, or the tiny CPU one."""

    headline: tuple[int, int, torch.dtype]  # (N, V, dtype)
    vocabs: tuple[int, ...]
    tokens: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    max_pair_bytes: int  # combos whose logits + gradient exceed this are skipped
    seconds: float  # sweep combos not started this long after the run began are skipped
    copy_bytes: int
    matmul_n: int
    headline_reps: int
    warmup: int
    configs: tuple[tuple[int, int], ...]  # (BLOCK_V, num_warps) for --configs


def _config_grid() -> tuple[tuple[int, int], ...]:
    # Blocks of powers of two; num_warps such that each thread holds 4 to 64 elements of a
    # block: fewer leave loads narrower than 16 bytes, more spill registers.
    return tuple(
        (block, warps)
        for block in (2048, 4096, 8192, 16384, 32768)
        for warps in (4, 8, 16, 32)
        if 4 <= block // (32 * warps) <= 64
    )


GPU_PLAN = Plan(
    headline=(8192, 128256, torch.bfloat16),
    vocabs=(32000, 128256, 151936, 262144),  # Llama-2, Llama-3, Qwen-2, Gemma-3
    tokens=(2048, 8192, 32768),
    dtypes=(torch.bfloat16, torch.float32),
    max_pair_bytes=60 * GiB,
    seconds=190.0,  # the whole run then ends near 3.5 minutes on an H100 at worst
    copy_bytes=2 * GiB,
    matmul_n=8192,
    headline_reps=40,
    warmup=3,
    configs=_config_grid(),
)
QUICK_PLAN = dataclasses.replace(GPU_PLAN, tokens=(8192,), dtypes=(torch.bfloat16,), seconds=120.0)
# What the default path costs over the sync-free one, (N, V) in bf16: the shapes at which a
# host sync of the validation once made the defaults slower than the peers.
DEFAULTS_SHAPES = ((8192, 32000), (8192, 128256), (8192, 151936), (4096, 262144))
# Tiny sizes for the interpreter: V not a power of two (a masked tail), and one combo over
# max_pair_bytes so the skip path runs too.
SMOKE_PLAN = Plan(
    headline=(48, 1500, torch.bfloat16),
    vocabs=(300, 1500),
    tokens=(32, 48),
    dtypes=(torch.bfloat16, torch.float32),
    max_pair_bytes=2 * 48 * 1500 * 4 - 1,
    seconds=600.0,
    copy_bytes=2**23,
    matmul_n=256,
    headline_reps=3,
    warmup=1,
    configs=((512, 1), (1024, 1)),
)


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Problem:
    """One packed batch: logits and the labels in both conventions."""

    logits: torch.Tensor  # (N, V) leaf, requires grad; redrawn before every call
    labels: torch.Tensor  # (N,) int64, aligned with the inputs (shift=True convention)
    cu_seqlens: torch.Tensor  # (S+1,) int32
    targets: torch.Tensor  # (N,) int64, labels after the shift: what the peers are given

    @property
    def floor_bytes(self) -> int:
        # read the logits once, write the gradient once
        return 2 * self.logits.numel() * self.logits.element_size()

    def reset(self) -> None:
        """Fresh random logits and no gradient (untimed, before every call of every variant)."""
        self.logits.grad = None
        with torch.no_grad():
            self.logits.normal_()

    def describe(self) -> dict:
        n, vocab = self.logits.shape
        return {
            "n": n,
            "vocab": vocab,
            "dtype": str(self.logits.dtype).removeprefix("torch."),
            "sequences": self.cu_seqlens.numel() - 1,
            "ignored_fraction": round(
                (self.targets == harness.IGNORE_INDEX).float().mean().item(), 3
            ),
            "floor_bytes": self.floor_bytes,
            "n_times_v_over_2_31": n * vocab > 2**31,
        }


def make_problem(n: int, vocab: int, dtype: torch.dtype, device: torch.device) -> Problem:
    logits = torch.empty(n, vocab, dtype=dtype, device=device).normal_().requires_grad_()
    return Problem(logits=logits, **harness.packed_batch(n, vocab, device))


# --------------------------------------------------------------------------------------------
# What is timed


def packed_ce_loss(*, is_packed: bool, **options):
    """packed_ce with its defaults unless ``options`` say otherwise."""

    def loss(p: Problem) -> torch.Tensor:
        keywords = harness.packed_keywords(p.labels, p.cu_seqlens)
        return packed_ce.cross_entropy(
            p.logits, p.labels, is_packed=is_packed, **keywords, **options
        )

    return loss


def float_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # The common training recipe: upcast, then PyTorch's log_softmax + nll.
    return F.cross_entropy(logits.float(), targets)


def load_liger():
    """Liger-Kernel's cross entropy as ``f(logits, targets) -> loss``, or why it cannot run.

    Its Triton kernels run through the interpreter too, so --smoke checks this path where the
    package is installed.
    """
    try:
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction
    except Exception as error:
        return None, harness.error_text(error)

    # Newer versions take class weights third, with no default; older ones ignore_index.
    parameters = inspect.signature(LigerCrossEntropyFunction.forward).parameters
    weight = (None,) if "weight" in parameters else ()

    def loss(logits, targets):
        # Defaults otherwise: ignore_index=-100, reduction "mean". It writes the gradient into
        # the logits during forward; versions return the loss alone or first in a tuple.
        out = LigerCrossEntropyFunction.apply(logits, targets, *weight)
        return out[0] if isinstance(out, tuple) else out

    return loss, None


def peer_variants(device: torch.device, compile_dynamic: bool) -> list[Variant]:
    """torch.compile and Liger-Kernel; a peer that cannot run is kept as a skipped row."""
    # Inductor needs a GPU or a C++ toolchain; on CPU the traced graph runs eagerly, which is
    # enough to check the code path.
    backend = "inductor" if device.type == "cuda" else "eager"
    compiled = torch.compile(float_cross_entropy, dynamic=compile_dynamic, backend=backend)
    liger, liger_error = load_liger()
    compile_label = "torch.compile F.cross_entropy(x.float())"
    return [
        Variant(
            "compile_fp32",
            compile_label + (" (dynamic shapes)" if compile_dynamic else ""),
            lambda p: compiled(p.logits, p.targets),
        ),
        Variant(
            "liger",
            "Liger-Kernel cross entropy",
            None if liger is None else (lambda p: liger(p.logits, p.targets)),
            skipped=liger_error,
        ),
    ]


def headline_variants(device: torch.device) -> list[Variant]:
    return [
        Variant(
            "ours_packed", "packed_ce is_packed=True (defaults)", packed_ce_loss(is_packed=True)
        ),
        Variant(
            "ours_packed_no_sync",
            "packed_ce is_packed=True, validate=False (values unchecked)",
            packed_ce_loss(is_packed=True, validate=False),
        ),
        Variant(
            "ours_packed_inplace",
            "packed_ce is_packed=True, validate=False, inplace_backward",
            packed_ce_loss(is_packed=True, validate=False, inplace_backward=True),
        ),
        Variant(
            "ours_unpacked",
            "packed_ce is_packed=False, validate=False",
            packed_ce_loss(is_packed=False, validate=False),
        ),
        Variant(
            "ours_unpacked_inplace",
            "packed_ce is_packed=False, validate=False, inplace_backward",
            packed_ce_loss(is_packed=False, validate=False, inplace_backward=True),
        ),
        Variant(
            "eager_fp32",
            "eager F.cross_entropy(x.float())",
            lambda p: float_cross_entropy(p.logits, p.targets),
        ),
        Variant(
            "eager_native",
            "eager F.cross_entropy(x), input dtype",
            lambda p: F.cross_entropy(p.logits, p.targets),
        ),
        *peer_variants(device, compile_dynamic=False),
        Variant(
            "cut_cross_entropy",
            "cut-cross-entropy",
            None,
            skipped="fuses the classifier matmul with the loss, no logits input: "
            "see bench_fused_linear.py",
        ),
    ]


def sweep_variants(device: torch.device) -> list[Variant]:
    # Dynamic shapes: one compilation serves the whole grid; static shapes would recompile for
    # each of the 24 shapes, minutes of the run. The headline has the static-shape number.
    return [
        Variant("ours_packed", "packed_ce is_packed=True", packed_ce_loss(is_packed=True)),
        Variant(
            "ours_unpacked",
            "packed_ce is_packed=False, validate=False",
            packed_ce_loss(is_packed=False, validate=False),
        ),
        *peer_variants(device, compile_dynamic=True),
    ]


@contextlib.contextmanager
def forced_launch_config(block: int, warps: int):
    """packed_ce's kernel launches with ``(BLOCK_V, num_warps)`` while inside (a private
    function of the kernel module, replaced in this process only); restored on exit."""
    original = ce_kernels._launch_config
    ce_kernels._launch_config = lambda vocab_size, device: (block, warps)
    try:
        yield
    finally:
        ce_kernels._launch_config = original


def config_variants(vocab: int, device: torch.device, grid) -> list[Variant]:
    """packed_ce is_packed=True, validate=False under each (BLOCK_V, num_warps) of ``grid``,
    and once as it launches now (the same numbers as its twin in the grid)."""
    loss = packed_ce_loss(is_packed=True, validate=False)
    forced = [
        Variant(
            f"BLOCK_V{block}_num_warps{warps}",
            f"BLOCK_V={block}, num_warps={warps}",
            loss,
            context=functools.partial(forced_launch_config, block, warps),
        )
        for block, warps in grid
    ]
    block, warps = ce_kernels._launch_config(vocab, device)
    return forced + [
        Variant("current", f"as launched now: BLOCK_V={block}, num_warps={warps}", loss)
    ]


# --------------------------------------------------------------------------------------------
# Measuring


def measure(
    problem: Problem, variants: list[Variant], *, copy_gbps: float, **options
) -> list[dict]:
    """:func:`harness.measure`, each row set against the floor at the copy rate."""
    grad_bytes = problem.logits.numel() * problem.logits.element_size()
    rows = harness.measure(problem, variants, **options)
    for row in rows:
        if row["status"] == "ok":
            gbps = problem.floor_bytes / row["median_ms"] / 1e6
            row.update(gbps=gbps, fraction_of_copy=gbps / copy_gbps)
        if "extra_bytes" in row:
            row["extra_grad_buffers"] = row["extra_bytes"] / grad_bytes
    return rows


def check_headline(problem: Problem) -> dict:
    """packed_ce's loss and gradient against PyTorch in float32 on the headline inputs.

    Untimed; a kernel that computes the wrong thing must not be reported as a fast one. The
    unpacked loss is compared with ``F.cross_entropy``, the packed one with packed_ce's own
    PyTorch reference.
    """
    grad_tolerance = {torch.float32: 1e-4}.get(problem.logits.dtype, 1e-2)  # bf16/fp16 output
    problem.reset()
    exact = problem.logits.detach().float().requires_grad_()
    references = {
        "unpacked": lambda: F.cross_entropy(exact, problem.targets),
        "packed": lambda: packed_ce.cross_entropy(
            exact,
            problem.labels,
            cu_seqlens=problem.cu_seqlens,
            is_packed=True,
            shift=True,
            backend="torch",
        ),
    }
    checks = {}
    for name, reference in references.items():
        ref_loss = reference()
        (ref_grad,) = torch.autograd.grad(ref_loss, exact)
        loss = packed_ce_loss(is_packed=name == "packed")(problem)
        (grad,) = torch.autograd.grad(loss, problem.logits)
        loss_error = harness.relative_error(loss.detach(), ref_loss.detach())
        grad_error = harness.relative_error(grad, ref_grad)
        checks[name] = {
            "loss_rel_error": loss_error,
            "grad_rel_error": grad_error,
            "passed": loss_error < 1e-4 and grad_error < grad_tolerance,
        }
    return checks


def overhead(rows: list[dict], slower: str, faster: str) -> dict | None:
    """(time of ``slower``) / (time of ``faster``) - 1, from the medians and the per-rep pairs."""
    by_key = {row["key"]: row for row in rows}
    a, b = by_key.get(slower, {}), by_key.get(faster, {})
    if a.get("status") != "ok" or b.get("status") != "ok":
        return None
    pairs = harness.summarize(
        [x / y - 1 for x, y in zip(a["samples_ms"], b["samples_ms"])], unit="ratio"
    )
    return {
        "overhead": a["median_ms"] / b["median_ms"] - 1,
        "pair_median": pairs["median_ratio"],
        "pair_p20": pairs["p20_ratio"],
        "pair_p80": pairs["p80_ratio"],
    }


def run_ceilings(plan: Plan, device: torch.device) -> dict:
    print("ceilings ...", flush=True)
    return {
        "copy": harness.copy_bandwidth(device, plan.copy_bytes, reps=30),
        "matmul": harness.matmul_tflops(device, plan.matmul_n, reps=30),
    }


def run_headline(plan: Plan, device: torch.device, copy_gbps: float) -> dict:
    n, vocab, dtype = plan.headline
    print(f"headline N={n} V={vocab} {dtype} ...", flush=True)
    problem = make_problem(n, vocab, dtype, device)
    checks, rows = harness.checked_rows(
        problem,
        check_headline,
        headline_variants(device),
        functools.partial(measure, copy_gbps=copy_gbps),
        reps=plan.headline_reps,
        warmup=plan.warmup,
        device=device,
    )
    return {
        "problem": problem.describe(),
        "floor_ms": problem.floor_bytes / copy_gbps / 1e6,
        "checks": checks,
        "rows": rows,
        "validate_overhead": overhead(rows, "ours_packed", "ours_packed_no_sync"),
        "packed_overhead": overhead(rows, "ours_packed_no_sync", "ours_unpacked"),
        "packed_overhead_inplace": overhead(rows, "ours_packed_inplace", "ours_unpacked_inplace"),
    }


def run_defaults(plan: Plan, device: torch.device, copy_gbps: float) -> list[dict]:
    """packed_ce with its defaults against ``validate=False`` (and Liger-Kernel, a peer with no
    checks on the host), per shape of :data:`DEFAULTS_SHAPES`: the price of the value checks."""
    variants = headline_variants(device)[:2] + [
        v for v in peer_variants(device, compile_dynamic=False) if v.key == "liger"
    ]
    shapes = [(48, 1500)] if device.type == "cpu" else DEFAULTS_SHAPES
    results = []
    for n, vocab in shapes:
        print(f"defaults N={n} V={vocab} ...", flush=True)
        problem = make_problem(n, vocab, torch.bfloat16, device)
        rows = measure(
            problem, variants, copy_gbps=copy_gbps, reps=plan.headline_reps,
            warmup=plan.warmup, device=device, memory=False,
        )
        results.append(
            {
                "problem": problem.describe(),
                "floor_ms": problem.floor_bytes / copy_gbps / 1e6,
                "rows": rows,
                "validate_overhead": overhead(rows, "ours_packed", "ours_packed_no_sync"),
            }
        )
        harness.release_memory(problem, device)
    return results


def sweep_reps(floor_bytes: int) -> int:
    # Each call of the biggest shapes takes tens of ms; their medians settle with fewer reps.
    return 20 if floor_bytes <= 8 * 10**9 else 10


def run_sweep(plan: Plan, device: torch.device, copy_gbps: float, deadline: float) -> dict:
    """Every (dtype, N, V) of the plan: dtype by dtype, small to large, so a run short of time
    loses the largest fp32 shapes first."""
    torch._dynamo.reset()  # the sweep's dynamic-shape compilation must not reuse the headline's
    variants = sweep_variants(device)
    rows, skipped = [], []
    for dtype in plan.dtypes:
        for n, vocab in sorted(
            ((n, vocab) for n in plan.tokens for vocab in plan.vocabs), key=lambda c: c[0] * c[1]
        ):
            pair_bytes = 2 * n * vocab * dtype.itemsize
            shape = {"n": n, "vocab": vocab, "dtype": str(dtype).removeprefix("torch.")}
            if pair_bytes > plan.max_pair_bytes:
                limit = plan.max_pair_bytes / GiB
                reason = f"logits + grad {pair_bytes / GiB:.3g} GiB > {limit:.3g} GiB"
                skipped.append(shape | {"reason": reason})
                continue
            if time.monotonic() > deadline:
                skipped.append(shape | {"reason": f"run past {plan.seconds:.0f} s"})
                continue
            print(f"sweep N={n} V={vocab} {dtype} ...", flush=True)
            problem = make_problem(n, vocab, dtype, device)
            rows += measure(
                problem,
                variants,
                reps=sweep_reps(problem.floor_bytes),
                warmup=min(plan.warmup, 2),
                device=device,
                copy_gbps=copy_gbps,
            )
            harness.release_memory(problem, device)
            del problem
    return {"rows": rows, "skipped": skipped}


def run_configs(plan: Plan, device: torch.device, copy_gbps: float, grid) -> dict:
    """packed_ce at the headline shape under each (BLOCK_V, num_warps) of ``grid``."""
    n, vocab, dtype = plan.headline
    print(f"configs at N={n} V={vocab} {dtype} ...", flush=True)
    problem = make_problem(n, vocab, dtype, device)
    rows = measure(
        problem,
        config_variants(vocab, device, grid),
        reps=plan.headline_reps,
        warmup=plan.warmup,
        device=device,
        copy_gbps=copy_gbps,
        memory=False,
    )
    return {"problem": problem.describe(), "rows": rows}


# --------------------------------------------------------------------------------------------
# Command line


def parse_config(text: str) -> tuple[int, int]:
    block, warps = text.lower().split("x")
    return int(block), int(warps)


MODES = {
    "quick": "a smaller sweep (N=8192, bf16)",
    "configs": "only the ceilings and the launch-config table",
    "defaults": "only the ceilings and the defaults against validate=False at four shapes",
}


def main() -> int:
    """Runs the plan of the chosen mode; returns 1 if packed_ce failed its correctness check."""
    parser = harness.argument_parser(__doc__.split("\n\n")[0], MODES)
    parser.add_argument(
        "--config",
        action="append",
        type=parse_config,
        metavar="BLOCKxWARPS",
        help="with --configs: BLOCK_V and num_warps to time instead of the default grid, "
        "e.g. 4096x8; repeatable",
    )
    args = parser.parse_args()
    started = time.monotonic()
    mode, device, json_path, result = harness.begin_run(
        "cross_entropy", args, tuple(MODES), DISTRIBUTIONS
    )
    plans = {"full": GPU_PLAN, "quick": QUICK_PLAN, "configs": GPU_PLAN, "defaults": GPU_PLAN}
    plan = plans.get(mode, SMOKE_PLAN)
    result["kernel_sha256"] = harness.file_digest(Path(ce_kernels.__file__))
    result["ceilings"] = run_ceilings(plan, device)
    copy_gbps = result["ceilings"]["copy"]["gbps"]
    harness.write_json(json_path, result)  # saved after every section: a timeout keeps the rest

    if mode == "configs":
        result["configs"] = run_configs(plan, device, copy_gbps, args.config or plan.configs)
        harness.write_json(json_path, result)
    elif mode == "defaults":
        result["defaults"] = run_defaults(plan, device, copy_gbps)
        harness.write_json(json_path, result)
    else:
        result["headline"] = run_headline(plan, device, copy_gbps)
        harness.write_json(json_path, result)
        result["sweep"] = run_sweep(plan, device, copy_gbps, deadline=started + plan.seconds)
        if mode == "smoke":
            result["configs"] = run_configs(plan, device, copy_gbps, plan.configs)
            result["defaults"] = run_defaults(plan, device, copy_gbps)
        harness.write_json(json_path, result)
        try:
            import plot

            result["plot"] = str(plot.plot_cross_entropy(result, json_path.with_suffix(".png")))
        except Exception as error:  # the numbers matter more than the picture
            result["plot"] = f"failed: {harness.error_text(error)}"
        harness.write_json(json_path, result)

    print(f"\nwrote {json_path}" + (f" and {result['plot']}" if "plot" in result else ""))
    print(make_tables.defaults_report(result) if mode == "defaults" else
          make_tables.cross_entropy_report(result))
    if mode == "smoke":
        print(make_tables.defaults_report(result))
    checks = result.get("headline", {}).get("checks", {}).values()
    return 0 if all(check["passed"] for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
