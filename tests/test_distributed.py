"""Data parallelism: two processes give the gradients of one process on the global batch.

Run the GPU tests (two CUDA GPUs, NCCL; DDP, FSDP2 and DeepSpeed ZeRO-3 through accelerate)
with one command:

    PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider -m cuda -s tests/test_distributed.py

Each process trains on its share of the packed rows with gradient accumulation; the normaliser
is the number of conversations with a target over every micro-batch of every process
(``count_num_items`` all-reduces it), and each micro-batch's loss is multiplied by the world
size to cancel DDP's gradient averaging. The ground truth is one process running every
conversation of the global batch alone through transformers' own loss and averaging.

On CPU the processes talk through gloo; the ``cuda`` tests run the same workers with NCCL on two
GPUs. Workers are started with ``integration_utils.spawn_ranks`` and write their results to files.
The trainers run with the Trainer's own SGD (``optim="sgd"``, constant rate), which FSDP2 and
ZeRO-3 can shard, and ``PackedSFTTrainer`` runs on trl's padding-free batches of pre-tokenized
conversations with a ``weight`` column, once training every parameter and once a LoRA adapter
(``peft_config=``). Each set-up of several processes is one of ``PARALLEL``: plain DDP, FSDP2
(GPUs only: accelerate falls back to DDP on CPU) and DeepSpeed ZeRO-3 (where ``deepspeed`` is
installed; on CPU through its gloo backend). Under ZeRO-3 the comparison would catch the ways
DeepSpeed could change the step: a division by the accumulation steps on top of the loss's own
normalisation (ACCUMULATION is 2), an average over the processes other than DDP's, a fused head
reading a partitioned weight.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import SequentialSampler


from integration_utils import (
    SFT_LENGTHS,
    SFT_LR,
    assert_gradients_close,
    rendezvous,
    spawn_ranks,
    start_rank,
    gradients,
    one_at_a_time,
    per_conversation_sgd_step,
    sft_args,
    split_rows,
    synthetic_conversations,
    tiny_model,
    tiny_tokenizer,
)

VOCAB = 96
WORLD = 2
ACCUMULATION = 2
BATCH_ROWS = 2  # packed rows per micro-batch and process
STEPS = 2  # optimiser steps of the Trainer run
LR = 0.5
HAS_TRL = importlib.util.find_spec("trl") is not None
SFT_BATCH = len(SFT_LENGTHS) // (WORLD * ACCUMULATION)  # one step over the SFT data set

HAS_PEFT = importlib.util.find_spec("peft") is not None
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

# DeepSpeed ZeRO-3 through TrainingArguments(deepspeed=...): the Trainer fills the "auto" fields
# from its own arguments (batch size, accumulation, clipping, precision: float32 here). A
# persistence threshold of 0 partitions every parameter, however small (by default those under
# 100k elements stay whole on every rank, which would leave this tiny model unsharded).
ZERO3 = {
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}

# The Trainer arguments of each multi-process set-up. FSDP2 through accelerate, each decoder
# layer a shard unit (the legacy string form of `fsdp` is understood by every transformers 5
# release).
PARALLEL = {
    "ddp": {},
    "fsdp2": dict(
        fsdp="full_shard auto_wrap",
        fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
    ),
    "zero3": dict(deepspeed=ZERO3),
}


def packed_rows(count: int) -> list[dict]:
    """``count`` packed rows of 1 to 4 synthetic conversations (no ``datasets`` needed)."""
    gen = torch.Generator().manual_seed(2)
    rows = []
    for index in range(count):
        per_row = int(torch.randint(1, 5, (1,), generator=gen))
        lengths = torch.randint(1, 25, (per_row,), generator=gen).tolist()
        conversations = synthetic_conversations(lengths, VOCAB, seed=100 + index)
        rows.append(
            {
                "input_ids": sum((c["input_ids"] for c in conversations), []),
                "labels": sum((c["labels"] for c in conversations), []),
                "seq_lengths": lengths,
            }
        )
    return rows


def micro_batches(rows: list[dict], rank: int) -> list[list[dict]]:
    """The rows of ``rank``: micro-batch ``k`` is global batch ``k * WORLD + rank``, as a sharded
    sequential DataLoader deals them out."""
    batches = [rows[i : i + BATCH_ROWS] for i in range(0, len(rows), BATCH_ROWS)]
    return batches[rank::WORLD]


def runs_of(parallel: str) -> tuple[str, ...]:
    """The runs a pair of processes makes under ``parallel`` (a key of ``PARALLEL``)."""
    runs = ("trainer",)
    if HAS_TRL:
        runs += ("sft",)
        if HAS_PEFT and parallel != "zero3":
            runs += ("lora",)
    return runs + (("ddp",) if parallel == "ddp" else ())


def worker(rank: int, store: str, backend: str, out_dir: str, parallel: str) -> None:
    """Every run in one pair of processes (starting processes is the slow part of this file).

    With ``parallel="ddp"``: one accumulated step through plain DDP (this rank's gradients are
    saved); then, under ``PARALLEL[parallel]``, STEPS optimiser steps through PackedTrainer and
    one through PackedSFTTrainer, training every parameter and then a LoRA adapter (their
    parameters are saved). accelerate picks up the process group already initialised from the
    environment.
    """
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    start_rank(rank, WORLD, store, backend)
    steps = {"trainer": trainer_steps, "sft": sft_steps, "lora": lora_steps}
    try:
        for run in runs_of(parallel):
            if run == "ddp":
                result = ddp_step(rank, device)
            else:
                result = steps[run](backend, out_dir, parallel)
            torch.save(result, os.path.join(out_dir, f"{run}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def ddp_step(rank: int, device: torch.device) -> dict:
    """One step of ACCUMULATION micro-batches through DDP; returns the gradients."""
    from collators import PackedCollator
    from packed_ce.integrations import apply_packed_loss, count_num_items

    model = apply_packed_loss(tiny_model("llama", VOCAB).to(device), is_packed=True)
    ddp = DistributedDataParallel(model)
    collate = PackedCollator()
    batches = [
        {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate(rows).items()}
        for rows in micro_batches(packed_rows(WORLD * ACCUMULATION * BATCH_ROWS), rank)
    ]
    num_items = count_num_items(batches)  # all-reduced over both processes
    for index, batch in enumerate(batches):
        # DDP averages gradients over the processes; the loss is already normalised over all of
        # them, so multiply the average back into a sum. Gradients are synchronised on the last
        # micro-batch only.
        last = index == len(batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = ddp(**batch, num_items_in_batch=num_items, use_cache=False).loss
            (loss * WORLD).backward()
    return {k: v.cpu() for k, v in gradients(model).items()}


def full_parameters(model, parallel: str = "ddp") -> dict:
    """Every parameter whole and on the CPU (FSDP2 holds each rank's shard as a DTensor, ZeRO-3
    a flat partition that ``GatheredParameters`` assembles).

    Raises unless the parameters are sharded as ``parallel`` asks: accelerate ignores the FSDP
    plugin where it cannot apply it (on CPU, for one), and the test would then pass on DDP.
    """
    params = list(model.parameters())
    if parallel == "fsdp2" and not all(hasattr(p, "full_tensor") for p in params):
        raise AssertionError("FSDP2 was asked for but the model's parameters are not sharded")
    if parallel == "zero3":
        import deepspeed

        if not all(hasattr(p, "ds_id") for p in params):
            raise AssertionError("ZeRO-3 was asked for but the model's parameters are not partitioned")
        with deepspeed.zero.GatheredParameters(params):
            return {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
        for name, p in model.named_parameters()
    }


def unpartitioned(model):
    """``model``, checked to be built whole: after a ZeRO-3 run the Trainer's DeepSpeed config
    can outlive it, and transformers would then build the next model partitioned, through
    ``deepspeed.zero.Init``, with other initial weights than the reference's."""
    assert not any(hasattr(p, "ds_id") for p in model.parameters()), "built under zero.Init"
    return model


