"""Forward+backward of the LM head and its loss: ``packed_ce.fused_linear_cross_entropy`` against
torch.compile, Liger-Kernel and cut-cross-entropy, with the device's matmul rate measured in the
same run.

On a GPU machine, from the repository root::

    PYTHONPATH=. python benchmarks/bench_fused_linear.py           # headline and sweep
    PYTHONPATH=. python benchmarks/bench_fused_linear.py --quick   # a smaller sweep
    PYTHONPATH=. python benchmarks/bench_fused_linear.py --smoke   # CPU + Triton interpreter

The work is three GEMMs of ``2 N H V`` FLOPs each (logits, then the gradients of hidden and
weight), so the floor is ``6 N H V`` FLOPs at the bf16 matmul rate measured here; the loss
itself only moves bytes. What is timed is one training step's worth: the call, then
``loss.backward()`` into leaf ``hidden`` and ``weight`` whose ``.grad`` were reset before the
call, for every variant alike (no variant modifies its inputs). ``harness.py`` says how each
call is timed (CUDA events, the L2 flushed, variants interleaved rep by rep, median and
p20-p80).

packed_ce gets the labels aligned with the inputs and ``cu_seqlens`` (``shift=True``,
``is_packed=True``: a mean per sequence); the peers get the same target rows already shifted and
average per token. packed_ce runs with the defaults a user calls (``validate=True``: values
checked on the device; ``drop_ignored_rows=None``), and, marked, with other options. From
``N * H * V >= 2**40`` on (the headline) its defaults count the rows with a target (one wait for
the device) and the others (each sequence's prompt, 10-30% of it, and its last token) skip the
GEMMs, as in cut-cross-entropy; below that, and with ``drop_ignored_rows=False``, every row goes
through the GEMMs, as in torch.compile and Liger-Kernel, with no host sync. ``validate=False``
leaves the values unchecked.
Transient memory is the peak during the step minus what was allocated before it (the inputs)
and minus the gradients of hidden and weight that the step leaves behind.
cut-cross-entropy is run as installed (``filter_eps="auto"``: it skips gradient blocks whose
softmax is below a threshold, an approximation) and exact (``filter_eps=None``).

Writes ``<out>/fused_linear[_quick|_smoke]_<device>.json`` and prints the tables, the headline
last.

Dimensions: N tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import time
from dataclasses import dataclass

import harness

harness.smoke_requested()  # before packed_ce is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import make_tables  # noqa: E402
import packed_ce  # noqa: E402
from harness import GiB, Variant  # noqa: E402

DISTRIBUTIONS = ("torch", "triton", "liger-kernel", "cut-cross-entropy")


@dataclass(frozen=True)
class Plan:
    """Sizes and repetitions of one run: the GPU plans below, or the tiny CPU one."""

    headline: tuple[int, int, int, torch.dtype]  # (N, H, V, dtype)
    tokens: tuple[int, ...]
    vocabs: tuple[int, ...]
    max_bytes: int  # a variant whose estimated peak passes this is skipped at that shape
    seconds: float  # sweep shapes not started this long after the run began are skipped
    matmul_n: int
    headline_reps: int
    warmup: int


GPU_PLAN = Plan(
    headline=(8192, 4096, 128256, torch.bfloat16),
    tokens=(2048, 8192, 32768),
    vocabs=(32000, 128256, 262144),  # Llama-2, Llama-3, Gemma-3
    max_bytes=70 * GiB,
    seconds=180.0,  # the whole run then ends within about 4 minutes on an H100
    matmul_n=8192,
    headline_reps=20,
    warmup=3,
)
QUICK_PLAN = dataclasses.replace(
    GPU_PLAN, tokens=(2048, 8192), vocabs=(32000, 128256), seconds=100.0
)
# Tiny sizes for the interpreter, several chunks per call at the headline (chunk variants).
SMOKE_PLAN = Plan(
    headline=(64, 32, 1500, torch.bfloat16),
    tokens=(32, 64),
    vocabs=(300, 1500),
    max_bytes=500_000,  # so that the skip path runs: torch.compile at the largest shape
    seconds=600.0,
    matmul_n=256,
    headline_reps=2,
    warmup=1,
)


# --------------------------------------------------------------------------------------------
# Inputs


@dataclass
class Problem:
    """One packed batch: hidden states, the LM head, and the labels in both conventions."""

    hidden: torch.Tensor  # (N, H) leaf, requires grad
    weight: torch.Tensor  # (V, H) leaf, requires grad
    labels: torch.Tensor  # (N,) int64, aligned with the inputs (shift=True convention)
    cu_seqlens: torch.Tensor  # (S+1,) int32
    targets: torch.Tensor  # (N,) int64, labels after the shift: what the peers are given

    @property
    def flops(self) -> int:
        n, h = self.hidden.shape
        return 6 * n * h * self.weight.shape[0]

    @property
    def grad_bytes(self) -> int:
        """What the step leaves behind on purpose: the gradients of hidden and weight."""
        return sum(t.numel() * t.element_size() for t in (self.hidden, self.weight))

    def reset(self) -> None:
        """No gradients (untimed, before every call); no variant modifies an input."""
        self.hidden.grad = None
        self.weight.grad = None

    def describe(self) -> dict:
        n, h = self.hidden.shape
        return {
            "n": n,
            "hidden": h,
            "vocab": self.weight.shape[0],
            "dtype": str(self.hidden.dtype).removeprefix("torch."),
            "sequences": self.cu_seqlens.numel() - 1,
            "ignored_fraction": round(
                (self.targets == harness.IGNORE_INDEX).float().mean().item(), 3
            ),
            "flops": self.flops,
        }


def make_problem(n: int, h: int, vocab: int, dtype: torch.dtype, device: torch.device) -> Problem:
    # logits of standard deviation 2: random data, since zeros run faster than real data
    hidden = torch.randn(n, h, device=device, dtype=dtype)
    weight = torch.randn(vocab, h, device=device, dtype=dtype) * (2.0 / h**0.5)
    return Problem(
        hidden=hidden.requires_grad_(),
        weight=weight.requires_grad_(),
        **harness.packed_batch(n, vocab, device),
    )


# --------------------------------------------------------------------------------------------
# What is timed


def packed_ce_loss(**options):
    """packed_ce's defaults unless ``options`` say otherwise."""

    def loss(p: Problem) -> torch.Tensor:
        keywords = harness.packed_keywords(p.labels, p.cu_seqlens)
        return packed_ce.fused_linear_cross_entropy(
            p.hidden, p.weight, p.labels, is_packed=True, **keywords, **options
        )

    return loss


