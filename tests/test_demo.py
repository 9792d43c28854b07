"""``packed-ce demo`` and ``packed-ce pack`` end to end, offline, on the CPU."""

from __future__ import annotations

import json

import pytest

from packed_ce_demo.cli import build_parser, main

datasets = pytest.importorskip("datasets")  # the demo loads its data with datasets


def test_demo_prints_the_table_and_writes_the_report(tmp_path, capsys):
    status = main(
        [
            "demo",
            "--steps",
            "3",
            "--max-length",
            "256",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    print(out)
    assert status == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["passed"] and report["max_abs_diff_packed_vs_padded"] <= 1e-5
    # the naive token mean trains a different model
    assert report["max_abs_diff_naive_vs_padded"] > 100 * report["max_abs_diff_packed_vs_padded"]
    assert (tmp_path / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("packed", "padded", "naive"):
        assert len(report["runs"][name]["losses"]) == 3
    assert "max |packed - padded|" in out and "(tolerance 1e-05: OK)" in out
    assert f"{report['data']['conversations']:,} conversations" in out


def test_demo_options_local_data_and_model_config(tmp_path, capsys):
    """--dataset (local JSONL with a weight column: the padded baseline weighs conversations as the
    packed run does), --model-config (JSON), --seed, --device: a Qwen2 on ten conversations."""
    data = tmp_path / "chats.jsonl"
    with data.open("w") as handle:
        for i in range(10):
            messages = [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}." + " Indeed." * i},
                {"role": "user", "content": "Thanks!"},
                {"role": "assistant", "content": "You are welcome."},
            ]
            handle.write(json.dumps({"messages": messages, "weight": [0.5, 2.0, 0.0, 1.0, 3.0][i % 5]}) + "\n")
    config = tmp_path / "model.json"
    config.write_text(
        json.dumps({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64})
    )
    status = main(
        [
            "demo",
            "--dataset",
            str(data),
            "--model-config",
            str(config),
            "--max-length",
            "256",  # several conversations of different weights in a row
            "--steps",
            "2",
            "--rows-per-step",
            "1",
            "--seed",
            "3",
            "--device",
            "cpu",
            "--output-dir",
            str(tmp_path / "out"),
            "--no-progress",
        ]
    )
    assert status == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["model"]["model_type"] == "qwen2" and report["data"]["conversations"] == 10
    assert report["passed"]


def test_demo_refuses_too_few_rows(tmp_path, capsys):
    assert main(["demo", "--steps", "1000", "--output-dir", str(tmp_path), "--no-progress"]) == 2
    assert "packed rows" in capsys.readouterr().err


def test_pack_saves_the_rows_and_prints_the_statistics(tmp_path, capsys):
    output = tmp_path / "packed"
    assert main(["pack", "--max-length", "512", "--output", str(output)]) == 0
    out = capsys.readouterr().out
    packed = datasets.load_from_disk(str(output))
    # the corpus's `category` travels with each conversation
    assert packed.column_names == ["input_ids", "labels", "seq_lengths", "seq_category"]
    assert max(len(row) for row in packed["input_ids"]) <= 512
    assert f"into {packed.num_rows:,} rows of 512 tokens" in out and "efficiency" in out


def test_pack_keeps_weight_and_source(tmp_path, capsys):
    """A data set's `weight` and `source` reach every packed sequence as `seq_weights` / `seq_sources`."""
    chats = [("Hi", "Hello", 2.0, "greetings"), ("How are you?", "Fine, thanks.", 0.5, "smalltalk"),
             ("Bye", "Goodbye", 1.0, "greetings")]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                    "weight": w, "source": s}) + "\n" for q, a, w, s in chats))
    output = tmp_path / "packed"
    assert main(["pack", "--dataset", str(path), "--max-length", "64", "--output", str(output)]) == 0
    packed = datasets.load_from_disk(str(output))
    assert packed.column_names == ["input_ids", "labels", "seq_lengths", "seq_weights", "seq_sources"]
    # each sequence's weight and source are its conversation's, found by its first assistant token
    import collators

    tokenizer = collators.load_default_tokenizer()
    found = []
    for row in packed:
        start = 0
        for length, weight, source in zip(row["seq_lengths"], row["seq_weights"], row["seq_sources"]):
            text = tokenizer.decode(row["input_ids"][start : start + length])
            found.append((next(q for q, *_ in chats if q in text), weight, source))
            start += length
    assert sorted(found) == sorted((q, w, s) for q, _, w, s in chats)


def test_pack_stores_the_images_with_the_rows(tmp_path, capsys):
    """Conversations with images: tokenized with the processor --tokenizer names, each packed row
    keeps its conversations' images in order; without a processor, one line names the fix."""
    import collators

    processor = collators.load_default_processor("llava")  # saved and loaded without torchvision
    processor.save_pretrained(tmp_path / "processor")
    data = collators.load_default_image_dataset(6)
    data.save_to_disk(str(tmp_path / "chats"))
    output = tmp_path / "packed"
    argv = ["pack", "--dataset", str(tmp_path / "chats"), "--max-length", "256"]
    assert main([*argv, "--tokenizer", str(tmp_path / "processor"), "--output", str(output)]) == 0
    packed = datasets.load_from_disk(str(output))
    assert packed.column_names == ["input_ids", "labels", "images", "seq_lengths", "seq_sources"]
    assert sum(len(row) for row in packed["images"]) == sum(len(row) for row in data["images"])
    batch = collators.VisionCollator(processor)(list(packed)[:1])
    assert batch["pixel_values"].shape[0] == len(packed[0]["images"])
    assert main([*argv, "--output", str(tmp_path / "other")]) == 2
    assert "has images: name the model's processor with --tokenizer" in capsys.readouterr().err


def test_help_explains_every_option():
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices
    for name, options in {
        "demo": [
            "--dataset",
            "--tokenizer",
            "--model-config",
            "--max-length",
            "--steps",
            "--device",
            "--output-dir",
            "--seed",
        ],
        "pack": ["--dataset", "--tokenizer", "--max-length", "--output"],
    }.items():
        text = commands[name].format_help()
        for option in options:
            assert option in text
        documented = [a for a in commands[name]._actions if a.option_strings and a.dest != "help"]
        assert all(action.help for action in documented)
