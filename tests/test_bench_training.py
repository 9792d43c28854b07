"""``benchmarks/bench_training.py --tiny`` end to end on the CPU, its objective check, and the
kernel benchmarks' one-line refusal without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCHMARKS)]))
    env.pop("TRITON_INTERPRET", None)  # the scripts choose it themselves
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


@pytest.mark.slow  # about 15 s, most of it importing transformers
def test_tiny_run_writes_every_run_and_the_same_objective(tmp_path):
    done = run_script("bench_training.py", "--tiny", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "training_cpu.json").read_text())
    assert set(result["runs"]) == {"packed", "padded", "stock", "packed_exact_length"}
    for name, run in result["runs"].items():
        assert len(run["warmup_seconds"]) == (
            1 if name == "packed_exact_length" else result["warmup_steps"]
        )
        assert run["step_seconds"] and run["tokens_per_second"] > 0
        # sdpa on the CPU: torch.compile is never involved
        assert run["steps_not_run"] == 0 and run["recompiles"] == 0
        assert len(run["step_compiles"]) == len(run["step_seconds"])
    padded = result["runs"]["padded"]["shapes_seen_before"]
    steps = result["warmup_steps"] + len(result["runs"]["padded"]["step_seconds"])
    assert padded["micro_batches"] == len(padded["seconds"]) >= steps >= padded["shapes"] > 0
    exact = result["runs"]["packed_exact_length"]
    assert len(exact["row_lengths"]) == 1 + len(exact["step_seconds"])
    check = result["check"]
    # fp32 on the CPU: packed and padded agree to rounding, conversation by conversation
    assert check["passed"] and check["tolerance"] == 1e-4
    assert check["max_rel_diff_per_conversation"] < 1e-5
    assert check["rel_diff_first_step_loss"] < 1e-5
    assert result["speedup_packed_over_padded"] > 0 and result["speedup_packed_over_stock"] > 0
    # every conversation of every step is checked
    assert check["steps"] == result["warmup_steps"] + len(result["runs"]["packed"]["step_seconds"])
    assert check["conversations"] == round(
        result["data"]["conversations_per_step"] * check["steps"]
    )
    assert len(check["packed_conversation_losses"]) == check["conversations"]
    table = (tmp_path / "training_cpu.md").read_text()
    assert "| packed rows, document-masked attention, packed_ce" in table and "passed" in table


@pytest.fixture
def bench_training(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_training

    return bench_training


def tiny_setup(bench_training):
    plan = bench_training.TINY_PLAN
    rng = np.random.default_rng(0)
    conversations = bench_training.make_conversations(
        40, plan.model["vocab_size"], plan.chat, plan.max_conversation, rng
    )
    steps = bench_training.make_steps(
        conversations, 1, plan, plan.row_tokens, torch.device("cpu"), rng
    )
    model = bench_training.build_model(plan, torch.device("cpu"))
    initial = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    return conversations, steps[0], model, initial


def test_steps_hold_each_conversation_once_in_both_layouts(bench_training):
    conversations, step, _, _ = tiny_setup(bench_training)
    lengths = [len(conversations[i]["input_ids"]) for i in step.conversations]
    packed = step.packed
    assert packed["input_ids"].shape == (1, bench_training.TINY_PLAN.row_tokens)
    assert packed["cu_seqlens"].diff().tolist()[: len(lengths)] == lengths
    assert sorted(step.padded_order) == list(range(len(lengths)))
    rows = torch.cat([b["attention_mask"].sum(1) for b in step.padded]).tolist()
    assert rows == [lengths[i] for i in step.padded_order]
    assert step.real_tokens == sum(lengths)


def test_no_step_starts_past_the_deadline(bench_training):
    _, step, model, initial = tiny_setup(bench_training)
    clock = bench_training.Clock(start=0.0, budget=0.0)  # long past
    run = bench_training.run_training(
        "packed", model, initial, [step], 1, "sdpa", torch.device("cpu"), clock
    )
    assert run["steps_not_run"] == 1 and run["losses"] == [] and "median_seconds" not in run
    import make_tables

    result = {
        "environment": {"device_name": "cpu", "versions": {}},
        "model": {"parameters": 1, "config": dict(bench_training.TINY_PLAN.model), "dtype": "x"},
        "data": dict.fromkeys(
            ("conversations_per_step", "real_tokens_per_step", "target_tokens_per_step"), 1.0
        )
        | {"row_tokens": 1, "pad_to_multiple": 1, "padded_batch": 1, "padded_tokens_per_step": 1},
        "warmup_steps": 1,
        "check": {
            "conversations": 1,
            "max_rel_diff_per_conversation": 0.0,
            "rel_diff_loss": 0.0,
            "rel_diff_stock_token_mean": 0.0,
            "tolerance": 1e-4,
            "passed": True,
        },
        "runs": {"packed": run},
    }
    assert "- packed: 1 steps not run (time budget)" in make_tables.training_report(result)


def test_objective_check_fails_on_the_token_mean(bench_training, monkeypatch):
    _, step, model, initial = tiny_setup(bench_training)
    check = bench_training.check_objective(model, initial, [step], "sdpa")
    assert check["max_rel_diff_per_conversation"] < 1e-5 and check["rel_diff_loss"] < 1e-5
    # the same check with an unweighted packed loss: every conversation's "mean" becomes its
    # sum of token losses, far from its padded mean
    import packed_ce

    real = packed_ce.fused_linear_cross_entropy

    def token_sum(*args, **options):
        if options.get("reduction") == "none":
            options["is_packed"] = False
        return real(*args, **options)

    monkeypatch.setattr(packed_ce, "fused_linear_cross_entropy", token_sum)
    wrong = bench_training.check_objective(model, initial, [step], "sdpa")
    assert wrong["max_rel_diff_per_conversation"] > 0.5


@pytest.mark.parametrize(
    "name", ["bench_training.py", "bench_cross_entropy.py", "bench_fused_linear.py"]
)
def test_without_cuda_the_gpu_runs_refuse_in_one_line(name):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    done = run_script(name)
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and "no CUDA device" in done.stderr, done.stderr
