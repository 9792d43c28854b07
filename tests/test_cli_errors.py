"""``packed-ce`` on bad input: one line on stderr naming the flag, exit status 2, no traceback, no hub
look-up for a path, and a hub name that fails in seconds when the hub cannot be reached."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("datasets")  # the commands load their data with datasets
import datasets
import torch
import transformers

from packed_ce_demo.cli import main

CONVERSATION = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


@pytest.fixture
def no_hub(monkeypatch):
    """Any hub look-up fails the test (AssertionError is not a user error, so main lets it through)."""

    def refuse(name, *args, **kwargs):
        raise AssertionError(f"{name!r} was sent to a hub loader")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", refuse)
    real_load = datasets.load_dataset

    def load_local_only(path, *args, **kwargs):
        if path not in ("json", "parquet", "arrow") and not os.path.isdir(path):
            refuse(path)
        return real_load(path, *args, **kwargs)

    monkeypatch.setattr(datasets, "load_dataset", load_local_only)


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def files(tmp_path):
    good = write(tmp_path / "good.jsonl", json.dumps(CONVERSATION) + "\n")
    return {
        "good": good,
        "empty": write(tmp_path / "empty.jsonl", ""),
        "blank": write(tmp_path / "blank.json", "\n  \n"),
        "malformed": write(tmp_path / "bad.jsonl", json.dumps(CONVERSATION) + "\n\n" + '{"messages": [oops\n'),
        "no_messages": write(tmp_path / "other.jsonl", json.dumps({"text": "hello"}) + "\n"),
        "csv": write(tmp_path / "chats.csv", "a,b\n1,2\n"),
        "bad_config": write(tmp_path / "bad-model.json", json.dumps({"hidden_size": "wide"})),
        "bad_parquet": write(tmp_path / "chats.parquet", "not parquet"),
        "tokenized": write(tmp_path / "tokens.jsonl", json.dumps({"input_ids": [1, 2], "labels": [1, 2]}) + "\n"),
        "ids_only": write(tmp_path / "ids.jsonl", json.dumps({"input_ids": [1, 2]}) + "\n"),
        "sharegpt_roles": write(tmp_path / "roles.jsonl", json.dumps(
            {"messages": [{"role": "human", "content": "Hi"}, {"role": "gpt", "content": "Hello"}]}) + "\n"),
        "untrained": write(tmp_path / "untrained.jsonl",
                           json.dumps({"input_ids": [1, 2, 3], "labels": [-100, -100, -100]}) + "\n"),
        "both": write(tmp_path / "both.jsonl", json.dumps({**CONVERSATION, "input_ids": [1], "labels": [1]}) + "\n"),
        "zero_weights": write(tmp_path / "weights.jsonl", "".join(
            json.dumps({**CONVERSATION, "weight": 0.0}) + "\n" for _ in range(3))),
        "conversation_column": write(tmp_path / "conversation.jsonl",
                                     json.dumps({"conversation": CONVERSATION["messages"]}) + "\n"),
        "sharegpt_keys": write(tmp_path / "sharegpt.jsonl", json.dumps(
            {"messages": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}) + "\n"),
        "list_column": write(tmp_path / "masked.jsonl",
                             json.dumps({"input_ids": [1, 2], "labels": [1, 2], "mask": [1, 1]}) + "\n"),
        "no_data": folder(tmp_path / "no-data", {"notes.txt": "hello"}),
        "mixed": folder(tmp_path / "mixed", {"a.jsonl": json.dumps(CONVERSATION) + "\n", "b.parquet": ""}),
        "splits": saved_splits(tmp_path / "saved"),
    }


def folder(path, files):
    path.mkdir()
    for name, text in files.items():
        write(path / name, text)
    return str(path)


def saved_splits(path):
    datasets.DatasetDict({"test": datasets.Dataset.from_list([CONVERSATION])}).save_to_disk(str(path))
    return str(path)


# (arguments, the message's distinctive part); {name} is replaced by the path of that file.
CASES = [
    # Local paths that do not exist: refused at once, never looked up on a hub.
    (["pack", "--dataset", "missing/chats.jsonl"], "`--dataset` 'missing/chats.jsonl': no such file or folder"),
    (["pack", "--dataset", "./missing"], "`--dataset` './missing': no such file or folder"),
    (["pack", "--dataset", "chats.jsonl"], "`--dataset` 'chats.jsonl': no such file or folder"),
    (["pack", "--dataset", "/abs/path/to/data"], "no such file or folder"),
    (["pack", "--dataset", "{good}", "--tokenizer", "./no-tokenizer"], "`--tokenizer` './no-tokenizer': no such"),
    (["demo", "--model-config", "model.json"], "`--model-config` 'model.json': no such file or folder"),
    (["demo", "--tokenizer", "a/b/c"], "`--tokenizer` 'a/b/c': no such file or folder"),
    # Files that exist but hold no usable conversation.
    (["pack", "--dataset", "{empty}"], "is empty: it holds no conversation"),
    (["pack", "--dataset", "{blank}"], "is empty: it holds no conversation"),
    (["pack", "--dataset", "{malformed}"], "line 3: malformed JSON"),
    (["pack", "--dataset", "{csv}"], "is not a .json, .jsonl, .parquet or .arrow file"),
    (["pack", "--dataset", "{bad_parquet}"], "`--dataset` '{bad_parquet}' could not be loaded as Parquet: "),
    (["pack", "--dataset", "{no_data}"], "holds no .json, .jsonl, .parquet or .arrow file, nor a data set saved"),
    (["pack", "--dataset", "{mixed}"], "mixes json and parquet files: keep one format"),
    (["pack", "--dataset", "{splits}"], "has no split 'train'; its splits are ['test']"),
    (["pack", "--dataset", "{sharegpt_roles}"],
     "nothing to train, none of its 1 conversations has a target (1 without an assistant turn"),
    (["pack", "--dataset", "{untrained}"],
     "nothing to train, none of its 1 conversations has a target (0 without an assistant turn, 1 without"),
    (["pack", "--dataset", "{ids_only}"], "`--dataset` '{ids_only}' has 'input_ids' but no 'labels' column"),
    (["pack", "--dataset", "{both}"], "has both 'messages' and ['input_ids', 'labels']"),
    (["pack", "--dataset", "{no_messages}"], "has neither a 'messages' column nor 'input_ids' and 'labels'"),
    (["pack", "--dataset", "{conversation_column}"],
     "its columns are ['conversation']: its column 'conversation' holds conversations, name it 'messages'"),
    (["pack", "--dataset", "{sharegpt_keys}"],
     "`--dataset` row 0: `messages[0]` has ShareGPT's key(s) ['from', 'value'], not 'role' and 'content'"),
    # every weight 0: the trainers refuse the rows, so the command refuses to write them
    (["pack", "--dataset", "{zero_weights}"], "every weight of `--dataset` is 0, so nothing would train"),
    (["pack", "--dataset", "{tokenized}", "--tokenizer", "{good}"], "`--tokenizer` '{good}' is not used: `--dataset`"),
    (["pack", "--dataset", "{list_column}"], "`--dataset` column 'mask' holds list<item: int64>"),
    (["pack", "--num-proc", "0"], "argument --num-proc: '0' must be finite and > 0"),
    # Options out of range or of the wrong type (argparse, one line too).
    (["pack", "--max-length", "0"], "argument --max-length: '0' must be finite and > 0"),
    (["pack", "--max-length", "-1"], "argument --max-length: '-1' must be finite and > 0"),
    (["pack", "--max-length", "2.5"], "argument --max-length: '2.5' is not a int"),
    (["demo", "--lr", "nan"], "argument --lr: 'nan' must be finite and > 0"),
    (["demo", "--lr", "inf"], "argument --lr: 'inf' must be finite and > 0"),
    (["demo", "--steps", "0"], "argument --steps: '0' must be finite and > 0"),
    (["demo", "--rows-per-step", "x"], "argument --rows-per-step: 'x' is not a int"),
    (["pack", "--overflow", "wrap"], "argument --overflow: invalid choice: 'wrap'"),
    (["pack"], "the following arguments are required: --output"),
    (["launch"], "argument command: invalid choice: 'launch'"),
    # Checked by the library or the loaders, reported under the flag.
    (["pack", "--dataset", "{good}", "--max-length", "1", "--overflow", "split"], "`--max-length` must be an int >= 2"),
    (["demo", "--dataset", "{good}", "--model-config", "{bad_config}", "--steps", "1", "--rows-per-step", "1"],
     "`--model-config` '{bad_config}': "),
]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(argv) for argv, _ in CASES])
def test_user_errors_are_one_line_with_status_2(argv, message, tmp_path, capsys, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    paths = files(tmp_path)
    argv = [arg.format(**paths) for arg in argv]
    if argv[0] == "pack" and "--output" not in argv and argv != ["pack"]:
        argv += ["--output", str(tmp_path / "out")]
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's own errors
        status = exit.code
    captured = capsys.readouterr()
    # Progress bars of datasets may come first; the error is the one last line.
    lines = captured.err.strip().splitlines()
    assert status == 2, captured.err
    assert "Traceback" not in captured.err, captured.err
    assert [line for line in lines if "error" in line] == lines[-1:], captured.err
    assert lines[-1].startswith("packed-ce") and message.format(**paths) in lines[-1]
    assert re.search(r"--[a-z]|argument command", lines[-1]), lines[-1]  # names what to change
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "device, message",
    [("gpu0", "`--device` 'gpu0' is not a torch device"),
     pytest.param("cuda", "`--device` 'cuda': this machine has no CUDA GPU",
                  marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here"))],
)
def test_a_bad_device_is_one_line_before_any_data_is_read(device, message, capsys, monkeypatch):
    import packed_ce_demo

    def refuse(*args, **kwargs):
        raise AssertionError("the data were read before --device was checked")

    monkeypatch.setattr(packed_ce_demo, "run_demo", refuse)
    monkeypatch.setattr(packed_ce_demo, "offline_unless_reachable", refuse)
    status = main(["demo", "--device", device, "--dataset", "some/hub-name"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(lines) == 1, lines
    assert lines[0].startswith("packed-ce demo: error: ") and message in lines[0]


def test_a_folder_without_a_tokenizer_is_named(tmp_path, capsys):
    """A local folder goes to transformers' loader, whose message names no flag: it gets one."""
    paths = files(tmp_path)
    (tmp_path / "empty-folder").mkdir()
    status = main(["pack", "--dataset", paths["good"], "--tokenizer", str(tmp_path / "empty-folder"),
                   "--output", str(tmp_path / "out")])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and last.startswith(f"packed-ce pack: error: `--tokenizer` '{tmp_path / 'empty-folder'}': ")


