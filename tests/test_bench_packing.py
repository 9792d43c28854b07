"""``benchmarks/bench_packing.py`` at small sizes on the CPU: its results files, and `pack_dataset`'s peak
anonymous memory not growing with the number of tokens."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("datasets")
pytest.importorskip("trl")
from test_bench_training import run_script

# 2M and 16M tokens: packing them in memory (27 bytes a token) would take +0.05 and +0.4 GiB.
SIZES = ("2M", "16M")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bench_packing")
    done = run_script("bench_packing.py", "--sizes", ",".join(SIZES), "--data-dir", str(folder / "data"),
                      "--out", str(folder / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    return folder / "out"


def test_tiny_run_writes_results_table_and_plot(results):
    data = json.loads((results / "packing.json").read_text())
    assert [size["num_tokens"] >= 10**6 * int(text[:-1]) for size, text in zip(data["sizes"], SIZES)] == [True] * 2
    for size in data["sizes"]:
        assert 450 < size["mean_length"] < 540  # lognormal, mean about 495 tokens
        for packer in ("packed_ce", "trl"):
            run = size["runs"][packer]
            assert run["seconds"] > 0 and run["rows"] * data["max_length"] >= run["tokens"]
            assert 0.9 < run["efficiency"] <= 1
        # global best-fit decreasing packs at least as tightly as trl's per-batch one
        assert size["runs"]["packed_ce"]["rows"] <= size["runs"]["trl"]["rows"]
    table = (results / "packing.md").read_text()
    assert table.count("| packed_ce |") == 2 and table.count("| trl |") == 2
    assert (results / "packing.png").stat().st_size > 10_000


def test_peak_memory_does_not_grow_with_the_tokens(results):
    """8 times the tokens, the same peak: the rows go to disk a batch at a time (generous bounds for a shared
    2-core machine; in memory the larger size alone would need +0.4 GiB)."""
    small, large = (size["runs"]["packed_ce"]["peak_anon_gib"] for size in json.loads(
        (results / "packing.json").read_text())["sizes"])
    assert small < 0.2 and large < 0.2
    assert large - small < 0.1


def test_stream_mode_measures_each_window(tmp_path):
    """`--stream`: the whole-data-set packer and the stream at each window on the same file; a larger window packs
    at least as tightly, and no window beats the whole data set."""
    done = run_script("bench_packing.py", "--stream", "--sizes", "1M", "--windows", "64,0", "--data-dir",
                      str(tmp_path / "data"), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stdout + done.stderr
    [size] = json.loads((tmp_path / "out" / "streaming_packing.json").read_text())["sizes"]
    runs = size["runs"]
    assert list(runs) == ["packed_ce", "packed_ce_stream window 64", "packed_ce_stream window default"]
    rows = [run["rows"] for run in runs.values()]
    assert rows[0] <= rows[2] <= rows[1]
    assert all(run["tokens"] == runs["packed_ce"]["tokens"] for run in runs.values())
