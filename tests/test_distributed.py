"""Data parallelism: two processes give the gradients of one process on the global batch.

Each process trains on its share of the packed rows with gradient accumulation; the normaliser
is the number of conversations with a target over every micro-batch of every process
(``count_num_items`` all-reduces it), and each micro-batch's loss is multiplied by the world
size to cancel DDP's gradient averaging. The ground truth is one process running every
conversation of the global batch alone through transformers' own loss and averaging.

On CPU the processes talk through gloo; the ``cuda`` tests run the same workers with NCCL on two
GPUs. Workers are started with ``torch.multiprocessing.spawn`` and write their results to files.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import SequentialSampler


from integration_utils import (
    assert_gradients_close,
    free_port,
    gradients,
    one_at_a_time,
    split_rows,
    synthetic_conversations,
    tiny_model,
)

VOCAB = 96
WORLD = 2
ACCUMULATION = 2
BATCH_ROWS = 2  # packed rows per micro-batch and process
STEPS = 2  # optimiser steps of the Trainer run
LR = 0.5


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


def worker(rank: int, port: int, backend: str, out_dir: str) -> None:
    """Both runs in one pair of processes (starting processes is the slow part of this file).

    First one accumulated step through plain DDP (this rank's gradients are saved), then STEPS
    optimiser steps through PackedTrainer (this rank's parameters are saved); accelerate picks
    up the process group already initialised from the environment.
    """
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    # one thread per process: two processes with a thread pool each on a small CI machine spend
    # most of their time fighting over the cores
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    try:
        grads = ddp_step(rank, device)
        torch.save(grads, os.path.join(out_dir, f"ddp-rank{rank}.pt"))
        params = trainer_steps(backend, out_dir)
        torch.save(params, os.path.join(out_dir, f"trainer-rank{rank}.pt"))
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


def trainer_steps(backend: str, out_dir: str) -> dict:
    """STEPS optimiser steps through PackedTrainer; returns the parameters."""
    from transformers import TrainingArguments

    from collators import PackedCollator
    from packed_ce.integrations import PackedTrainer, apply_packed_loss

    class SequentialPackedTrainer(PackedTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(
                train_dataset if train_dataset is not None else self.train_dataset
            )

    model = apply_packed_loss(tiny_model("llama", VOCAB), is_packed=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=BATCH_ROWS,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=LR,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=backend == "gloo",
        ddp_backend=backend,
        ddp_find_unused_parameters=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = SequentialPackedTrainer(
        model=model,
        args=args,
        train_dataset=packed_rows(STEPS * WORLD * ACCUMULATION * BATCH_ROWS),
        data_collator=PackedCollator(),
        optimizers=(optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)),
    )
    trainer.train()
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def run_workers(backend: str, out_dir: str) -> dict[str, list[dict]]:
    """Both runs on WORLD processes, once per backend; results by run, one entry per rank."""
    mp.spawn(worker, args=(free_port(), backend, out_dir), nprocs=WORLD, join=True)
    return {
        run: [torch.load(os.path.join(out_dir, f"{run}-rank{rank}.pt")) for rank in range(WORLD)]
        for run in ("ddp", "trainer")
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


BACKENDS = [
    pytest.param("gloo", id="gloo-cpu"),
    pytest.param(
        "nccl",
        id="nccl-2gpu",
        marks=[
            pytest.mark.cuda,
            pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
        ],
    ),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """``results(backend)``: the workers' results, spawned once per backend for both tests."""
    cache = {}

    def get(backend):
        if backend not in cache:
            cache[backend] = run_workers(backend, str(tmp_path_factory.mktemp(backend)))
        return cache[backend]

    return get


@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_matches_one_process_on_the_global_batch(backend, results):
    device = "cuda" if backend == "nccl" else "cpu"
    expected = single_process_gradients(device)
    for rank_grads in results(backend)["ddp"]:
        worst = assert_gradients_close(rank_grads, expected)
    print(f"{backend}: worst relative gradient error {worst:.2e}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_trainer_ddp_matches_one_process(backend, results):
    device = "cuda" if backend == "nccl" else "cpu"
    initial = {
        name: p.detach().clone() for name, p in tiny_model("llama", VOCAB).named_parameters()
    }
    expected = updates(single_process_training(device), initial)
    for rank_params in results(backend)["trainer"]:
        worst = assert_gradients_close(updates(rank_params, initial), expected)
    print(f"{backend}: worst relative parameter-update error {worst:.2e}")
