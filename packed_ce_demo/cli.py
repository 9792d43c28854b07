"""The ``packed-ce`` console script: ``packed-ce demo`` and ``packed-ce pack``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

DATA_HELP = (
    "conversations in the messages format (a 'messages' column): a hub data set name, a local "
    ".json/.jsonl/.parquet/.arrow file, a folder of such files or a folder written by "
    "save_to_disk (default: the English chatterbot-corpus dialogues shipped with the "
    "chatterbot-corpus package, no network needed)"
)
PACK_DATA_HELP = DATA_HELP.replace(
    "conversations in the messages format (a 'messages' column)",
    "conversations in the messages format (a 'messages' column) or already tokenized "
    "('input_ids' and 'labels', e.g. of collators.tokenize_dataset; then no --tokenizer)",
)
TOKENIZER_HELP = (
    "a tokenizer with a chat template: hub name or local folder (default: the offline ChatML "
    "byte-level BPE of collators.load_default_tokenizer(), trained on the corpus and cached)"
)


# The library's names of the arguments the flags set, for its error messages.
LIBRARY_NAMES = {
    "`max_length`": "`--max-length`",
    "`overflow`": "`--overflow`",
    "`dataset`": "`--dataset`",
}


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (exit status 2, as argparse's)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive(kind):
    """An argparse type: a number of `kind` (int or float) that must be finite and > 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} must be finite and > 0")
        return value

    return parse


def _add_data_arguments(
    command: argparse.ArgumentParser, max_length: int, data_help: str = DATA_HELP
) -> None:
    """--dataset, --tokenizer and --max-length: what both commands tokenize and pack."""
    command.add_argument("--dataset", default=None, help=data_help)
    command.add_argument("--tokenizer", default=None, help=TOKENIZER_HELP)
    command.add_argument(
        "--max-length",
        type=_positive(int),
        default=max_length,
        help="tokens per packed row (default: %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="packed-ce",
        description="Packing-aware cross entropy: see that packed training equals unpacked "
        "per-sequence training, and pack data sets.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo",
        help="train a tiny model packed, padded and naive from the same weights and compare",
        description="Tokenize and pack the conversations, then train one tiny causal LM three ways "
        "from the same initial weights on the same conversations at every step: packed with the "
        "per-sequence loss (is_packed=True), padded with a plain-PyTorch per-sequence mean (the "
        "unpacked baseline), and packed with transformers' token mean (the naive way). Prints the "
        "per-step losses, the largest packed-vs-padded difference (must be <= 1e-5 in float32) "
        "and the throughputs; writes report.json and losses.png to --output-dir. Exits with "
        "status 1 if the difference is over the tolerance.",
    )
    _add_data_arguments(demo, max_length=512)
    demo.add_argument(
        "--model-config",
        default=None,
        help="the model: a JSON file of configuration fields ('model_type' defaults to llama, "
        "'vocab_size' to the tokenizer's) or a hub name whose configuration is used with random "
        "weights (default: a 2-layer Llama, hidden size 64)",
    )
    demo.add_argument(
        "--steps",
        type=_positive(int),
        default=12,
        help="optimiser steps of each run (default: %(default)s)",
    )
    demo.add_argument(
        "--rows-per-step",
        type=_positive(int),
        default=2,
        help="packed rows per step; the padded run gets their conversations (default: %(default)s)",
    )
    demo.add_argument(
        "--lr",
        type=_positive(float),
        default=1e-3,
        help="AdamW learning rate (default: %(default)s)",
    )
    demo.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="attention of the model (default: %(default)s)",
    )
    demo.add_argument(
        "--device",
        default=None,
        help="torch device, e.g. cpu or cuda (default: cuda if available, else cpu); the "
        "runs are float32 so that the comparison is exact",
    )
    demo.add_argument(
        "--output-dir",
        default="outputs/demo",
        help="where report.json and losses.png go (default: %(default)s)",
    )
    demo.add_argument(
        "--seed", type=int, default=0, help="weights and row order (default: %(default)s)"
    )
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    pack = commands.add_parser(
        "pack",
        help="tokenize and pack a data set to disk, print the packing statistics",
        description="Tokenize conversations with the tokenizer's chat template (assistant turns "
        "trained; skipped for tokenized data), pack them with best-fit-decreasing into rows of "
        "--max-length tokens, save the "
        "rows (input_ids, labels, seq_lengths; a weight and a source column as seq_weights and "
        "seq_sources, any other column as seq_<name>, one value per sequence) with "
        "datasets.Dataset.save_to_disk and print the packing statistics. Load the result with "
        "datasets.load_from_disk and collate it with collators.PackedCollator. Conversations "
        "with images (an 'images' or 'image' column) are tokenized with the processor that "
        "--tokenizer names and each row keeps its conversations' images (an 'images' column, "
        "collate with collators.VisionCollator); one longer than --max-length is dropped "
        "(--overflow drop) or refused, never cut.",
    )
    _add_data_arguments(pack, max_length=4096, data_help=PACK_DATA_HELP)
    pack.add_argument(
        "--num-proc",
        type=_positive(int),
        default=None,
        help="processes that tokenize the conversations, write the packed rows and save them "
        "(default: one)",
    )
    pack.add_argument(
        "--overflow",
        default="truncate",
        choices=["truncate", "drop", "split", "error"],
        help="what to do with a conversation longer than --max-length (default: %(default)s)",
    )
    pack.add_argument("--output", required=True, help="folder to save the packed data set to")
    pack.add_argument("--json", action="store_true", help="print the statistics as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``packed-ce``; returns the exit status (2: a user error, in one line)."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, TypeError, OSError, ImportError) as error:
        # Bad data, paths or options, a missing extra: the message names the problem and the
        # fix; a traceback would bury it.
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        for name, flag in LIBRARY_NAMES.items():
            message = message.replace(name, flag)
        print(f"packed-ce {args.command}: error: {message}", file=sys.stderr)
        return 2