def release_deepspeed_config() -> None:
    """Forgets the DeepSpeed config a ZeRO-3 run left in transformers (see :func:`unpartitioned`)."""
    if HAS_DEEPSPEED:
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()


# per-conversation weights of the SFT data set (0 removes one): the step is their weighted mean
SFT_WEIGHTS = [1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 1.5, 1.0]


def sft_conversations() -> list[dict]:
    return synthetic_conversations(SFT_LENGTHS, VOCAB, seed=3)


def sft_trainer(backend: str, out_dir: str, parallel: str, learning_rate=SFT_LR, **kwargs):
    """PackedSFTTrainer over the SFT data set, one optimiser step (``kwargs``: ``peft_config``)."""
    from datasets import Dataset

    from packed_ce.integrations import PackedSFTTrainer

    model = unpartitioned(tiny_model("llama", VOCAB))
    args = sft_args(
        out_dir,
        padding_free=True,
        max_length=None,
        per_device_train_batch_size=SFT_BATCH,
        gradient_accumulation_steps=ACCUMULATION,
        optim="sgd",
        learning_rate=learning_rate,
        use_cpu=backend == "gloo",
        ddp_backend=backend,
        ddp_find_unused_parameters=False,
        **PARALLEL[parallel],
    )
    return PackedSFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(
            [{**c, "weight": w} for c, w in zip(sft_conversations(), SFT_WEIGHTS)]
        ),
        processing_class=tiny_tokenizer(VOCAB),
        **kwargs,
    )