def unfused_packed_ce_loss(p: Problem) -> torch.Tensor:
    # The (N, V) logits materialised, the loss kernel writing their gradient over them.
    keywords = harness.packed_keywords(p.labels, p.cu_seqlens)
    return packed_ce.cross_entropy(
        F.linear(p.hidden, p.weight), p.labels, is_packed=True, inplace_backward=True, **keywords
    )


def float_linear_cross_entropy(hidden, weight, targets):
    # The common recipe: logits in the input dtype, upcast, PyTorch's log_softmax + nll.
    return F.cross_entropy((hidden @ weight.T).float(), targets)


def load_liger():
    """Liger-Kernel's fused linear cross entropy as ``f(problem) -> loss``, or why not."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except Exception as error:
        return None, harness.error_text(error)
    module = LigerFusedLinearCrossEntropyLoss()  # ignore_index=-100, reduction "mean"

    def loss(p: Problem) -> torch.Tensor:
        out = module(p.weight, p.hidden, p.targets)  # its argument order: weight first
        return out[0] if isinstance(out, tuple) else out

    return loss, None


def load_cut_cross_entropy(exact: bool):
    """cut-cross-entropy's ``linear_cross_entropy`` as ``f(problem) -> loss``, or why not."""
    try:
        from cut_cross_entropy import linear_cross_entropy
    except Exception as error:
        return None, harness.error_text(error)
    options = {}
    if exact:
        if "filter_eps" not in inspect.signature(linear_cross_entropy).parameters:
            return None, "this version has no filter_eps option"
        options["filter_eps"] = None  # no gradient filtering

    def loss(p: Problem) -> torch.Tensor:
        return linear_cross_entropy(p.hidden, p.weight, p.targets, **options)

    return loss, None