@pytest.fixture
def hub_unreachable(monkeypatch):
    """No connection reaches the hub, and the offline switches the command sets are undone after
    the test."""
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(socket, "create_connection", refuse)
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)


@pytest.mark.parametrize("flag", ["--dataset", "--tokenizer"])
def test_a_hub_name_fails_at_once_when_the_hub_cannot_be_reached(flag, tmp_path, capsys, hub_unreachable,
                                                                 monkeypatch):
    """Offline, a hub name that is not in the local cache fails at once, saying what was looked for
    and how to point at a local file instead. Before, the hub clients retried with back-off (1, 2,
    4, 8, 8 s per file: 30 s); the retries' sleeps are counted, not the seconds (a loaded machine
    is slow either way)."""
    paths = files(tmp_path)
    argv = ["pack", "--output", str(tmp_path / "out"), "--dataset", paths["good"], flag, "nobody-xyz/not-cached-21"]
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    status = main(argv)
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 2 and slept == [], (status, slept)
    assert f"`{flag}` 'nobody-xyz/not-cached-21': not a local path, and not in the local hub cache" in last
    assert "hub is offline (unreachable" in last and "pass a local" in last


def test_help_answers_without_loading_torch():
    """`packed-ce --help` imports no heavy module (it took about 4 s when it loaded torch)."""
    code = (
        "import sys\n"
        "from packed_ce_demo.cli import build_parser\n"
        "build_parser().format_help()\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'datasets', 'triton') if m in sys.modules)\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
