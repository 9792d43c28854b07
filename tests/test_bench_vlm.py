"""``benchmarks/bench_vlm.py --tiny`` end to end on the CPU: every run, the check against each
conversation alone, the JSON lines it writes."""

from __future__ import annotations

import json

from test_bench_training import run_script


def test_tiny_run_writes_every_run_and_passes_the_check(tmp_path):
    done = run_script("bench_vlm.py", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [json.loads(line) for line in (tmp_path / "vlm_cpu.jsonl").read_text().splitlines()]
    kinds = [line["kind"] for line in lines]
    assert kinds == ["environment", "check", "run", "run", "run", "summary"]
    environment, check, *runs, summary = lines
    assert sum(environment["images_per_step"]) > 0  # the rows carry images
    # float32 on the CPU: packed and padded agree with each conversation alone to rounding,
    # the vision tower's gradients included
    assert check["passed"] and check["tolerance"] == 1e-4
    for layout in ("packed", "padded"):
        assert check[f"rel_diff_loss_{layout}"] < 1e-5
        gradients = check[f"rel_diff_gradients_{layout}"]
        assert {"all", "vision", "language"} <= set(gradients)  # the head is tied here
        assert max(gradients.values()) < 1e-4
    assert {run["name"] for run in runs} == {"packed", "padded", "trl_style"}
    for run in runs:
        assert run["steps_not_run"] == 0 and run["tokens_per_second"] > 0
        assert len(run["step_seconds"]) == environment["steps"]
    # packed and padded train the same objective on the same steps: the same losses
    packed, padded = (next(r for r in runs if r["name"] == n) for n in ("packed", "padded"))
    assert all(abs(a - b) < 1e-4 * abs(b) for a, b in zip(packed["losses"], padded["losses"]))
    assert summary["speedup_packed_over_padded"] > 0
