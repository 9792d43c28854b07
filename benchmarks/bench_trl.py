"""Whole trl steps: ``PackedSFTTrainer`` against trl's ``SFTTrainer``; the longest row that fits.

Four runs, each a trl ``train()`` on the same data from the same initial weights:

- ``packed``: ``PackedSFTTrainer`` with its defaults (the mean over conversations of each
  conversation's mean token loss, through ``packed_ce.fused_linear_cross_entropy``);
- ``stock``: trl's ``SFTTrainer`` with its stock ``loss_type="nll"`` (trl's chunked LM head, the
  token mean);
- ``packed_liger``, ``stock_liger``: the same with ``use_liger_kernel=True``: Liger-Kernel's
  RMSNorm, SwiGLU and RoPE kernels (trl 1.16 turns Liger's fused linear cross entropy off and
  keeps its own LM head, so the loss path of each trainer is unchanged);
- ``packed_all_rows`` (only when named in ``--runs``): ``packed`` with every row through the
  fused path's GEMMs (``drop_ignored_rows=False``: no host sync in the loss).

Every run: a model built from its config (Llama-shaped, or ``--model qwen3_5-2b`` a Qwen3.5 2B-like
hybrid; random init, bf16 on CUDA), trl's
``packing=True`` (``packing_strategy="bfd"``) and ``padding_free=True``, one packed row per step
(``per_device_train_batch_size=1``), trl's other defaults (AdamW, bf16 autocast, learning rate
2e-5), attention that keeps the conversations of a row apart: ``sdpa`` (transformers builds the
block-diagonal causal mask from the restarting ``position_ids``; rows of their exact length) or
``--attention flex_attention`` (rows padded to the row length, ``pad_to_multiple_of``, so that
nothing recompiles after the first step). Data: the synthetic multi-turn conversations of
``bench_training.py`` (its ``make_conversations`` and ``ChatShape``: a few exchanges, answers of a
few hundred tokens, only assistant turns are targets), given to trl already tokenized
(``input_ids``, ``labels``), which packs them best-fit-decreasing into rows of ``--row-length``.

``--adapter`` chooses what trains, the same for every run: ``full`` (default) every parameter;
``lora`` a LoRA adapter (``peft_config=LoraConfig(**LORA)``: r=16 on every linear layer) on the
bf16 model; ``qlora`` the same adapter on the model in 4 bits (bitsandbytes nf4, bf16 compute and
storage of what stays unquantized, the output embedding among it): the random bf16 weights are
saved once per model size under the temporary folder (``packed_ce_bench_checkpoints/``, reused
by every later run and probe) and loaded back with ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))``, as a released model is. ``--reverse`` makes the
runs in the reverse order (Liger's still last), so that two invocations alternate the order.

Two measurements (one shell call each on a GPU):

- throughput (default): per run ``--warmup`` steps, then ``--max-steps`` steady steps. Step time is
  the time between the ends of consecutive steps (CUDA events recorded when each optimiser step
  has been enqueued, read after training: no host sync added), so data loading and trl's own
  per-step work count. Reported: real tokens/s (no padding) over the steady steps, the median
  step, peak allocated memory (``torch.cuda.max_memory_allocated`` after a reset at the first
  step), and the objective check: on the first step, with the initial weights, each token's loss
  from the model's logits in float32, and from them the per-conversation mean and the token
  mean; ``packed`` must give the first and ``stock`` the second. ``--profile`` records a
  ``torch.profiler`` table of one more step after the timed ones, sorted by device time, with
  the share of packed-ce's own kernels (names containing ``_cross_entropy_kernel``,
  ``_targets`` or ``packed_ce``) in the step's device time, and the host waits of the step by
  the file that caused them (packed_ce, trl, transformers, ...). ``--sample-stacks`` samples the
  training thread's Python stack every 10 ms and reports, for each steady step slower than 1.5x
  the median (and for the median step, to compare), the stacks it was seen in most: what the
  host did while a step stalled (a compile, an autotune, a wait), without a profiler's overhead.
  ``--profile-steps`` runs every steady step under ``torch.profiler`` instead and reports, per
  step, its device and host milliseconds, its top kernels and its top host ops.
- ``--longest``: per run and model, the longest packed row that trains ``--probe-steps`` steps
  without running out of memory, with gradient checkpointing: ``--model 1b`` fully fine-tuned,
  ``--model 8b`` (Llama-3-8B shape) with LoRA (``peft_config=LoraConfig(...)``; ``--skip-lora``
  leaves it out). Each probe builds the model and the trainer, trains, and catches
  ``torch.OutOfMemoryError``; rows are padded to the probed length. Lengths double from
  ``--row-length`` until one fails, then bisect until the gap is below ``--resolution`` of the
  longest that fits, at most ``--max-probes`` probes per search. From the second fitting probe
  on, the line through the peak memory of the two longest that fit predicts where the device's
  memory runs out: the search goes there instead of doubling, and bisection splits there (where
  the line is right: 4 probes instead of about 9; the bracket, not the prediction, is the
  result). Attention: flex attention on
  CUDA unless ``--attention sdpa``: sdpa's dense ``(T, T)`` mask (and the additive copy sdpa
  makes of it) grows with the square of the row and would bound every trainer alike, and its
  dense attention makes a probe of 100k tokens take minutes; flex attention compiles at the
  first length and once more, for any length, at the second (torch.compile's automatic
  dynamic shapes), in each process.

Each throughput run runs in a subprocess of its own on CUDA: Liger patches transformers' Llama
module for the whole process, and every run then starts with an empty allocator. The searches
share one subprocess (Liger's last), so that flex attention compiles once, in two short
warm-up probes before the first search of each model: the probes follow one another while the
memory comes back after each (checked); where it does not, or the process dies, a fresh one goes
on. No run, search or probe starts after ``--seconds`` (a search: after its share of the time
left when it starts); what was left out is said in the results.

On a GPU machine, from the repository root (trl, datasets, liger-kernel and peft installed)::

    PYTHONPATH=. python benchmarks/bench_trl.py --out benchmarks/results           # ~4 min
    PYTHONPATH=. python benchmarks/bench_trl.py --longest --out benchmarks/results # <= --seconds
    PYTHONPATH=. python benchmarks/bench_trl.py --model tiny --device cpu          # CPU, ~1 min
    PYTHONPATH=. python benchmarks/bench_trl.py --adapter qlora --runs packed stock  # + bitsandbytes

Writes ``trl_steps_<model>_<device>.json`` (or ``trl_longest_...``; ``_lora`` or ``_qlora`` after
the model with ``--adapter``, then ``_reversed`` with ``--reverse``) and one JSON per run (as
soon as it ends) or search (``..._<run>_<device>.json``) under ``--out`` (default: a temporary
folder); ``make_tables.py`` renders them.

Dimensions: T tokens per row, V vocabulary, S sequences.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import harness
from bench_training import ChatShape, make_conversations

IGNORE_INDEX = harness.IGNORE_INDEX
DISTRIBUTIONS = (
    "torch", "triton", "transformers", "trl", "datasets", "accelerate", "peft", "liger-kernel",
    "bitsandbytes", "fla-core", "tilelang", "causal-conv1d", "mamba-ssm",
)  # fmt: skip
RUNS = {
    "packed": "PackedSFTTrainer (defaults: per-conversation mean, fused LM head + loss)",
    "stock": "trl SFTTrainer (stock nll: token mean, trl's chunked LM head)",
    "packed_liger": "PackedSFTTrainer, use_liger_kernel=True",
    "stock_liger": "trl SFTTrainer, use_liger_kernel=True",
    # not run by default: what the fused loss's one host sync (counting the rows with a target,
    # to leave the others out of the GEMMs) buys or costs inside a whole step
    "packed_all_rows": "PackedSFTTrainer, every row through the GEMMs (drop_ignored_rows=False)",
}
DEFAULT_RUNS = ("packed", "stock", "packed_liger", "stock_liger")
# Llama-3.2-1B and Llama-3-8B shapes; "tiny" runs on a CPU in seconds (its matrices' rows are
# one nf4 block of 64 values or more: bitsandbytes' CPU kernels take no shorter rows).
MODELS = {
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True,
        max_position_embeddings=1024,
    ),
    "1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
            high_freq_factor=4.0, original_max_position_embeddings=8192,
        ),
    ),
    "8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False, rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters=dict(rope_type="default", rope_theta=500000.0),
    ),
    # a Qwen3.5 2B-like hybrid: three gated-delta-rule layers (short convolution + delta rule) to
    # each attention layer, Qwen3.5's head shapes and vocabulary
    "qwen3_5-2b": dict(
        model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=24, layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=262144,
    ),
}  # fmt: skip
MODELS["qwen3_5-2b"]["layer_types"] *= MODELS["qwen3_5-2b"]["num_hidden_layers"] // 4
# The data of each model size: bench_training's shapes (the tiny one scaled down by 16).
CHATS = {
    "qwen3_5-2b": (ChatShape(), 4096),
    "tiny": (ChatShape(system_median=3, user_median=4, assistant_median=14, max_exchanges=4), 128),
    "1b": (ChatShape(), 4096),
    "8b": (ChatShape(), 4096),
}
LORA = dict(
    r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
)
ADAPTERS = ("full", "lora", "qlora")
# QLoRA's base model: 4-bit NormalFloat weights, dequantised to bf16 for each matrix product
QUANTIZATION = dict(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype="bfloat16"
)
# Kernels and ops of packed-ce's own path, by name, in a profile.
OWN_NAMES = ("_cross_entropy_kernel", "_targets", "packed_ce")
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
SCALAR_READ = "aten::_local_scalar_dense"
# The share of a device's memory the longest-row search predicts a row can fill.
CAPACITY_SHARE = 0.95
# A probe that leaves more than this allocated after its clean-up ends its process.
LEFTOVER_BYTES = 256 * harness.MiB


def log(message: str) -> None:
    print(f"[bench_trl {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --------------------------------------------------------------------------------------------
# Data, tokenizer, model, trainer


def make_dataset(model: str, row_length: int, rows: int, seed: int = 0):
    """Tokenized conversations (``input_ids``, ``labels``) of about ``rows`` packed rows of
    ``row_length`` tokens, the same for every run given the arguments."""
    from datasets import Dataset

    shape, max_conversation = CHATS[model]
    rng = np.random.default_rng(seed)
    conversations, tokens = [], 0
    while tokens < rows * row_length:
        batch = make_conversations(
            64, MODELS[model]["vocab_size"], shape, min(max_conversation, row_length), rng
        )
        conversations += batch
        tokens += sum(len(c["input_ids"]) for c in batch)
    return Dataset.from_list(conversations)


def make_tokenizer():
    """A three-token tokenizer: trl only needs its pad token (the data come tokenized)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        pad_token="<pad>", eos_token="<eos>", unk_token="<unk>",
    )  # fmt: skip


