"""``benchmarks/bench_trl.py --model tiny --device cpu`` end to end: whole trl steps of both
trainers, the objective check on their first step, the profile's fields, the longest-row search
in a subprocess, and the tables ``make_tables.py`` renders from these results."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def script_env() -> dict:
    """This environment with the repository and benchmarks/ first on the import path (what
    was on it stays: packages installed there)."""
    path = [str(ROOT), str(BENCHMARKS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path))


def run_script(*args: str, device: str = "cpu") -> subprocess.CompletedProcess:
    env = script_env()
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_trl.py"), "--model", "tiny", "--device", device,
         *args],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip


@pytest.fixture
def benchmarks_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))


def check_runs(result: dict, names: set[str], device: str = "cpu") -> None:
    assert set(result["runs"]) == names and result["skipped_runs"] == {}
    for name, run in result["runs"].items():
        assert "error" not in run, run
        assert len(run["warmup_seconds"]) == result["warmup_steps"] == 1
        assert len(run["step_seconds"]) == len(run["step_real_tokens"]) == 2
        assert run["tokens_per_second"] > 0 and 0 < run["real_tokens_per_step"] <= 256
        # the first step's loss is the objective of its trainer, from the same initial weights
        check = run["check"]
        expected = "token_mean" if name.startswith("stock") else "per_conversation_mean"
        assert check["expected"] == expected and check["passed"], check
        assert check["first_step_loss"] == run["losses"][0]
        profile = run["profile"]
        assert profile["wall_ms"] > 0 and "Self CPU" in profile["table"]
        if device == "cuda":  # bf16: within the check's own tolerance
            assert check["rel_diff_expected"] <= check["tolerance"] == 2e-3
            assert profile["device_ms"] > 0 and "Self CUDA" in profile["table"]
            continue
        # float32 on the CPU: rounding apart, and the two objectives far further apart
        assert check["rel_diff_expected"] < 1e-5
        assert check["separation"] > 100 * check["rel_diff_expected"]
        assert check["rel_diff_other"] > 0.5 * check["separation"]
        assert profile["own_ms"] == 0.0  # no device kernels on the CPU
    first = [run["check"] for run in result["runs"].values()]
    # every run saw the same first batch
    assert len({(c["per_conversation_mean"], c["token_mean"], c["targets"]) for c in first}) == 1


@pytest.mark.slow  # about 15 s, most of it importing trl and transformers
def test_tiny_runs_time_both_trainers_and_check_their_objectives(tmp_path, benchmarks_path):
    done = run_script(
        "--runs", "stock", "packed_all_rows", "packed", "--warmup", "1", "--max-steps", "2",
        "--profile", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "trl_steps_tiny_cpu.json").read_text())
    assert result["benchmark"] == "trl_steps" and result["mode"] == "tiny"
    # in the order of RUNS whatever the order asked for; each run also has a file of its own
    assert list(result["runs"]) == ["packed", "stock", "packed_all_rows"]
    for name in result["runs"]:
        assert json.loads((tmp_path / f"trl_steps_tiny_{name}_cpu.json").read_text())["run"] == name
    check_runs(result, {"packed", "stock", "packed_all_rows"})
    packed, stock = (result["runs"][name]["check"] for name in ("packed", "stock"))
    assert packed["first_step_loss"] != stock["first_step_loss"]

    # the table printed last is make_tables' report of this result
    import make_tables

    table = make_tables.trl_steps_report(result)
    assert done.stdout.rstrip().endswith(table.splitlines()[-1])
    assert "| PackedSFTTrainer (defaults" in table and "per conversation mean: passed" in table
    assert "| 1.000x |" in table  # stock against itself
    # tiny numbers never reach the README; a full result of the same shape does
    assert "Whole trl steps" not in make_tables.readme_section(tmp_path)
    (tmp_path / "trl_steps_tiny_cpu.json").write_text(json.dumps(result | {"mode": "full"}))
    assert "### Whole trl steps, cpu" in make_tables.readme_section(tmp_path)


@pytest.mark.slow  # about 30 s: two runs in subprocesses
@pytest.mark.parametrize("adapter", ["lora", "qlora"])
def test_tiny_adapter_runs_in_reverse_order(adapter, tmp_path, benchmarks_path):
    """``--adapter lora`` / ``qlora`` (the model saved once and loaded back in 4 bits): both
    trainers train only the adapter and pass their objective check; ``--reverse`` runs stock
    first, and the result keeps the order of RUNS."""
    if adapter == "qlora":
        pytest.importorskip("bitsandbytes")
    checkpoints = Path(tempfile.gettempdir()) / "packed_ce_bench_checkpoints"
    done = run_script(
        "--adapter", adapter, "--runs", "packed", "stock", "--reverse", "--warmup", "1",
        "--max-steps", "2", "--isolate", "--out", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / f"trl_steps_tiny_{adapter}_reversed_cpu.json").read_text())
    assert result["adapter"] == adapter and list(result["runs"]) == ["packed", "stock"]
    assert result["order"] == ["stock", "packed"]
    assert done.stdout.index("stock: building") < done.stdout.index("packed: building")
    for name, run in result["runs"].items():
        assert (tmp_path / f"trl_steps_tiny_{adapter}_reversed_{name}_cpu.json").exists()
        assert run["job"]["lora"] and run["job"]["quantized"] == (adapter == "qlora")
        assert 0 < run["trainable_parameters"] < run["parameters"] / 2
        check = run["check"]
        assert check["passed"], check
        # a 4-bit model computes in bf16 even on the CPU: the check's tolerance follows
        assert check["tolerance"] == (2e-3 if adapter == "qlora" else 1e-4)
    if adapter == "qlora":
        assert list(checkpoints.glob("tiny-*/config.json"))  # saved once, then reused
    import make_tables

    assert make_tables.ADAPTER_TEXT[adapter] in make_tables.trl_steps_report(result)
    # the README's section names the adapter and the order; a full run's heading stays as it was
    path = tmp_path / f"trl_steps_tiny_{adapter}_reversed_cpu.json"
    path.write_text(json.dumps(result | {"mode": "full"}))
    heading = f"### Whole trl steps, {make_tables.ADAPTER_HEADINGS[adapter]}, in reverse order, cpu"
    assert heading in make_tables.readme_section(tmp_path)


@pytest.mark.slow
def test_liger_runs(tmp_path):
    pytest.importorskip("liger_kernel")
    import torch

    if not torch.cuda.is_available():  # the Triton interpreter cannot run Liger's kernels
        pytest.skip("Liger-Kernel's kernels need a GPU")
    done = run_script(
        "--runs", "packed_liger", "stock_liger", "--warmup", "1", "--max-steps", "2",
        "--profile", "--out", str(tmp_path), device="cuda",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the file of all runs, beside one per run
    results = [json.loads(path.read_text()) for path in tmp_path.glob("trl_steps_tiny_*.json")]
    (result,) = [result for result in results if "runs" in result]
    check_runs(result, {"packed_liger", "stock_liger"}, device="cuda")


@pytest.mark.slow  # about 12 s: the search runs in a subprocess of its own
def test_longest_row_search_in_a_subprocess(tmp_path, benchmarks_path):
    done = run_script(
        "--longest", "--runs", "stock", "--max-row", "512", "--isolate", "--out", str(tmp_path)
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "trl_longest_tiny_cpu.json").read_text())
    found = result["searches"]["tiny_stock"]
    # nothing runs out of memory on the CPU: doubling stops at --max-row
    assert [(p["row_length"], p["status"]) for p in found["probes"]] == [
        (256, "fits"),
        (512, "fits"),
    ]
    assert found["longest_fits"] == 512 and found["shortest_fails"] is None
    assert found["stopped"] == "reached --max-row 512" and not found["fresh_process"]
    # every probed row was padded to its length, with real tokens in each of the 2 steps
    assert all(len(p["real_tokens"]) == result["probe_steps"] == 2 for p in found["probes"])
    import make_tables

    assert "| tiny | trl SFTTrainer (stock nll" in make_tables.trl_longest_report(result)


def test_the_search_doubles_then_bisects(benchmarks_path):
    from bench_trl import next_length

    def probes(capacity: int, start: int = 8192, limit: int = 1 << 20) -> list[int]:
        """The lengths probed, in order, on a device where rows up to ``capacity`` fit."""
        fits, fails, order = [], [], []
        while (length := next_length(fits, fails, start, limit, 0.125)) is not None:
            (fits if length <= capacity else fails).append(length)
            order.append(length)
        return order

    # 8192 .. 65536 fit, 131072 fails; then multiples of 1024 halfway, until the gap between
    # the longest that fits (98304) and the shortest that fails (106496) is <= 1/8 of the first
    assert probes(100_000) == [8192, 16384, 32768, 65536, 131072, 98304, 114688, 106496]
    # the start fails: halve, down to 1024 tokens, then bisect to 1024 tokens
    assert probes(3000) == [8192, 4096, 2048, 3072]
    assert probes(500) == [8192, 4096, 2048, 1024]
    # nothing fails up to the limit
    assert probes(10**9, limit=32768) == [8192, 16384, 32768]
    # doubling past the limit probes the limit itself, last
    assert probes(10**9, limit=40960) == [8192, 16384, 32768, 40960]


def test_the_memory_of_fitting_probes_steers_the_search(benchmarks_path):
    """On a simulated device whose peak memory grows linearly with the row (10 GiB + 300 KiB
    per token), the search predicts the limit from the first two probes and ends a few probes
    later; when the device fails earlier than the line says (fragmentation), the bracket
    still ends at the true limit."""
    from bench_trl import next_length, predicted_length

    def search(fails_above: int, capacity_gib: float = 80.0) -> list[tuple[int, str]]:
        probes = []
        while True:
            fits = [p["row_length"] for p in probes if p["status"] == "fits"]
            fails = [p["row_length"] for p in probes if p["status"] == "oom"]
            predicted = predicted_length(probes, capacity_gib)
            length = next_length(fits, fails, 8192, 1 << 20, 0.125, predicted)
            if length is None:
                return [(p["row_length"], p["status"]) for p in probes]
            peak = 10 + length * 300 / 2**20
            if length <= fails_above:
                probes.append({"row_length": length, "status": "fits", "peak_gib": peak})
            else:
                probes.append({"row_length": length, "status": "oom"})

    line = (80 - 10) * 2**20 / 300  # 244,667 tokens: where the line reaches 80 GiB
    assert predicted_length(
        [{"row_length": 8192, "status": "fits", "peak_gib": 10 + 8192 * 300 / 2**20},
         {"row_length": 16384, "status": "fits", "peak_gib": 10 + 16384 * 300 / 2**20}], 80.0,
    ) == pytest.approx(line)  # fmt: skip
    # the line is right: 8192, 16384, the prediction rounded down (fits), one gap more (fails)
    assert search(int(line)) == [
        (8192, "fits"), (16384, "fits"), (243712, "fits"), (243712 + 29 * 1024, "oom")
    ]  # fmt: skip
    # the device fails at 200,000 tokens: more probes, the same kind of bracket
    found = search(200_000)
    fits = max(length for length, status in found if status == "fits")
    fails = min(length for length, status in found if status == "oom")
    assert fits <= 200_000 < fails and fails - fits <= 0.125 * fits
    assert len(found) < 9  # plain doubling and halving takes 9 here
    # no memory figures (the CPU): plain doubling and bisection
    assert predicted_length([{"row_length": 8192, "status": "fits"}] * 2, 80.0) is None
    assert predicted_length([{"row_length": 8192, "status": "fits", "peak_gib": 1.0}], None) is None


def test_objective_check_tells_the_two_means_apart(benchmarks_path):
    from bench_trl import objective_check

    reference = {"conversations": 3, "targets": 90, "per_conversation_mean": 2.0, "token_mean": 2.1}
    assert objective_check("packed", 2.0, reference, 1e-4)["passed"]
    assert not objective_check("packed", 2.1, reference, 1e-4)["passed"]
    assert objective_check("stock_liger", 2.1, reference, 1e-4)["passed"]
    assert not objective_check("stock", 2.0, reference, 1e-4)["passed"]
    # within tolerance of both, but closer to the wrong one: not passed
    close = reference | {"token_mean": 2.0001}
    assert not objective_check("packed", 2.0001, close, 1e-3)["passed"]


def test_searches_go_on_after_memory_stays_allocated_and_after_a_failure(
    benchmarks_path, monkeypatch, tmp_path
):
    """The driver with probes stood in for: rows fit up to a capacity per run; the second
    probe leaves memory allocated (a fresh worker goes on), and one search's probe raises."""
    import bench_trl

    capacity = {"packed": 40_000, "stock": 20_000}
    made = []

    def probe(job):
        made.append((job.run, job.row_length))
        if job.run == "stock_liger":
            raise RuntimeError("the worker fails")
        fits = job.row_length <= capacity[job.run]
        return {
            "row_length": job.row_length, "status": "fits" if fits else "oom", "seconds": 1.0,
            "setup_seconds": 0.5, "step_seconds": [0.2, 0.2],
            "left_allocated_bytes": 2**30 if len(made) == 2 else 0,
        }  # fmt: skip

    monkeypatch.setattr(bench_trl, "probe", probe)
    args = bench_trl.parse_args(
        ["--longest", "--model", "tiny", "--device", "cpu", "--runs", "stock_liger", "stock",
         "packed", "--row-length", "8192", "--no-isolate", "--out", str(tmp_path)]
    )  # fmt: skip
    jobs = bench_trl.make_jobs(args)
    assert [job.run for job in jobs] == ["packed", "stock", "stock_liger"]  # Liger's last
    found = bench_trl.run_longest(args, jobs, math.inf, tmp_path, "cpu")["searches"]
    packed, stock, liger = (found[f"tiny_{run}"] for run in ("packed", "stock", "stock_liger"))
    assert [p["row_length"] for p in packed["probes"]] == [
        8192, 16384, 32768, 65536, 49152, 40960, 36864,
    ]  # fmt: skip
    assert (packed["longest_fits"], packed["shortest_fails"]) == (36864, 40960)
    assert (stock["longest_fits"], stock["shortest_fails"]) == (18432, 20480)
    assert packed["stopped"] == stock["stopped"] == "done"
    assert liger["probes"] == [] and liger["stopped"] == "worker: RuntimeError: the worker fails"
    assert json.loads((tmp_path / "trl_longest_tiny_stock_cpu.json").read_text())["run"] == "stock"


