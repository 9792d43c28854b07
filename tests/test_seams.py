"""Every producer's rows into every consumer, on 1 to 3 processes: the per-conversation objective.

A fuzz over the seams between packed-ce's parts. Each case draws conversations (lengths, weights,
sources), a producer of rows and a consumer, a batch size and a process count, from one fixed
seed (``SEAM_SEED`` replays another draw), and holds the consumer's result to an independent
reference: every conversation alone through transformers' own loss, weighted mean.

Producers (run once per case in the test process, as a user runs them before training):
``pack_dataset`` (in memory), ``pack_dataset`` of a ``datasets.IterableDataset`` (streamed to an
Arrow file), ``pack_stream`` (rows as Python dicts), ``packed-ce pack`` (the command, a
``save_to_disk`` folder), and the tokenized conversations themselves (the trainers pack them).

Consumers (in every process): a plain loop (``PackedCollator``, ``count_num_items``, gradients
summed over the processes), ``PackedTrainer``, ``PackedSFTTrainer`` with ``packing=True`` and with
``padding_free=True``, and context parallelism (every process shares each row: ``shard_batch``).
Each trains one epoch as one SGD step, so that the update must be ``-lr`` times the gradient of the
weighted per-conversation mean over every conversation once, whatever accelerate adds to complete
the last batch; the trainers first ``evaluate()`` (``eval_loss`` must be the reference loss,
``dataloader_drop_last`` drawn too).
"""

from __future__ import annotations

import collections
import json
import os
import random

import pytest
import torch
import torch.distributed as dist

datasets = pytest.importorskip("datasets")

from integration_utils import (  # noqa: E402
    flat_relative_error,
    has_target,
    one_at_a_time,
    rendezvous,
    spawn_ranks,
    start_rank,
    synthetic_conversations,
    tiny_model,
)

VOCAB = 96
LR = 0.5
ROW = 48  # tokens per packed row
SEED = int(os.environ.get("SEAM_SEED", "0"))
PRODUCERS = ("pack_dataset", "streamed", "pack_stream", "pack_command", "conversations")
CONSUMERS = ("loop", "PackedTrainer", "sft_packing", "sft_padding_free", "context_parallel")
# cases per process count: every producer x consumer pair on one process (context parallelism
# needs two), a draw of them on two and three
CASES = {1: None, 2: 12, 3: 8}
HAS_TRL = __import__("importlib").util.find_spec("trl") is not None
RTOL = 1e-5


def draw_cases(world: int) -> list[dict]:
    """The cases of one process count, each a dict of what it runs on (deterministic per SEED)."""
    rng = random.Random(f"{SEED}-{world}")
    pairs = [(p, c) for p in PRODUCERS for c in CONSUMERS if world > 1 or c != "context_parallel"]
    if not HAS_TRL:
        pairs = [(p, c) for p, c in pairs if not c.startswith("sft")]
    if CASES[world] is not None:
        pairs = rng.sample(pairs, min(CASES[world], len(pairs)))
    cases = []
    for index, (producer, consumer) in enumerate(pairs):
        count = rng.randint(3, 9)
        lengths = [rng.randint(2, 30) for _ in range(count)]
        conversations = [c for c in synthetic_conversations(lengths, VOCAB, seed=rng.randrange(10**6)) if has_target(c)]
        if not conversations:
            conversations = synthetic_conversations([12], VOCAB, seed=1)
        weighted, sourced = rng.random() < 0.6, rng.random() < 0.5
        for conversation in conversations:
            if weighted:
                conversation["weight"] = rng.choice([0.0, 0.5, 1.0, 2.0, 3.0])
            if sourced:
                conversation["source"] = rng.choice(["chat", "code"])
        if weighted and not any(c["weight"] > 0 for c in conversations):
            conversations[0]["weight"] = 1.0
        cases.append(dict(name=f"{world}p-{index}-{producer}-{consumer}", producer=producer, consumer=consumer,
                          conversations=conversations, batch_size=rng.randint(1, 3),
                          drop_last=rng.random() < 0.3))
    return cases