def sft_steps(backend: str, out_dir: str, parallel: str) -> dict:
    """One optimiser step of PackedSFTTrainer over the SFT data set; returns the parameters.

    The trainer's loss runs through the fused head, which reads ``lm_head.weight`` outside the
    head's own forward: under ZeRO-3 that weight is a partition until DeepSpeed gathers it on
    that read."""
    from packed_ce.integrations.model.installation import installation_of

    trainer = sft_trainer(backend, out_dir, parallel)
    assert installation_of(trainer.model).fused_options is not None
    trainer.train()
    params = full_parameters(trainer.model, parallel)
    release_deepspeed_config()
    return params


# The LoRA step's learning rate: one SGD step is -lr * gradient however large, and the update of
# a B matrix at SFT_LR is 4000 times smaller than the matrix, so that float32's rounding of
# ``initial + update`` alone would be 2.4e-5 of the update
LORA_LR = 10.0


def lora_config():
    from peft import LoraConfig

    # init_lora_weights=False: B random too, so that A and B both get a gradient in one step
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                      init_lora_weights=False)  # fmt: skip


def lora_steps(backend: str, out_dir: str, parallel: str) -> dict:
    """One optimiser step of PackedSFTTrainer with ``peft_config=``: the parameters before (as
    trl initialised the adapter) and after, by name of the PEFT model."""
    trainer = sft_trainer(
        backend, out_dir, parallel, learning_rate=LORA_LR, peft_config=lora_config()
    )
    initial = {name: p.detach().cpu().clone() for name, p in trainer.model.named_parameters()}
    trainer.train()
    params = full_parameters(trainer.model, parallel)
    release_deepspeed_config()
    return {"initial": initial, "final": params}


def trainer_steps(backend: str, out_dir: str, parallel: str) -> dict:
    """STEPS optimiser steps through PackedTrainer; returns the parameters."""
    from transformers import TrainingArguments

    from collators import PackedCollator
    from packed_ce.integrations import PackedTrainer, apply_packed_loss

    class SequentialPackedTrainer(PackedTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(
                train_dataset if train_dataset is not None else self.train_dataset
            )

    model = apply_packed_loss(unpartitioned(tiny_model("llama", VOCAB)), is_packed=True)
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH_ROWS,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        optim="sgd",
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=backend == "gloo",
        ddp_backend=backend,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **PARALLEL[parallel],
    )
    trainer = SequentialPackedTrainer(
        model=model,
        args=args,
        train_dataset=packed_rows(STEPS * WORLD * ACCUMULATION * BATCH_ROWS),
        data_collator=PackedCollator(),
    )
    trainer.train()
    params = full_parameters(trainer.model, parallel)
    release_deepspeed_config()
    return params


def run_workers(backend: str, out_dir: str, parallel: str = "ddp") -> dict[str, list[dict]]:
    """Every run on WORLD processes; results by run, one entry per rank."""
    spawn_ranks(worker, (rendezvous(out_dir), backend, out_dir, parallel), WORLD)
    return {
        run: [torch.load(os.path.join(out_dir, f"{run}-rank{rank}.pt")) for rank in range(WORLD)]
        for run in runs_of(parallel)
    }


def single_process_gradients(device="cpu") -> dict:
    model = tiny_model("llama", VOCAB).to(device)
    conversations = split_rows(packed_rows(WORLD * ACCUMULATION * BATCH_ROWS))
    one_at_a_time(model, conversations).backward()
    return {k: v.cpu() for k, v in gradients(model).items()}


def single_process_training(device="cpu") -> dict:
    """STEPS SGD steps of unpacked per-sequence training on the global batches, one process."""
    model = tiny_model("llama", VOCAB).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    rows = packed_rows(STEPS * WORLD * ACCUMULATION * BATCH_ROWS)
    per_step = WORLD * ACCUMULATION * BATCH_ROWS
    for step in range(STEPS):
        optimizer.zero_grad()
        one_at_a_time(model, split_rows(rows[step * per_step : (step + 1) * per_step])).backward()
        optimizer.step()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def updates(params: dict, initial: dict) -> dict:
    return {name: params[name] - initial[name] for name in initial}


def on_two_gpus(backend: str):
    return pytest.param(
        backend,
        id=f"{backend}-2gpu",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
        ],
    )


def with_deepspeed(param):
    """``param`` (a ZeRO-3 set-up), skipped where deepspeed is not installed."""
    skip = pytest.mark.skipif(not HAS_DEEPSPEED, reason="needs deepspeed")
    return pytest.param(*param.values, id=param.id, marks=[*param.marks, skip])