def test_without_cuda_the_gpu_run_refuses_in_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = script_env()
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_trl.py")],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr, done.stderr


def test_flex_attention_compiles_in_two_warm_up_probes_before_the_searches(
    benchmarks_path, monkeypatch, tmp_path
):
    """The warm-up probes (one step of 1024, then 2048 tokens) run once per model, before its
    first search, and are reported apart from the searches' probes."""
    import dataclasses

    import bench_trl

    made = []

    def probe(job):
        made.append((job.model, job.run, job.row_length, job.steps))
        fits = job.row_length <= 20_000
        return {"row_length": job.row_length, "status": "fits" if fits else "oom", "seconds": 1.0}

    monkeypatch.setattr(bench_trl, "probe", probe)
    args = bench_trl.parse_args(
        ["--longest", "--model", "tiny", "--device", "cpu", "--runs", "stock", "packed",
         "--row-length", "8192", "--no-isolate", "--out", str(tmp_path)]
    )  # fmt: skip
    jobs = [
        dataclasses.replace(job, attention="flex_attention") for job in bench_trl.make_jobs(args)
    ]
    body = bench_trl.run_longest(args, jobs, math.inf, tmp_path, "cpu")
    assert made[:2] == [("tiny", "packed", 1024, 1), ("tiny", "packed", 2048, 1)]
    assert all(length >= 8192 and steps == 2 for _, _, length, steps in made[2:])
    assert [(w["row_length"], w["run"]) for w in body["warmups"]] == [
        (1024, "packed"), (2048, "packed")
    ]  # fmt: skip
    for found in body["searches"].values():
        assert 1024 not in [p["row_length"] for p in found["probes"]]
        assert (found["longest_fits"], found["shortest_fails"]) == (18432, 20480)