def build_model(model: str, attention: str, device: torch.device, quantized: bool = False):
    from transformers import AutoConfig, AutoModelForCausalLM

    if quantized:
        return load_quantized(model, attention, device)
    fields = dict(MODELS[model])
    # use_cache=False: with a cache transformers ignores the packed position_ids
    config = AutoConfig.for_model(
        fields.pop("model_type", "llama"), **fields, use_cache=False, attn_implementation=attention
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def quantized_checkpoint(model: str, device: torch.device) -> Path:
    """The folder of ``model``'s random bf16 weights (the same as :func:`build_model`'s on
    CUDA), saved on first use; later runs and processes load it again. The folder is named
    after the model's configuration too: a changed shape is never loaded from an old folder."""
    shape = hashlib.sha256(json.dumps(MODELS[model], sort_keys=True).encode()).hexdigest()
    folder = Path(tempfile.gettempdir()) / "packed_ce_bench_checkpoints" / f"{model}-{shape[:12]}"
    if (folder / "config.json").exists():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODELS[model], use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        weights = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    # written under a name of this process's own, then renamed: a folder under the final name
    # is whole (two benchmarks on two GPUs once wrote into one partial folder, and the second
    # rename found it gone)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    weights.save_pretrained(partial)
    del weights
    try:
        partial.rename(folder)
    except OSError:  # another process finished the same weights first: keep its folder
        shutil.rmtree(partial)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return folder


def load_quantized(model: str, attention: str, device: torch.device):
    """``model`` loaded in 4 bits (``QUANTIZATION``) as ``from_pretrained`` loads a released
    model: every linear layer of the decoder a ``bnb.nn.Linear4bit``, the rest in bf16."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    folder = quantized_checkpoint(model, device)
    return AutoModelForCausalLM.from_pretrained(
        folder,
        quantization_config=BitsAndBytesConfig(**QUANTIZATION),
        dtype=torch.bfloat16,
        device_map={"": str(device)},
        attn_implementation=attention,
    )


@dataclasses.dataclass(frozen=True)
class Job:
    """One trainer's set-up: what a worker process needs to build it."""

    run: str
    model: str
    device: str
    attention: str
    row_length: int
    warmup: int
    steps: int
    gradient_checkpointing: bool
    lora: bool = False
    quantized: bool = False  # QLoRA's 4-bit base model (with lora)
    profile: bool = False
    sample_stacks: bool = False
    profile_steps: bool = False
    pad_rows: bool = False  # pad every row to row_length (probes, flex attention)


class _Measured:
    """Trainer mixin: every step's loss (detached, read after training), and on the first step,
    before it, the reference losses of the objective check from the initial weights."""

    reference: dict | None = None
    step_losses: list

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.reference is None and self.want_reference:
            with self.accelerator.autocast():  # the step's mixed precision (bf16 on CUDA)
                self.reference = reference_losses(self.model, inputs)
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()  # the reference's logits are no step's
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_losses.append(loss)
        return loss


class _CountingCollator:
    """trl's collator, counting each batch's real tokens (before padding), in batch order."""

    def __init__(self, collator):
        self.collator, self.real_tokens = collator, []

    def __call__(self, examples):
        self.real_tokens.append(sum(len(example["input_ids"]) for example in examples))
        return self.collator(examples)


def make_trainer(
    job: Job, output_dir: str, *, rows: int, reference: bool = False, callbacks=()
):
    from trl import SFTConfig, SFTTrainer

    from packed_ce.integrations import PackedSFTTrainer

    device = torch.device(job.device)
    args = SFTConfig(
        output_dir=output_dir,
        max_steps=job.warmup + job.steps,
        per_device_train_batch_size=1,
        packing=True,
        packing_strategy="bfd",
        padding_free=True,
        max_length=job.row_length,
        pad_to_multiple_of=job.row_length if job.pad_rows else None,
        gradient_checkpointing=job.gradient_checkpointing,
        use_liger_kernel=job.run.endswith("_liger"),
        bf16=device.type == "cuda",
        use_cpu=device.type == "cpu",
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    dataset = make_dataset(job.model, job.row_length, rows)
    extra = {}
    if job.lora:
        from peft import LoraConfig

        extra["peft_config"] = LoraConfig(**LORA)
    model = build_model(job.model, job.attention, device, job.quantized)
    base = PackedSFTTrainer if job.run.startswith("packed") else SFTTrainer
    measured = type(f"Measured{base.__name__}", (_Measured, base), {})
    measured.want_reference = reference
    trainer = measured(
        model=model,
        args=args,
        train_dataset=dataset,
        processing_class=make_tokenizer(),
        callbacks=list(callbacks),
        **extra,
    )
    if job.run == "packed_all_rows":
        from packed_ce import ChunkOptions
        from packed_ce.integrations import apply_packed_loss

        # after the trainer: the packed forward then wraps trl's fused head, not the other way
        # round, so the objective check may run the decoder by itself with gradients (flex)
        apply_packed_loss(
            trainer.model, fused_linear=True,
            fused_linear_options=ChunkOptions(drop_ignored_rows=False),
        )
    trainer.step_losses = []
    trainer.data_collator = _CountingCollator(trainer.data_collator)
    return trainer


# --------------------------------------------------------------------------------------------
# The objective check


def reference_losses(model, batch: dict, chunk: int = 1024) -> dict:
    """Each target's loss of one padding-free batch ``(1, T)`` in float32 from the model's
    logits (computed ``chunk`` rows at a time), and the two means it gives: per conversation
    (each conversation's mean, averaged over conversations with a target) and per token."""
    # transformers' compiled flex attention is specialised on the grad mode: under no_grad it
    # would compile a second time (tens of seconds); its graph is dropped at once here
    with torch.set_grad_enabled(model.config._attn_implementation == "flex_attention"):
        hidden = model.get_decoder()(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
        ).last_hidden_state[0].detach()  # (T, H)
    with torch.no_grad():
        return _means(hidden, model.get_output_embeddings(), batch, chunk)


def _means(hidden: torch.Tensor, head, batch: dict, chunk: int) -> dict:
    positions, labels = batch["position_ids"][0], batch["labels"][0]
    # token t predicts t + 1 of its own conversation (trl's collator ignores each first label)
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:-1] = torch.where(positions[1:] == 0, IGNORE_INDEX, labels[1:])
    losses = torch.cat(
        [
            F.cross_entropy(head(h).float(), t, ignore_index=IGNORE_INDEX, reduction="none")
            for h, t in zip(hidden.split(chunk), targets.split(chunk))
        ]
    ).double()  # (T,)
    valid = (targets != IGNORE_INDEX).double()
    sequence = (positions == 0).cumsum(0) - 1  # (T,) conversation index
    count = int(sequence[-1]) + 1
    sums = torch.zeros(count, dtype=torch.float64, device=losses.device)
    sums.index_add_(0, sequence, losses * valid)
    targets_per = torch.zeros_like(sums).index_add_(0, sequence, valid)
    has = targets_per > 0
    return {
        "conversations": int(has.sum()),
        "targets": int(valid.sum()),
        "per_conversation_mean": (sums[has] / targets_per[has]).mean().item(),
        "token_mean": (losses * valid).sum().item() / valid.sum().item(),
    }


def objective_check(run: str, first_loss: float, reference: dict, tolerance: float) -> dict:
    """``packed`` must give the per-conversation mean and ``stock`` the token mean (within
    ``tolerance``, relative, and closer to it than to the other mean)."""
    expected, other = ("per_conversation_mean", "token_mean")
    if run.startswith("stock"):
        expected, other = other, expected
    to_expected = abs(first_loss - reference[expected]) / abs(reference[expected])
    to_other = abs(first_loss - reference[other]) / abs(reference[other])
    return reference | {
        "first_step_loss": first_loss,
        "expected": expected,
        "rel_diff_expected": to_expected,
        "rel_diff_other": to_other,
        # how far apart the two objectives are on this batch: what the check can tell apart
        "separation": abs(reference["per_conversation_mean"] - reference["token_mean"])
        / abs(reference["token_mean"]),
        "tolerance": tolerance,
        "passed": to_expected <= tolerance and to_expected < to_other,
    }


# --------------------------------------------------------------------------------------------
# Throughput


class StackSampler:
    """A thread that reads every other thread's Python stack every ``interval`` seconds, each
    sample filed under the step running then (``step()``): where the host spends a slow step.
    Every thread, not the training one alone: the backward of a CUDA step runs its Python
    (autograd Functions' backward, the kernels they launch) in autograd's device thread. A thread
    idle in ``threading``'s waits (loggers, loaders) is left out."""

    IDLE = ("threading.py", "queue.py", "selectors.py")

    def __init__(self, step: Callable[[], int], interval: float = 0.01, depth: int = 16):
        self.step, self.interval, self.depth = step, interval, depth
        self.samples: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._main = threading.get_ident()  # the thread that trains: the one building this

    def _run(self) -> None:
        own = threading.get_ident()
        while not self._stop.wait(self.interval):
            step = self.step()
            for thread, frame in sys._current_frames().items():
                if thread == own or frame.f_code.co_filename.endswith(self.IDLE):
                    continue
                names = [] if thread == self._main else [f"thread {thread}"]
                while frame is not None and len(names) < self.depth:  # innermost first
                    code = frame.f_code
                    path = "/".join(Path(code.co_filename).parts[-2:])
                    names.append(f"{path}:{frame.f_lineno} {code.co_name}")
                    frame = frame.f_back
                self.samples[step][" < ".join(names)] += 1

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, seconds: list[float], steady: slice, top: int = 10) -> list[dict]:
        """The steady steps slower than 1.5x their median, and the median step: each with its
        sample count and its ``top`` most frequent stacks (innermost frame first; another
        thread's led by its id)."""
        steps = range(len(seconds))[steady]
        if not steps:
            return []
        median = statistics.median(seconds[i] for i in steps)
        typical = min(steps, key=lambda i: abs(seconds[i] - median))
        chosen = [i for i in steps if seconds[i] > 1.5 * median or i == typical]
        return [
            {
                "step": i,
                "seconds": seconds[i],
                "samples": sum(self.samples[i].values()),
                "top": [[stack, n] for stack, n in self.samples[i].most_common(top)],
            }
            for i in chosen
        ]