def produce(case: dict, folder) -> str:
    """Runs the case's producer; returns the folder its rows (or conversations) were saved to."""
    import collators
    from packed_ce_demo.cli import main

    records = datasets.Dataset.from_list(case["conversations"])
    out = folder / case["name"]
    producer = case["producer"]
    if producer == "pack_dataset":
        rows = collators.pack_dataset(records, ROW)
    elif producer == "streamed":
        rows = collators.pack_dataset(records.to_iterable_dataset(), ROW, cache_file_name=str(folder / f"{case['name']}.arrow"))
    elif producer == "pack_stream":
        rows = datasets.Dataset.from_list(list(collators.pack_stream(iter(case["conversations"]), ROW)))
    elif producer == "pack_command":
        source = folder / f"{case['name']}.jsonl"
        source.write_text("".join(json.dumps(c) + "\n" for c in case["conversations"]))
        assert main(["pack", "--dataset", str(source), "--output", str(out), "--max-length", str(ROW)]) == 0
        return str(out)
    else:
        rows = records
    rows.save_to_disk(str(out))
    return str(out)


def reference(case: dict) -> tuple[float, dict[str, torch.Tensor]]:
    """The weighted per-conversation mean of the initial model and its SGD update."""
    model = tiny_model("llama", VOCAB)
    conversations = case["conversations"]
    weights = [c.get("weight", 1.0) for c in conversations]
    loss = one_at_a_time(model, conversations, weights)
    loss.backward()
    return loss.item(), {n: -LR * p.grad for n, p in model.named_parameters()}


# --- the consumers, in each process ---------------------------------------------------------