def test_the_stack_sampler_names_what_the_host_did_in_a_slow_step(benchmarks_path):
    import bench_trl

    step = [0]
    sampler = bench_trl.StackSampler(lambda: step[0], interval=0.001)

    def stall_here():  # waits for the sampler, so that the test never depends on timing
        while sum(sampler.samples[1].values()) < 3:
            time.sleep(0.001)

    sampler.start()
    for step[0] in range(4):
        if step[0] == 1:
            stall_here()
    step[0] = 4
    sampler.stop()
    # the times are given: step 1 is the slow one, step 2 the median's
    report = sampler.report([0.5, 3.0, 0.45, 0.4], slice(1, 4))
    assert [entry["step"] for entry in report] == [1, 2]
    slow = report[0]
    assert slow["seconds"] == 3.0 and slow["samples"] >= 3
    # the training thread's stacks (other threads' are led by their id) are all in stall_here
    training = [stack.split(" < ")[:2] for stack, _ in slow["top"] if not stack.startswith("thread")]
    assert training and all(any("stall_here" in frame for frame in frames) for frames in training)
    assert sampler.report([1.0], slice(1, 1)) == []


def test_a_profile_by_step_files_each_op_under_its_step(benchmarks_path):
    import bench_trl
    from torch.profiler import ProfilerActivity, profile, record_function

    a = torch.ones(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        with record_function("step 3"):
            a @ a
        with record_function("step 4"):
            a.sum()
    steps = bench_trl.profile_by_step(profiler, [0.0, 0.0, 0.0, 0.5, 0.25])
    assert [(s["step"], s["seconds"], s["device_ms"]) for s in steps] == [(3, 0.5, 0), (4, 0.25, 0)]
    ops = [{name for name, _ in s["host_ops_ms"]} for s in steps]
    assert "aten::mm" in ops[0] and "aten::mm" not in ops[1] and "aten::sum" in ops[1]


def test_one_profiler_at_a_time(benchmarks_path):
    import bench_trl

    with pytest.raises(SystemExit):
        bench_trl.parse_args(["--device", "cpu", "--model", "tiny", "--profile", "--profile-steps"])