# a set-up is "<backend>" (plain DDP) or "<backend>-<parallel>", parallel a key of PARALLEL
BACKENDS = [pytest.param("gloo", id="gloo-cpu"), on_two_gpus("nccl")]
TRAINER_BACKENDS = BACKENDS + [
    on_two_gpus("nccl-fsdp2"),
    with_deepspeed(pytest.param("gloo-zero3", id="gloo-cpu-zero3")),
    with_deepspeed(on_two_gpus("nccl-zero3")),
]
LORA_BACKENDS = BACKENDS + [on_two_gpus("nccl-fsdp2")]


def split_setup(setup: str) -> tuple[str, str]:
    """``(backend, parallel)`` of a set-up id: ``"nccl-fsdp2"`` -> ``("nccl", "fsdp2")``."""
    backend, _, parallel = setup.partition("-")
    return backend, parallel or "ddp"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(setup)``: the workers' results, spawned once per set-up for all tests."""
    cache = {}

    def get(setup):
        if setup not in cache:
            backend, parallel = split_setup(setup)
            cache[setup] = run_workers(backend, str(tmp_path_factory.mktemp(setup)), parallel)
        return cache[setup]

    return get


def single_process_sft(device="cpu") -> dict:
    """One SGD step of unpacked per-conversation training on the SFT data set, weighted."""
    model = tiny_model("llama", VOCAB).to(device)
    per_conversation_sgd_step(model, sft_conversations(), weights=SFT_WEIGHTS)
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_matches_one_process_on_the_global_batch(backend, results):
    device = "cuda" if backend == "nccl" else "cpu"
    expected = single_process_gradients(device)
    for rank_grads in results(backend)["ddp"]:
        worst = assert_gradients_close(rank_grads, expected)
    print(f"{backend}: worst relative gradient error {worst:.2e}")


def device_of(setup: str) -> str:
    return "cpu" if split_setup(setup)[0] == "gloo" else "cuda"


@pytest.mark.parametrize("backend", TRAINER_BACKENDS)
def test_packed_trainer_matches_one_process(backend, results):
    device = device_of(backend)
    initial = {
        name: p.detach().clone() for name, p in tiny_model("llama", VOCAB).named_parameters()
    }
    expected = updates(single_process_training(device), initial)
    for rank_params in results(backend)["trainer"]:
        worst = assert_gradients_close(updates(rank_params, initial), expected)
    print(f"{backend}: worst relative parameter-update error {worst:.2e}")


@pytest.mark.parametrize("backend", TRAINER_BACKENDS)
def test_packed_sft_trainer_matches_one_process(backend, results):
    """PackedSFTTrainer, padding-free, gradient accumulation 2 on each of two processes, with a
    ``weight`` column: the step minimises the weighted mean over all micro-batches and ranks."""
    pytest.importorskip("trl")
    device = device_of(backend)
    initial = {
        name: p.detach().clone() for name, p in tiny_model("llama", VOCAB).named_parameters()
    }
    expected = updates(single_process_sft(device), initial)
    for rank_params in results(backend)["sft"]:
        worst = assert_gradients_close(updates(rank_params, initial), expected)
    print(f"{backend}: PackedSFTTrainer worst relative parameter-update error {worst:.2e}")


@pytest.mark.parametrize("backend", LORA_BACKENDS)
def test_packed_sft_trainer_lora_matches_one_process(backend, results):
    """PackedSFTTrainer with ``peft_config=`` (LoRA on q_proj and v_proj), the same data and
    step as above: the adapter's parameters after the step equal one process's per-conversation
    SGD step on the global batch from the same initial adapter, and the base stays frozen."""
    pytest.importorskip("trl")
    peft = pytest.importorskip("peft")
    device = device_of(backend)
    runs = results(backend)["lora"]
    initial = runs[0]["initial"]
    for run in runs[1:]:  # trl seeds before it creates the adapter: every rank starts alike
        for name, value in run["initial"].items():
            torch.testing.assert_close(value, initial[name], rtol=0, atol=0)
    reference = peft.get_peft_model(tiny_model("llama", VOCAB), lora_config()).to(device)
    reference.load_state_dict(initial)
    trainable = [name for name, p in reference.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)
    per_conversation_sgd_step(reference, sft_conversations(), lr=LORA_LR, weights=SFT_WEIGHTS)
    expected = {name: p.detach().cpu() - initial[name] for name, p in reference.named_parameters()}
    for run in runs:
        update = updates(run["final"], initial)
        worst = assert_gradients_close({n: update[n] for n in trainable}, {n: expected[n] for n in trainable})
        frozen = [name for name in update if name not in trainable]
        assert all(not update[name].any() for name in frozen)
    print(f"{backend}: PackedSFTTrainer LoRA worst relative adapter-update error {worst:.2e}")