class StepClock:
    """Trainer callback: an event at the start of training and at the end of every optimiser
    step (CUDA events, read after training; the host clock off CUDA), a profile of one step, and
    with ``sample_stacks`` the host's stacks during every step (:class:`StackSampler`)."""

    def __init__(
        self,
        device: torch.device,
        profile_step: int | None,
        sample_stacks: bool = False,
        profile_from: int | None = None,
    ):
        from transformers import TrainerCallback

        self.device, self.profile_step, self.marks, self.profiler = device, profile_step, [], None
        self.profile_wall = None
        self.sampler = StackSampler(self.running_step) if sample_stacks else None
        # profile_from: every step from this one on runs under the profiler, each in a range
        # "step <i>" (profile_by_step reads them)
        self.profile_from, self.step_range = profile_from, None
        # Triton kernels compiled during the run: (steps done by then, the kernel and its
        # specialisation), so that a compile in a steady step is seen and named
        self.compiles: list[tuple[int, str]] = []
        clock = self
        try:
            import triton

            def compiled(*args, **kwargs):
                clock.compiles.append((clock.running_step(), str(kwargs.get("repr"))[:300]))

            triton.knobs.runtime.jit_post_compile_hook = compiled
        except (ImportError, AttributeError):  # a Triton without the hook: nothing recorded
            pass

        class Callback(TrainerCallback):  # a TrainerCallback built here: the import is lazy
            def on_train_begin(self, args, state, control, **kwargs):
                if clock.sampler is not None:
                    clock.sampler.start()

            def on_step_begin(self, args, state, control, **kwargs):
                if state.global_step == 0:
                    clock.mark()
                if state.global_step in (clock.profile_step, clock.profile_from):
                    clock.start_profile()
                if clock.profile_from is not None and state.global_step >= clock.profile_from:
                    clock.step_range = torch.profiler.record_function(f"step {state.global_step}")
                    clock.step_range.__enter__()

            def on_step_end(self, args, state, control, **kwargs):
                clock.mark()
                if clock.step_range is not None:
                    clock.step_range.__exit__(None, None, None)
                    clock.step_range = None
                if state.global_step - 1 == clock.profile_step:
                    clock.stop_profile()

            def on_train_end(self, args, state, control, **kwargs):
                if clock.sampler is not None:
                    clock.sampler.stop()
                if clock.profile_from is not None and clock.profiler is not None:
                    clock.stop_profile()

        self.callback = Callback()

    def running_step(self) -> int:
        """The step running now: marks[0] opens step 0, marks[i + 1] closes step i."""
        return max(len(self.marks) - 1, 0)

    def mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Seconds of each step, from the end of the one before (the first: from its start)."""
        harness.synchronize(self.device)
        if self.device.type == "cuda":
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def start_profile(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        harness.synchronize(self.device)
        # Python frames (with_stack) name the origin of each host wait, which only CUDA has. Off
        # CUDA they are left out: the profiler keeps frame names as pointers into code objects,
        # and the Triton interpreter frees some within the profiled step, so key_averages()
        # once failed to decode them in the CPU test (UnicodeDecodeError).
        stacks = self.device.type == "cuda" and self.profile_from is None  # every step: no stacks
        self.profiler = profile(activities=activities, with_stack=stacks)
        self.profiler.start()
        self.profile_wall = time.perf_counter()

    def stop_profile(self) -> None:
        harness.synchronize(self.device)  # the step's kernels end inside the profile
        self.profile_wall = time.perf_counter() - self.profile_wall
        self.profiler.stop()


def profile_by_step(profiler, seconds: list[float], top: int = 8) -> list[dict]:
    """Per profiled step (the ranges "step <i>"): its seconds, the device time of its kernels,
    the ``top`` kernels by device time and the ``top`` ops by self host time. A step slower
    than the others with the same kernel time stalled on the host (the ops say where); one
    whose kernels took longer stalled on the device (the kernels say which)."""
    events = profiler.events()
    ranges = {}  # step -> its widest range (a range may be recorded more than once)
    for e in events:
        if e.name.startswith("step ") and e.name.split()[1].isdigit():
            index, span = int(e.name.split()[1]), e.time_range
            if index not in ranges or span.elapsed_us() > ranges[index].elapsed_us():
                ranges[index] = span
    steps = []
    for index, span in sorted(ranges.items(), key=lambda item: item[0]):
        inside = [
            e for e in events
            if span.start <= e.time_range.start <= span.end and not e.name.startswith("step ")
        ]  # fmt: skip
        kernels, host = collections.Counter(), collections.Counter()
        for event in inside:
            host[event.name] += event.self_cpu_time_total
            for kernel in event.kernels:
                kernels[kernel.name[:120]] += kernel.duration
        steps.append({
            "step": index,
            "seconds": seconds[index] if index < len(seconds) else None,
            "device_ms": sum(kernels.values()) / 1e3,
            "host_ms": sum(host.values()) / 1e3,
            "kernels_ms": [[k, round(v / 1e3, 2)] for k, v in kernels.most_common(top)],
            "host_ops_ms": [[k, round(v / 1e3, 2)] for k, v in host.most_common(top)],
        })  # fmt: skip
    return steps


ORIGINS = ("packed_ce", "trl", "transformers", "accelerate", "peft", "liger_kernel")


def _origin(event) -> str:
    """The package whose code made ``event`` (for packed_ce, the frame itself): the innermost
    Python frame above it outside torch (with ``with_stack`` the profiler records frames as
    events named ``path(line): function``, the path relative to its ``sys.path`` entry, e.g.
    ``packed_ce/fused_linear.py(80): fused_linear_cross_entropy``)."""
    node = event.cpu_parent
    while node is not None:
        name = node.name
        if ".py(" in name and not name.startswith("torch/"):
            package = name.split("/", 1)[0] if "/" in name.split("(", 1)[0] else None
            if package == "packed_ce":  # which part: the loss, or the trainer's metrics
                return name
            if package in ORIGINS:
                return package
            if name.startswith("bench_trl.py("):
                return "bench_trl (the profiler's own wait)"
            return "other"
        node = node.cpu_parent
    return "unknown"


def _packed_ce_names() -> tuple[set[str], set[str]]:
    """The Triton kernels (``*_kernel``) and autograd Functions packed_ce's loaded modules
    define: a profile names kernels and backward nodes after them."""
    from triton.runtime.jit import KernelInterface

    kernels, functions = set(), set()
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "packed_ce" or module is None:
            continue
        for attribute, value in vars(module).items():
            if isinstance(value, KernelInterface) and attribute.endswith("_kernel"):
                kernels.add(attribute)
            elif isinstance(value, type) and issubclass(value, torch.autograd.Function):
                if value.__module__.startswith("packed_ce"):
                    functions.add(value.__name__)
    return kernels, functions


def profile_summary(profiler, wall_seconds: float, device: torch.device) -> dict:
    """The profiled step's table (by self device time on CUDA, self CPU time off it), the share
    of packed-ce's own kernels in the step's device time, the device time of packed_ce's whole
    path, and the step's host waits by origin."""
    from torch.autograd import DeviceType

    averages = profiler.key_averages()
    on_device = device.type == "cuda"
    kernels = [e for e in averages if on_device and e.device_type != DeviceType.CPU]
    device_us = sum(e.self_device_time_total for e in kernels)
    # the names, and every Triton kernel of packed_ce (the row scaling, the value checks
    # and the normaliser too)
    own_kernels, functions = _packed_ce_names()
    names = (*OWN_NAMES, *sorted(own_kernels))
    own = [e for e in kernels if any(name in e.key for name in names)]
    own_us = sum(e.self_device_time_total for e in own)
    # packed_ce's whole path with the PyTorch kernels and GEMMs it launches: its outermost
    # Python frames (the forward) and its autograd nodes (the backward, on autograd's thread)
    path_us = 0.0
    for event in profiler.events() if on_device else ():
        if event.name.startswith("packed_ce/"):
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("packed_ce/"):
                parent = parent.cpu_parent
            if parent is None:  # outermost
                path_us += event.device_time_total
        elif event.name.startswith("autograd::engine::evaluate_function: ") and any(
            event.name.endswith(f"{function}Backward") for function in functions
        ):
            path_us += event.device_time_total
    # host waits (the runtime's synchronize calls) and reads of a device value (.item(),
    # bool(), float(): each one waits), by the package whose code made them
    waits: dict[str, int] = {}
    reads: dict[str, int] = {}
    for event in profiler.events():
        counts = waits if event.name in HOST_WAITS else reads if event.name == SCALAR_READ else None
        if counts is not None:
            origin = _origin(event)
            counts[origin] = counts.get(origin, 0) + 1
    sort = "self_device_time_total" if on_device else "self_cpu_time_total"
    return {
        "wall_ms": wall_seconds * 1e3,
        "device_ms": device_us / 1e3,
        "own_names": names,
        "own_kernels": {e.key: e.self_device_time_total / 1e3 for e in own},
        "own_ms": own_us / 1e3,
        "own_share_of_device_time": own_us / device_us if device_us else None,
        "packed_ce_path_ms": path_us / 1e3,
        "host_waits_by_origin": waits,
        "scalar_reads_by_origin": reads,
        "table": averages.table(sort_by=sort, row_limit=40, max_name_column_width=70),
    }