def _run(args) -> int:
    # Imported here, not at the top: `packed-ce --help` answers without loading torch.
    import packed_ce_demo as demo
    from collators.data import local_path

    device = _device(args.device) if args.command == "demo" else None  # before any data is read

    # A local path is checked here, so that a missing one is never looked up on a hub; a hub
    # name fails in seconds when the hub cannot be reached (only the local cache is read).
    hub_names = [
        option
        for option in ("dataset", "tokenizer", "model_config")
        if getattr(args, option, None) is not None
        and local_path(getattr(args, option), "--" + option.replace("_", "-")) is None
    ]
    if hub_names:
        demo.offline_unless_reachable()
    if args.command == "demo":
        report = demo.run_demo(
            dataset=args.dataset,
            tokenizer=args.tokenizer,
            model_config=args.model_config,
            max_length=args.max_length,
            steps=args.steps,
            rows_per_step=args.rows_per_step,
            learning_rate=args.lr,
            attn_implementation=args.attn_implementation,
            device=device,
            seed=args.seed,
            output_dir=args.output_dir,
            progress=not args.no_progress,
        )
        print(demo.format_report(report))
        return 0 if report["passed"] else 1
    stats = demo.pack_to_disk(
        dataset=args.dataset,
        tokenizer=args.tokenizer,
        max_length=args.max_length,
        output=args.output,
        overflow=args.overflow,
        num_proc=args.num_proc,
    )
    if args.json:
        print(json.dumps(stats, indent=2))
    else:
        print(
            f"packed {stats['num_packed']:,} of {stats['num_conversations']:,} conversations "
            f"({stats['num_tokens']:,} tokens) into {stats['num_rows']:,} rows of "
            f"{stats['max_length']} tokens\n"
            f"efficiency  {stats['efficiency']:.2%} (real tokens / row capacity)\n"
            f"truncated   {stats['num_truncated']} ({stats['num_truncated_tokens']} tokens cut)\n"
            f"dropped     {stats['num_dropped']}\n"
            f"split       {stats['num_split']} (into {stats['num_split_pieces']} pieces)\n"
            f"no targets  {stats['num_without_targets']}\n"
            f"skipped     {stats['num_skipped_no_assistant']} (no assistant turn)\n"
            f"empty       {stats['num_empty']}\n"
            f"saved to    {stats['output']}"
        )
    return 0


def _device(name: str | None) -> str:
    """The device of ``--device`` (default: cuda if available, else cpu), checked to hold a tensor.

    Raises:
        ValueError naming ``--device``: not a torch device name (``gpu0``), or one this machine
            lacks (``cuda`` without a CUDA GPU, ``cuda:3`` on a machine with fewer GPUs).
    """
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(
            f"`--device` {name!r} is not a torch device: use cpu, cuda or cuda:<index>"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"`--device` {name!r}: this machine has no CUDA GPU (or torch was built without CUDA); "
            "use --device cpu"
        )
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError) as error:  # cuda:7 of 2 GPUs, mps elsewhere, ...
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"`--device` {name!r} cannot hold a tensor here ({reason}); use --device cpu"
        ) from None
    return name


if __name__ == "__main__":
    sys.exit(main())