def gradient_sum(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the processes (the data-parallel reduction)."""
    grads = {}
    for name, p in model.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if dist.is_initialized():
            dist.all_reduce(grad)
        grads[name] = -LR * grad
    return grads


def loop(rows, case, world, rank):
    """A plain loop: this process's share of the rows (none twice), one step's normaliser."""
    import collators
    from packed_ce.integrations import apply_packed_loss, count_num_items

    model = apply_packed_loss(tiny_model("llama", VOCAB))
    mine = [rows[i] for i in range(rank, len(rows), world)]
    size = case["batch_size"]
    batches = [collators.PackedCollator()(mine[i : i + size]) for i in range(0, len(mine), size)]
    # every process's count, summed (a process without a row counts 0)
    local = count_num_items(batches, all_reduce=False) if batches else torch.tensor(0)
    count = local.to(torch.float64)
    if world > 1:
        dist.all_reduce(count)
    for batch in batches:
        model(**batch, num_items_in_batch=count).loss.backward()  # gradients summed below
    return None, gradient_sum(model)


def context_parallel(rows, case, world, rank):
    """Every process holds a shard of each row: the shards' losses and gradients add up to it."""
    import collators
    from packed_ce.integrations import apply_packed_loss, count_num_items, enable_context_parallel

    model = enable_context_parallel(apply_packed_loss(tiny_model("llama", VOCAB)))
    size = case["batch_size"]
    collate = collators.PackedCollator(pad_to_multiple_of=2 * world)
    batches = [collate([rows[j] for j in range(i, min(i + size, len(rows)))]) for i in range(0, len(rows), size)]
    count = count_num_items(batches)
    for batch in batches:
        model(**collators.shard_batch(batch, rank, world), num_items_in_batch=count).loss.backward()
    return None, gradient_sum(model)


def trainer(rows, case, world, rank, out_dir):
    """One epoch as one SGD step through a trainer, after an evaluation on the same rows."""
    from transformers import PrinterCallback

    import collators
    from packed_ce.integrations import apply_packed_loss

    common = dict(per_device_train_batch_size=case["batch_size"], per_device_eval_batch_size=case["batch_size"],
                  gradient_accumulation_steps=64, num_train_epochs=1, optim="sgd", learning_rate=LR,
                  lr_scheduler_type="constant", max_grad_norm=0.0, weight_decay=0.0, report_to=[], use_cpu=True,
                  disable_tqdm=True, dataloader_num_workers=0, save_strategy="no", seed=0,
                  ddp_backend="gloo" if world > 1 else None, ddp_find_unused_parameters=False)
    model = tiny_model("llama", VOCAB)
    if case["consumer"] == "PackedTrainer":
        from transformers import TrainingArguments

        from packed_ce.integrations import PackedTrainer

        built = PackedTrainer(model=apply_packed_loss(model), args=TrainingArguments(out_dir, **common),
                              train_dataset=rows, eval_dataset=rows, data_collator=collators.PackedCollator())
    else:
        from integration_utils import sft_args, tiny_tokenizer

        from packed_ce.integrations import PackedSFTTrainer

        layout = dict(packing=True, max_length=ROW) if case["consumer"] == "sft_packing" else dict(
            padding_free=True, max_length=None)
        built = PackedSFTTrainer(model=model, args=sft_args(out_dir, **{**common, **layout}), train_dataset=rows,
                                 eval_dataset=rows, processing_class=tiny_tokenizer(VOCAB))
    built.remove_callback(PrinterCallback)  # disable_tqdm prints every log instead
    built.args.dataloader_drop_last = case["drop_last"]  # evaluation covers the whole set anyway
    eval_loss = built.evaluate()["eval_loss"]  # before train(), as stock trl allows
    built.args.dataloader_drop_last = False  # training refuses to drop rows (tested elsewhere)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    built.train()
    assert built.state.global_step == 1, built.state.global_step
    return eval_loss, {n: p.detach() - initial[n] for n, p in model.named_parameters()}


def worker(rank: int, world: int, store: str, folder: str, cases: list[dict]) -> None:
    # one process too: accelerate takes this group rather than starting its own
    start_rank(rank, world, store)
    from transformers.utils import logging

    logging.set_verbosity_error()
    datasets.disable_progress_bars()
    results = {}
    try:
        for case in cases:
            rows = datasets.load_from_disk(case["path"])
            consumer = case["consumer"]
            try:
                if consumer == "loop":
                    result = loop(rows, case, world, rank)
                elif consumer == "context_parallel":
                    result = context_parallel(rows, case, world, rank)
                else:
                    result = trainer(rows, case, world, rank, os.path.join(folder, "out", case["name"]))
            except Exception as error:  # noqa: BLE001  reported by the test process, naming the case
                result = f"{type(error).__name__}: {error}"
            results[case["name"]] = result
            if world > 1:
                dist.barrier()
    finally:
        torch.save(results, os.path.join(folder, f"{world}-rank{rank}.pt"))
        dist.destroy_process_group()


@pytest.mark.parametrize("world", sorted(CASES))
def test_every_producer_into_every_consumer(world, tmp_path):
    cases = draw_cases(world)
    for case in cases:
        case["path"] = produce(case, tmp_path)
    # one process too is spawned: the environment a worker sets and the process group accelerate
    # starts from it stay out of the tests that follow
    spawn_ranks(worker, (world, rendezvous(tmp_path), str(tmp_path), cases), world)
    results = torch.load(tmp_path / f"{world}-rank0.pt")
    failures, ran = [], collections.Counter()
    for case in cases:
        result = results[case["name"]]
        if isinstance(result, str):
            failures.append(f"{case['name']}: {result}")
            continue
        eval_loss, update = result
        loss, expected = reference(case)
        error = flat_relative_error(update, expected)
        if error > RTOL:
            failures.append(f"{case['name']}: update {error:.1e} from every conversation alone")
        if eval_loss is not None and abs(eval_loss - loss) > RTOL * abs(loss):
            failures.append(f"{case['name']}: eval_loss {eval_loss:.7f}, reference {loss:.7f}")
        ran[case["consumer"]] += 1
    print(f"\n{world} process(es), seed {SEED}: {len(cases)} cases ({dict(ran)} exact)")
    assert not failures, "\n".join(failures)