def peer_variants(device: torch.device, compile_dynamic: bool, cce_exact: bool) -> list[Variant]:
    # Inductor needs a GPU or a C++ toolchain; on CPU the traced graph runs eagerly, which is
    # enough to check the code path.
    backend = "inductor" if device.type == "cuda" else "eager"
    compiled = torch.compile(float_linear_cross_entropy, dynamic=compile_dynamic, backend=backend)
    cuda_only = None if device.type == "cuda" else "needs CUDA"
    liger, liger_error = (None, cuda_only) if cuda_only else load_liger()
    cce, cce_error = (None, cuda_only) if cuda_only else load_cut_cross_entropy(exact=False)
    variants = [
        Variant(
            "compile_fp32",
            "torch.compile F.cross_entropy((h @ W.T).float())"
            + (" (dynamic shapes)" if compile_dynamic else ""),
            lambda p: compiled(p.hidden, p.weight, p.targets),
            # bf16 logits saved for the backward and their bf16 gradient
            logits_bytes_per_element=4,
        ),
        Variant("liger", "Liger-Kernel fused linear CE", liger, skipped=liger_error),
        Variant("cce", "cut-cross-entropy (filter_eps auto)", cce, skipped=cce_error),
    ]
    if cce_exact:
        exact, exact_error = (None, cuda_only) if cuda_only else load_cut_cross_entropy(exact=True)
        variants.append(
            Variant(
                "cce_exact", "cut-cross-entropy exact (filter_eps=None)", exact, skipped=exact_error
            )
        )
    return variants


OURS = "packed_ce fused (defaults)"
OURS_NO_SYNC = "packed_ce fused, validate=False (values unchecked)"
OURS_KEEP = "packed_ce fused, drop_ignored_rows=False (every row through the GEMMs, no host sync)"


def headline_variants(device: torch.device) -> list[Variant]:
    chunks = (16, 32) if device.type == "cpu" else (2048, 4096)
    return [
        Variant("ours", OURS, packed_ce_loss()),
        Variant("ours_no_sync", OURS_NO_SYNC, packed_ce_loss(validate=False)),
        Variant("ours_keep", OURS_KEEP, packed_ce_loss(drop_ignored_rows=False)),
        Variant(
            "ours_fp32_acc",
            "packed_ce fused, fp32 weight-gradient accumulator",
            packed_ce_loss(grad_accumulation_dtype=torch.float32),
        ),
        *(
            Variant(
                f"ours_chunk{c}", f"packed_ce fused, chunk_size={c}", packed_ce_loss(chunk_size=c)
            )
            for c in chunks
        ),
        Variant(
            "ours_unfused",
            "packed_ce cross_entropy on F.linear logits, inplace_backward",
            unfused_packed_ce_loss,
            logits_bytes_per_element=2,
        ),
        *peer_variants(device, compile_dynamic=False, cce_exact=True),
    ]


def sweep_variants(device: torch.device) -> list[Variant]:
    # Dynamic shapes: one compilation serves the whole grid. The headline has the static one.
    return [
        Variant("ours", OURS, packed_ce_loss()),
        Variant("ours_keep", OURS_KEEP, packed_ce_loss(drop_ignored_rows=False)),
        *peer_variants(device, compile_dynamic=True, cce_exact=False),
    ]


def estimated_peak(variant: Variant, problem: Problem) -> int:
    n, vocab = problem.hidden.shape[0], problem.weight.shape[0]
    return 2 * problem.grad_bytes + n * vocab * variant.logits_bytes_per_element


def measure(
    problem: Problem, variants: list[Variant], *, matmul_tflops: float, max_bytes: int, **options
) -> list[dict]:
    """:func:`harness.measure` with the memory skip rule; each row set against the matmul
    floor, its transient memory apart from the gradients it leaves behind."""
    floor_ms = problem.flops / matmul_tflops / 1e9

    def too_big(variant: Variant) -> str | None:
        peak = estimated_peak(variant, problem)
        if peak <= max_bytes:
            return None
        return f"needs ~{peak / GiB:.3g} GiB > {max_bytes / GiB:.3g} GiB"

    rows = harness.measure(problem, variants, too_big=too_big, **options)
    for row in rows:
        if row["status"] == "ok":
            row["fraction_of_floor"] = floor_ms / row["median_ms"]
        if "extra_bytes" in row:
            row["transient_bytes"] = row["extra_bytes"] - problem.grad_bytes
    return rows