def throughput_run(job: Job) -> dict:
    """One run: ``warmup + steps`` trl steps (one more, profiled, with ``job.profile``)."""
    device = torch.device(job.device)
    profile_step = job.warmup + job.steps if job.profile else None
    clock = StepClock(
        device, profile_step, job.sample_stacks, job.warmup if job.profile_steps else None
    )
    if job.profile:
        job = dataclasses.replace(job, steps=job.steps + 1)
    with tempfile.TemporaryDirectory() as output_dir:
        log(f"{job.run}: building the model and the trainer ...")
        # rows for every step and as many more, to draw from (as a data set larger than the
        # run would be); best-fit-decreasing leaves a part-filled row per 1000 conversations
        rows = 2 * (job.warmup + job.steps) + 2
        trainer = make_trainer(
            job, output_dir, rows=rows, reference=True, callbacks=[clock.callback]
        )
        log(f"{job.run}: training {job.warmup} + {job.steps} steps ...")
        trainer.train()
        seconds = clock.seconds()
    losses = [loss.item() for loss in trainer.step_losses]
    tokens = trainer.data_collator.real_tokens[: len(seconds)]
    timed = slice(job.warmup, job.warmup + job.steps - (1 if job.profile else 0))
    steady, steady_tokens = seconds[timed], tokens[timed]
    parameters = sum(p.numel() for p in trainer.model.parameters())
    bf16 = device.type == "cuda" or job.quantized  # a 4-bit model computes in bf16 on a CPU too
    tolerance = 2e-3 if bf16 else 1e-4  # bf16 (8 significant bits) / fp32
    result = {
        "run": job.run,
        "label": RUNS[job.run],
        "job": dataclasses.asdict(job),
        "trainer": type(trainer).__mro__[2].__name__,
        "parameters": parameters,
        "trainable_parameters": sum(
            p.numel() for p in trainer.model.parameters() if p.requires_grad
        ),
        "optimizer": str(trainer.args.optim),
        "warmup_seconds": seconds[: job.warmup],
        "step_seconds": steady,
        # Triton compiles during the steady steps: [step, kernel] (a step slowed by a compile)
        "steady_compiles": [list(c) for c in clock.compiles if job.warmup <= c[0] < len(seconds)],
        "warmup_compiles": sum(1 for c in clock.compiles if c[0] < job.warmup),
        "step_real_tokens": steady_tokens,
        "losses": losses,
        "real_tokens_per_step": statistics.fmean(steady_tokens) if steady_tokens else None,
        # every steady token over every steady second: what a long run gets
        "tokens_per_second": sum(steady_tokens) / sum(steady) if steady else None,
        "check": objective_check(job.run, losses[0], trainer.reference, tolerance),
    }
    if steady:
        result |= harness.summarize(steady, unit="seconds")
    if device.type == "cuda":
        result["peak_gib"] = torch.cuda.max_memory_allocated() / harness.GiB
        result["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / harness.GiB
    if clock.sampler is not None:
        result["stalled_steps"] = clock.sampler.report(seconds, timed)
    if job.profile_steps:
        result["steps_profiled"] = profile_by_step(clock.profiler, seconds)
    if device.type == "cuda":  # cudaMalloc retries: the allocator freed its cache and waited
        result["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries")
    if job.profile:
        result["profile"] = profile_summary(clock.profiler, clock.profile_wall, device)
        print(result["profile"]["table"], flush=True)
    log(
        f"{job.run}: {result['tokens_per_second'] or 0:,.0f} real tokens/s, median step "
        f"{result.get('median_seconds', float('nan')):.3f} s, peak "
        f"{result.get('peak_gib', float('nan')):.1f} GiB, first-step loss {losses[0]:.5f} "
        f"({result['check']['expected']}: {'passed' if result['check']['passed'] else 'FAILED'})"
    )
    return result


# --------------------------------------------------------------------------------------------
# The longest row that fits


def next_length(
    fits: list[int], fails: list[int], start: int, limit: int, resolution: float,
    predicted: float | None = None,
):  # fmt: skip
    """The next row length to probe, or None when the search is over: doubling from ``start``
    until a length fails, then bisecting (multiples of 1024 tokens) until the gap between the
    longest that fits and the shortest that fails is at most ``resolution`` of the first.

    ``predicted`` (the length at which the memory of the fitting probes reaches the device's,
    :func:`predicted_length`) steers both phases: instead of doubling the search goes to it, and
    the bisection splits there instead of halfway, kept at least one gap inside the bracket. A
    prediction outside the bracket is ignored (plain doubling or halving), and every probe
    narrows the bracket, so a wrong prediction costs probes, not the result."""
    longest = max(fits, default=None)
    shortest_fail = min(fails, default=None)
    if longest is None:
        if shortest_fail is None:
            return start
        half = shortest_fail // 2  # the start fails: halve, down to 1024 tokens
        return half if half >= 1024 else None
    gap = max(1024, resolution * longest)
    step = max(1024, int(gap) // 1024 * 1024)  # a probe this far from the bracket's end ends it
    if shortest_fail is None:
        if longest >= limit:
            return None
        length = 2 * longest
        if predicted is not None and predicted > longest:
            length = max(int(predicted) // 1024 * 1024, longest + step)
        return min(length, limit)  # the limit itself is probed last
    if shortest_fail - longest <= gap:
        return None
    middle = (longest + shortest_fail) // 2 // 1024 * 1024
    low, high = longest + step, shortest_fail - step
    if predicted is not None and longest < predicted < shortest_fail and low <= high:
        middle = min(max(int(predicted) // 1024 * 1024, low), high)
    return middle if longest < middle < shortest_fail else None


def predicted_length(probes: list[dict], capacity_gib: float | None) -> float | None:
    """The row length at which peak memory reaches ``capacity_gib``, on the line through the
    peaks of the two longest probes that fitted (with gradient checkpointing and flex attention
    every activation grows with the row), or None without two such probes or a device."""
    fitted = sorted(
        (p["row_length"], p["peak_gib"]) for p in probes if p["status"] == "fits" and "peak_gib" in p
    )  # fmt: skip
    if capacity_gib is None or len(fitted) < 2:
        return None
    (short, short_gib), (long, long_gib) = fitted[-2:]
    per_token = (long_gib - short_gib) / (long - short)
    if per_token <= 0:
        return None
    return long + (capacity_gib - long_gib) / per_token


def is_out_of_memory(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, torch.OutOfMemoryError) or (
        isinstance(error, RuntimeError)
        and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)
    )


def probe(job: Job) -> dict:
    """Builds the model and trainer for one row length and trains ``job.steps`` steps."""
    device = torch.device(job.device)
    start = time.perf_counter()
    outcome: dict = {"row_length": job.row_length}
    clock = StepClock(device, None)
    trainer = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        with tempfile.TemporaryDirectory() as output_dir:
            # every row is padded to the probed length: a part-filled one costs as much
            trainer = make_trainer(
                job, output_dir, rows=job.steps + 2, callbacks=[clock.callback]
            )
            outcome["setup_seconds"] = time.perf_counter() - start
            trainer.train()
        outcome["status"] = "fits"
        outcome["step_seconds"] = clock.seconds()
        outcome["real_tokens"] = trainer.data_collator.real_tokens[: job.steps]
    except Exception as error:  # noqa: BLE001 - every failure is a result of the probe
        outcome["status"] = "oom" if is_out_of_memory(error) else "error"
        outcome["error"] = harness.error_text(error)
    # the error's traceback held the trainer's frames; both are gone past the except clause
    trainer = None
    gc.collect()
    if device.type == "cuda":
        outcome["peak_gib"] = torch.cuda.max_memory_allocated() / harness.GiB
        torch.cuda.empty_cache()
        outcome["left_allocated_bytes"] = torch.cuda.memory_allocated()
    outcome["seconds"] = time.perf_counter() - start
    return outcome


def expected_seconds(probes: list[dict], length: int, attention: str) -> float:
    """A probe's seconds at ``length`` from the longest that fitted: its set-up, and its last
    step scaled by the length (sdpa's dense attention: by its square)."""
    fitted = [p for p in probes if p["status"] == "fits" and p.get("step_seconds")]
    if not fitted:
        return 0.0
    longest = max(fitted, key=lambda p: p["row_length"])
    power = 2 if attention == "sdpa" else 1
    steps = len(longest["step_seconds"])
    scale = (length / longest["row_length"]) ** power
    return longest["setup_seconds"] + steps * longest["step_seconds"][-1] * scale


def search(job: Job, state: dict, limit: int, resolution: float, max_probes: int, deadline):
    """Probes in this process until the search ends, ``max_probes`` are made, the next probe
    would end past ``deadline`` (time.time()), or a probe leaves memory allocated (then
    ``state["fresh_process"]`` asks for another process). Updates and returns ``state``."""
    state["fresh_process"] = False
    device = torch.device(job.device)
    capacity_gib = None
    if device.type == "cuda":
        # what the allocator can reach: the device's memory less the CUDA context and the
        # cached blocks no allocation of the failing size fits in (a guess the bracket corrects)
        capacity_gib = CAPACITY_SHARE * torch.cuda.get_device_properties(device).total_memory
        capacity_gib /= harness.GiB
    while len(state["probes"]) < max_probes:
        fits = [p["row_length"] for p in state["probes"] if p["status"] == "fits"]
        fails = [p["row_length"] for p in state["probes"] if p["status"] == "oom"]
        if any(p["status"] == "error" for p in state["probes"]):
            state["stopped"] = "a probe failed with an error other than out of memory"
            return state
        predicted = predicted_length(state["probes"], capacity_gib)
        length = next_length(fits, fails, job.row_length, limit, resolution, predicted)
        if length is None:
            state["stopped"] = "done" if fails else f"reached --max-row {limit}"
            return state
        expected = expected_seconds(state["probes"], length, job.attention)
        if time.time() + expected > deadline:
            state["stopped"] = f"time: a probe at {length} tokens would take about {expected:.0f} s"
            return state
        log(f"{job.model} {job.run}: probing rows of {length} tokens ...")
        outcome = probe(dataclasses.replace(job, row_length=length))
        state["probes"].append(outcome)
        error = f", {outcome['error']}" if "error" in outcome else ""
        log(f"{job.model} {job.run}: {length} tokens: {outcome['status']} "
            f"({outcome['seconds']:.0f} s{error})")  # fmt: skip
        if outcome.get("left_allocated_bytes", 0) > LEFTOVER_BYTES:
            state["fresh_process"] = True
            return state
    state["stopped"] = f"--max-probes {max_probes}"
    return state


def search_all(task: dict, save) -> dict:
    """The searches of ``task["jobs"]`` one after the other in this process, each until its
    share of the time left (what is left over passes on); ``save(states)`` after each probe's
    search step, so that a process that dies leaves what it found. Stops early, with
    ``fresh_process``, when memory did not come back.

    With flex attention, before the first search of each model, two short probes (1024 and 2048
    tokens, one step) compile flex attention for a fixed and then for any row length; without
    them the first search would spend its share compiling (98 s of 120 on an H100)."""
    states, warmups, warmed = task["states"], [], None
    pending = [Job(**fields) for fields in task["jobs"]]
    pending = [job for job in pending if not states[search_key(job)].get("stopped")]
    for index, job in enumerate(pending):
        key = search_key(job)
        if job.attention == "flex_attention" and job.model != warmed:
            for length in (1024, 2048):
                outcome = probe(dataclasses.replace(job, row_length=length, steps=1))
                warmups.append(outcome | {"model": job.model, "run": job.run})
                log(f"{job.model} {job.run}: warm-up at {length} tokens: {outcome['status']} "
                    f"({outcome['seconds']:.0f} s)")  # fmt: skip
            warmed = job.model
        deadline = time.time() + (task["deadline"] - time.time()) / (len(pending) - index)
        states[key]["in_progress"] = True
        save(states, warmups)
        state = search(
            job, states[key], task["limit"], task["resolution"], task["max_probes"], deadline
        )
        state.pop("in_progress", None)
        save(states, warmups)
        if state["fresh_process"]:
            return {"states": states, "warmups": warmups, "fresh_process": True}
    return {"states": states, "warmups": warmups, "fresh_process": False}


def search_key(job: Job) -> str:
    return f"{job.model}_{job.run}"


# --------------------------------------------------------------------------------------------
# Driver: one process per run or search


def run_worker(task: dict, isolate: bool) -> dict:
    """``task`` in a subprocess of this script (``isolate``) or here; its result (what a
    process that died had saved, with ``"died"``)."""
    if not isolate:
        return worker(task)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "task.json"
        path.write_text(json.dumps(task))
        done = subprocess.run([sys.executable, __file__, "--worker", str(path)], check=False)
        result_path = path.with_suffix(".result.json")
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
        if done.returncode != 0:
            result["died"] = f"the worker process ended with status {done.returncode}"
        return result or {"error": f"the worker process ended with status {done.returncode}"}


def worker(task: dict, result_path: Path | None = None) -> dict:
    try:
        if task["kind"] == "environment":
            return harness.environment(torch.device(task["device"]), DISTRIBUTIONS)
        if task["kind"] == "throughput":
            return throughput_run(Job(**task["job"]))

        def save(states, warmups):
            if result_path is not None:
                answer = {"states": states, "warmups": warmups, "fresh_process": False}
                harness.write_json(result_path, answer)

        return search_all(task, save)
    except Exception as error:  # noqa: BLE001 - reported in the results
        import traceback

        traceback.print_exc()
        return {"error": harness.error_text(error)}


def run_throughput(args, jobs: list[Job], deadline: float, out: Path, slug: str) -> dict:
    runs, skipped = {}, {}
    for job in jobs:
        if time.time() > deadline:
            skipped[job.run] = f"not started: past --seconds {args.seconds:.0f}"
            log(f"{job.run}: {skipped[job.run]}")
            continue
        task = {"kind": "throughput", "device": args.device, "job": dataclasses.asdict(job)}
        runs[job.run] = run_worker(task, args.isolate)
        if "died" in runs[job.run]:
            runs[job.run] = {"error": runs[job.run]["died"]}
        name = f"trl_steps_{job.model}{name_suffix(args)}_{job.run}_{slug}.json"
        harness.write_json(out / name, runs[job.run])
    # in the order of RUNS, whatever order they ran in
    return {"runs": {run: runs[run] for run in RUNS if run in runs}, "skipped_runs": skipped}


def name_suffix(args) -> str:
    """What the result files' names add after the model: ``_<adapter>`` for ``--adapter`` other
    than full fine-tuning, ``_reversed`` for ``--reverse``."""
    adapter = "" if args.adapter == "full" else f"_{args.adapter}"
    return adapter + ("_reversed" if args.reverse else "")


def run_longest(args, jobs: list[Job], deadline: float, out: Path, slug: str) -> dict:
    """Every search in one worker process (Liger's last), each until its share of the time
    left when it starts (:func:`search_all`). A fresh process goes on where memory did not
    come back after a probe, or the process died (the search it was in stops there)."""
    states = {search_key(job): {"probes": []} for job in jobs}
    warmups = []
    while any(not state.get("stopped") for state in states.values()):
        task = {
            "kind": "searches", "device": args.device, "states": states,
            "jobs": [dataclasses.asdict(job) for job in jobs], "deadline": deadline,
            "limit": args.max_row, "resolution": args.resolution, "max_probes": args.max_probes,
        }  # fmt: skip
        answer = run_worker(task, args.isolate)
        states = answer.get("states", states)
        warmups += answer.get("warmups", [])
        problem = answer.get("died") or answer.get("error")
        if problem is not None:
            # the search the process was in stops; the others go on in a fresh one
            current = [k for k, s in states.items() if s.pop("in_progress", False)]
            for key in current or [k for k, s in states.items() if not s.get("stopped")]:
                states[key]["stopped"] = f"worker: {problem}"
            log(f"searches: {problem}")
            continue
        if answer.get("fresh_process"):
            log("memory did not come back after a probe: a fresh process goes on")
    searches = {}
    for job in jobs:
        key, state = search_key(job), states[search_key(job)]
        fits = [p["row_length"] for p in state["probes"] if p["status"] == "fits"]
        fails = [p["row_length"] for p in state["probes"] if p["status"] == "oom"]
        searches[key] = state | {
            "run": job.run,
            "label": RUNS[job.run],
            "model": job.model,
            "lora": job.lora,
            "quantized": job.quantized,
            "longest_fits": max(fits, default=None),
            "shortest_fails": min(fails, default=None),
        }
        name = f"trl_longest_{job.model}{name_suffix(args)}_{job.run}_{slug}.json"
        harness.write_json(out / name, searches[key])
        log(f"{key}: longest that fits {searches[key]['longest_fits']}, shortest that fails "
            f"{searches[key]['shortest_fails']} ({state.get('stopped')})")  # fmt: skip
    return {"searches": searches, "warmups": warmups}


# --------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    add = parser.add_argument
    add("--worker", type=Path, help=argparse.SUPPRESS)
    add("--longest", action="store_true", help="the longest-row search")
    add("--model", nargs="+", choices=tuple(MODELS), help="default: 1b; --longest: 1b 8b")
    add("--device", choices=("cuda", "cpu"), default="cuda")
    add("--runs", nargs="+", choices=tuple(RUNS), default=list(DEFAULT_RUNS))
    add("--attention", choices=("sdpa", "flex_attention"),
        help="default: sdpa; --longest on CUDA: flex_attention")  # fmt: skip
    add("--row-length", type=int, help="tokens per row (8192, tiny 256); --longest: the first")
    add("--warmup", type=int, default=3, help="warm-up steps per run, reported apart")
    add("--max-steps", type=int, default=20, help="steady steps per run")
    add("--gradient-checkpointing", action="store_true", help="on in the throughput runs too")
    add("--profile", action="store_true", help="profile one more step after the steady ones")
    add("--sample-stacks", action="store_true",
        help="report the host's Python stacks in steady steps slower than 1.5x the median")  # fmt: skip
    add("--profile-steps", action="store_true",
        help="profile every steady step: each one's kernels and host ops (slow: for stalls)")  # fmt: skip
    add("--adapter", choices=ADAPTERS, default="full",
        help="what trains: every parameter, a LoRA adapter, or one on the model in 4 bits "
        "(default full; --longest: full, and lora at 8b)")  # fmt: skip
    add("--reverse", action="store_true", help="make the runs in the reverse order")
    add("--skip-lora", action="store_true", help="--longest: leave out the 8b LoRA searches")
    add("--probe-steps", type=int, default=2, help="--longest: steps per probe")
    add("--max-probes", type=int, default=10, help="--longest: probes per search")
    add("--max-row", type=int, default=1 << 20, help="--longest: the longest row probed")
    add("--resolution", type=float, default=0.125,
        help="--longest: stop at a gap of at most this share of the longest that fits")  # fmt: skip
    add("--seconds", type=float, default=480.0, help="no run, search or probe starts later")
    add("--isolate", action=argparse.BooleanOptionalAction,
        help="each run or search in a process of its own (default: on CUDA)")  # fmt: skip
    add("--out", type=Path, help="output folder (default: a temporary one)")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return args
    if args.profile and args.profile_steps:
        parser.error("--profile and --profile-steps: choose one (one profiler at a time)")
    for name in ("warmup", "max_steps", "probe_steps", "max_probes", "row_length", "seconds"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "warmup" else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_trl: no CUDA device: run on a GPU machine, or --model tiny --device cpu")
    if args.attention is None:
        flex = args.longest and args.device == "cuda"
        args.attention = "flex_attention" if flex else "sdpa"
    if args.attention == "flex_attention" and args.device == "cpu":
        sys.exit("bench_trl: flex attention trains on CUDA only: use sdpa on the CPU")
    args.model = args.model or (["1b", "8b"] if args.longest else ["1b"])
    if args.isolate is None:
        args.isolate = args.device == "cuda"
    return args


def make_jobs(args) -> list[Job]:
    jobs = []
    runs = sorted(args.runs, key=list(RUNS).index)
    for model in args.model:
        lora = args.adapter != "full" or (args.longest and model == "8b")
        if args.longest and model == "8b" and args.skip_lora:
            continue
        for run in runs:
            jobs.append(
                Job(
                    run=run,
                    model=model,
                    device=args.device,
                    attention=args.attention,
                    row_length=args.row_length or (256 if model == "tiny" else 8192),
                    warmup=0 if args.longest else args.warmup,
                    steps=args.probe_steps if args.longest else args.max_steps,
                    gradient_checkpointing=args.longest or args.gradient_checkpointing,
                    lora=lora,
                    quantized=args.adapter == "qlora",
                    profile=args.profile and not args.longest,
                    sample_stacks=args.sample_stacks and not args.longest,
                    profile_steps=args.profile_steps and not args.longest,
                    pad_rows=args.longest or args.attention == "flex_attention",
                )
            )
    if args.reverse:
        jobs.reverse()
    # Liger patches transformers' Llama module for the whole process: its runs come last
    return sorted(jobs, key=lambda job: job.run.endswith("_liger"))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        task = json.loads(args.worker.read_text())
        if task["device"] == "cpu":
            torch.set_num_threads(1)  # the tiny model's matrices: threads only spin
        result_path = args.worker.with_suffix(".result.json")
        harness.write_json(result_path, worker(task, result_path))
        return 0
    if args.device == "cpu":
        torch.set_num_threads(1)
    import make_tables

    start = time.time()
    deadline = start + args.seconds
    out = args.out or Path(tempfile.gettempdir()) / "packed_ce_bench"
    jobs = make_jobs(args)
    if not jobs:
        sys.exit("bench_trl: nothing to run (--skip-lora leaves no 8b search)")
    # read in a worker when the runs have theirs: a CUDA context here would hold memory that
    # the runs and probes then lack
    env = run_worker({"kind": "environment", "device": args.device}, args.isolate)
    if "error" in env:
        sys.exit(f"bench_trl: {env['error']}")
    slug = harness.device_slug(env)
    where = "in subprocesses" if args.isolate else "in this process"
    what = "searches" if args.longest else "runs"
    log(f"{env['device_name']}, torch {torch.__version__}: {len(jobs)} {what}, {where}")
    benchmark = "trl_longest" if args.longest else "trl_steps"
    body = (run_longest if args.longest else run_throughput)(args, jobs, deadline, out, slug)
    result = {
        "benchmark": benchmark,
        "mode": "tiny" if args.model == ["tiny"] else "full",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "environment": env,
        "models": {name: MODELS[name] for name in args.model},
        "attention": args.attention,
        "adapter": args.adapter,
        "reverse": args.reverse,
        "order": [job.run for job in jobs],
        "seconds": time.time() - start,
        **body,
    }
    if args.longest:
        result["probe_steps"] = args.probe_steps
        result["resolution"] = args.resolution
        result["lora"] = LORA
    else:
        result["warmup_steps"] = args.warmup
        result["gradient_checkpointing"] = args.gradient_checkpointing
    models = "_".join(args.model) + name_suffix(args)
    attention = "" if args.attention == "sdpa" else f"_{args.attention}"
    path = harness.write_json(out / f"{benchmark}_{models}{attention}_{slug}.json", result)
    report = (make_tables.trl_longest_report if args.longest else make_tables.trl_steps_report)(
        result
    )
    path.with_suffix(".md").write_text(report + "\n")
    print(f"\nwrote {path} and {path.with_suffix('.md')}\n")
    print(report, flush=True)
    failed = [
        name
        for name, run in body.get("runs", {}).items()
        if "error" in run or not run["check"]["passed"]
    ]
    if failed:
        print(f"FAILED: {', '.join(failed)} (an error, or the objective check)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