def check_headline(problem: Problem) -> dict:
    """packed_ce's loss and three gradients against float32 math on the same inputs.

    Untimed; a fused path that computes the wrong thing must not be reported as a fast one.
    The reference is packed_ce's PyTorch definition on explicit float32 logits.
    """
    exact = [t.detach().float().requires_grad_() for t in (problem.hidden, problem.weight)]
    ref_loss = packed_ce.cross_entropy(
        F.linear(*exact),
        problem.labels,
        cu_seqlens=problem.cu_seqlens,
        is_packed=True,
        shift=True,
        backend="torch",
    )
    ref_grads = torch.autograd.grad(ref_loss, exact)
    del exact
    loss = packed_ce_loss()(problem)
    grads = torch.autograd.grad(loss, (problem.hidden, problem.weight))
    errors = {
        "loss_rel_error": harness.relative_error(loss.detach(), ref_loss.detach()),
        "grad_hidden_rel_error": harness.relative_error(grads[0], ref_grads[0]),
        "grad_weight_rel_error": harness.relative_error(grads[1], ref_grads[1]),
    }
    # bf16: the logits and dL/dZ are rounded to 8 significant bits, as in the unfused model
    tolerance = 1e-4 if problem.hidden.dtype == torch.float32 else 2e-2
    passed = errors["loss_rel_error"] < 1e-3 and max(errors.values()) < tolerance
    return errors | {"passed": passed}


def run_headline(plan: Plan, device: torch.device, matmul_tflops: float) -> dict:
    n, h, vocab, dtype = plan.headline
    print(f"headline N={n} H={h} V={vocab} {dtype} ...", flush=True)
    problem = make_problem(n, h, vocab, dtype, device)
    check, rows = harness.checked_rows(
        problem,
        check_headline,
        headline_variants(device),
        functools.partial(measure, matmul_tflops=matmul_tflops, max_bytes=plan.max_bytes),
        reps=plan.headline_reps,
        warmup=plan.warmup,
        device=device,
    )
    return {
        "problem": problem.describe(),
        "floor_ms": problem.flops / matmul_tflops / 1e9,
        "check": check,
        "rows": rows,
    }


def sweep_reps(floor_ms: float) -> int:
    # about 1.5 s of timed calls per variant, between 3 and 15 calls
    return max(3, min(15, int(1500 / max(floor_ms, 1e-3))))


def run_sweep(plan: Plan, device: torch.device, matmul_tflops: float, deadline: float) -> dict:
    """Every (N, V) of the plan, small to large, so a run short of time loses the largest."""
    torch._dynamo.reset()  # the sweep's dynamic-shape compilation must not reuse the headline's
    _, h, _, dtype = plan.headline
    variants = sweep_variants(device)
    rows, skipped = [], []
    for n, vocab in sorted(
        ((n, v) for n in plan.tokens for v in plan.vocabs), key=lambda c: c[0] * c[1]
    ):
        shape = {"n": n, "hidden": h, "vocab": vocab, "dtype": str(dtype).removeprefix("torch.")}
        if time.monotonic() > deadline:
            skipped.append(shape | {"reason": f"run past {plan.seconds:.0f} s"})
            continue
        print(f"sweep N={n} V={vocab} ...", flush=True)
        problem = make_problem(n, h, vocab, dtype, device)
        floor_ms = problem.flops / matmul_tflops / 1e9
        rows += measure(
            problem,
            variants,
            reps=sweep_reps(floor_ms) if device.type == "cuda" else plan.headline_reps,
            warmup=min(plan.warmup, 2),
            device=device,
            matmul_tflops=matmul_tflops,
            max_bytes=plan.max_bytes,
        )
        harness.release_memory(problem, device)
        del problem
    return {"rows": rows, "skipped": skipped}


# --------------------------------------------------------------------------------------------
# Command line


MODES = {"quick": "a smaller sweep"}


def main() -> int:
    """Runs the plan of the chosen mode; returns 1 if packed_ce failed its correctness check."""
    args = harness.argument_parser(__doc__.split("\n\n")[0], MODES).parse_args()
    started = time.monotonic()
    mode, device, json_path, result = harness.begin_run(
        "fused_linear", args, tuple(MODES), DISTRIBUTIONS
    )
    plan = {"full": GPU_PLAN, "quick": QUICK_PLAN, "smoke": SMOKE_PLAN}[mode]
    result["source_sha256"] = harness.package_digest(packed_ce)
    print("matmul rate ...", flush=True)
    result["ceilings"] = {"matmul": harness.matmul_tflops(device, plan.matmul_n, reps=30)}
    tflops = result["ceilings"]["matmul"]["tflops"]
    harness.write_json(json_path, result)  # saved after every section: a timeout keeps the rest

    result["headline"] = run_headline(plan, device, tflops)
    harness.write_json(json_path, result)
    result["sweep"] = run_sweep(plan, device, tflops, deadline=started + plan.seconds)
    harness.write_json(json_path, result)

    print(f"\nwrote {json_path}")
    print(make_tables.fused_linear_report(result))
    return 0 if result["headline"]["check"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
