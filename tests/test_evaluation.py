"""Evaluation: ``eval_loss`` is the weighted per-conversation mean over the whole eval set.

Both trainers evaluate seven conversations (weights, two of them 0; two sources) at
``per_device_eval_batch_size`` 1, 2 and 64 (all in one batch), in every batch layout (packed
rows, conversations back to back, one per row), on one process and on two gloo processes, where
accelerate completes the last batches with copies of the first conversations. Every
``eval_loss`` and ``eval_loss/<source>`` must equal the weighted mean of each conversation run
alone through the model (transformers' own loss, float32, 1e-5 relative); so must ``predict``'s
``test_loss``. A batch whose conversations all weigh 0 (batch size 1) adds nothing.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.distributed as dist

from packed_ce.integrations import tiny_causal_lm

from integration_utils import (
    one_at_a_time,
    rendezvous,
    sft_args,
    spawn_ranks,
    start_rank,
    synthetic_conversations,
    tiny_model,
    tiny_tokenizer,
)

Dataset = pytest.importorskip("datasets").Dataset
HAS_TRL = importlib.util.find_spec("trl") is not None

VOCAB = 96
LENGTHS = [20, 12, 18, 14, 25, 7, 16]  # 7 conversations: no batch size above 1 divides them
WEIGHTS = [1.0, 0.0, 0.5, 2.0, 0.0, 1.5, 1.0]
SOURCES = ["chat", "code", "chat", "code", "code", "chat", "code"]
BATCH_SIZES = [1, 2, 64]
# (trainer, batch layout) of each evaluation
LAYOUTS = [
    ("PackedTrainer", "conversations"),  # PackedCollator: the batch's conversations in one row
    ("PackedTrainer", "packed_rows"),  # rows of pack_dataset, several conversations each
    ("PackedTrainer", "padded"),  # PaddedCollator: one conversation per row
    ("PackedSFTTrainer", "padding_free"),
    ("PackedSFTTrainer", "packing"),
    ("PackedSFTTrainer", "padded"),
    ("PackedSFTTrainer", "packed_rows"),  # rows of pack_dataset, packing=True: used as they are
    ("PackedSFTTrainer", "packed_rows_padding_free"),  # the same rows, packing=False
]
# on two processes: one layout of each kind, copies in a packed row and in rows
TWO_PROCESS_LAYOUTS = [LAYOUTS[0], LAYOUTS[2], LAYOUTS[3], LAYOUTS[5]]


def conversations() -> list[dict]:
    rows = synthetic_conversations(LENGTHS, VOCAB, seed=3)
    return [{**c, "weight": w, "source": s} for c, w, s in zip(rows, WEIGHTS, SOURCES)]


MOE = dict(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.1, output_router_logits=True)


def eval_model(arch: str):
    if arch == "mixtral":
        return tiny_causal_lm(VOCAB, model_type="mixtral", **MOE)
    return tiny_model(arch, VOCAB)


def build_trainer(trainer_name: str, layout: str, out_dir: str, keywords=None, arch="llama", **fields):
    """A trainer of the untrained tiny model whose eval set is :func:`conversations` in
    ``layout``; ``keywords`` for the trainer, ``fields`` for its arguments."""
    keywords = keywords or {}
    data = Dataset.from_list(conversations())
    model = eval_model(arch)
    common = dict(report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, **fields)
    if trainer_name == "PackedTrainer":
        from transformers import TrainingArguments

        from collators import PackedCollator, PaddedCollator, pack_dataset
        from packed_ce.integrations import PackedTrainer, apply_packed_loss

        apply_packed_loss(model)
        if layout == "packed_rows":
            data = pack_dataset(data, max_length=32)
        collator = PaddedCollator() if layout == "padded" else PackedCollator()
        return PackedTrainer(model=model, args=TrainingArguments(out_dir, **common), eval_dataset=data,
                             data_collator=collator, **keywords)
    from collators import pack_dataset
    from packed_ce.integrations import PackedSFTTrainer

    options = {
        "padding_free": dict(padding_free=True, max_length=None),
        "packing": dict(packing=True, max_length=32),
        "padded": dict(max_length=None),
        "packed_rows": dict(packing=True, max_length=32),
        "packed_rows_padding_free": dict(padding_free=True, max_length=None),
    }[layout]
    if layout.startswith("packed_rows"):
        data = pack_dataset(data, max_length=32)
    return PackedSFTTrainer(model=model, args=sft_args(out_dir, **{**options, **common}), train_dataset=data,
                            eval_dataset=data, processing_class=tiny_tokenizer(VOCAB), **keywords)


def evaluated_conversations(dataset) -> list[dict]:
    """The conversations of a trainer's eval set, with their weight and source (packed rows split
    at ``seq_lengths``)."""
    found = []
    for row in dataset:
        lengths = row.get("seq_lengths") or [len(row["input_ids"])]
        weights = row.get("seq_weights") or [row["weight"]]
        sources = row.get("seq_sources") or [row["source"]]
        start = 0
        for length, weight, source in zip(lengths, weights, sources):
            found.append(dict(input_ids=row["input_ids"][start : start + length],
                              labels=row["labels"][start : start + length], weight=weight, source=source))
            start += length
    return found


def reference(found: list[dict], prefix: str = "eval", arch: str = "llama") -> dict[str, float]:
    """``eval_loss`` and ``eval_loss/<source>``: each conversation alone, weighted mean (of the
    language-model loss: a MoE router's is no conversation's)."""
    model = eval_model(arch)
    expected = {}
    with torch.no_grad():
        for source in (None, *sorted(set(SOURCES))):
            mine = [c for c in found if source in (None, c["source"])]
            key = f"{prefix}_loss" if source is None else f"{prefix}_loss/{source}"
            expected[key] = float(one_at_a_time(model, mine, [c["weight"] for c in mine]))
    return expected


def evaluate_at_each_batch_size(trainer) -> dict[int, dict[str, float]]:
    results = {}
    for size in BATCH_SIZES:
        trainer.args.per_device_eval_batch_size = size
        metrics = trainer.evaluate()
        results[size] = {k: v for k, v in metrics.items() if k.startswith("eval_loss")}
    return results


def assert_matches(results: dict, expected: dict, label: str) -> None:
    for size, metrics in results.items():
        assert metrics.keys() == expected.keys(), (label, size, metrics)
        for key, value in expected.items():
            error = abs(metrics[key] - value) / abs(value)
            assert error <= 1e-5, f"{label}, batch size {size}: {key} {metrics[key]:.8f} vs {value:.8f}"
    key = next(iter(expected))  # <prefix>_loss
    print(f"{label}: {key} {[round(m[key], 7) for m in results.values()]} at batch sizes "
          f"{list(results)}, reference {expected[key]:.7f}")


@pytest.mark.parametrize("trainer_name, layout", LAYOUTS, ids=[f"{t}-{layout}" for t, layout in LAYOUTS])
def test_eval_loss_is_the_per_conversation_mean_at_any_batch_size(trainer_name, layout, tmp_path):
    if trainer_name == "PackedSFTTrainer":
        pytest.importorskip("trl")
    trainer = build_trainer(trainer_name, layout, str(tmp_path))
    expected = reference(evaluated_conversations(trainer.eval_dataset))
    assert_matches(evaluate_at_each_batch_size(trainer), expected, f"{trainer_name} {layout}")


@pytest.mark.parametrize("trainer_name, layout", [LAYOUTS[0], LAYOUTS[3]], ids=["PackedTrainer", "PackedSFTTrainer"])
def test_evaluate_before_train_on_a_moe_model(trainer_name, layout, tmp_path):
    """``evaluate()`` before ``train()`` (stock trl evaluates first) on a MoE model whose router
    loss is on: the router loss needs no training state."""
    if trainer_name == "PackedSFTTrainer":
        pytest.importorskip("trl")
    trainer = build_trainer(trainer_name, layout, str(tmp_path), arch="mixtral", per_device_eval_batch_size=2)
    metrics = trainer.evaluate()
    expected = reference(evaluated_conversations(trainer.eval_dataset), arch="mixtral")
    assert_matches({2: {k: v for k, v in metrics.items() if k.startswith("eval_loss")}}, expected, "MoE")


def test_packed_rows_in_padded_batches_are_refused(tmp_path):
    """Packed rows padded one per row would let a row's conversations attend to each other."""
    pytest.importorskip("trl")
    with pytest.raises(ValueError, match="`train_dataset` holds packed rows .* pass packing=True"):
        build_trainer("PackedSFTTrainer", "packed_rows_padding_free", str(tmp_path), padding_free=False)


def test_predict_reports_test_loss_and_sources(tmp_path):
    """The prefix follows ``metric_key_prefix``: ``predict`` reports ``test_loss/<source>``."""
    trainer = build_trainer("PackedTrainer", "conversations", str(tmp_path), per_device_eval_batch_size=3)
    metrics = trainer.predict(trainer.eval_dataset).metrics
    expected = reference(evaluated_conversations(trainer.eval_dataset), prefix="test")
    assert_matches({3: {k: v for k, v in metrics.items() if k.startswith("test_loss")}}, expected, "predict")


@pytest.mark.parametrize("trainer_name", ["PackedTrainer", "PackedSFTTrainer"])
@pytest.mark.parametrize("option", ["compute_metrics", "preprocess_logits_for_metrics"])
def test_prediction_metrics_are_refused(trainer_name, option, tmp_path, monkeypatch):
    """Predictions of packed rows are no per-conversation predictions: refused at construction
    (before trl prepares the data), and when set on the trainer afterwards, at evaluate()."""
    if trainer_name == "PackedSFTTrainer":
        pytest.importorskip("trl")
        from trl import SFTTrainer

        def prepare(*args, **kwargs):
            raise AssertionError("the data was prepared before the refusal")

        monkeypatch.setattr(SFTTrainer, "_prepare_dataset", prepare)
    metric = lambda *args: {}  # noqa: E731
    with pytest.raises(ValueError, match=f"{option} reads the Trainer.s predictions.*eval_loss/<source>"):
        build_trainer(trainer_name, "padded", str(tmp_path), {option: metric})
    monkeypatch.undo()
    trainer = build_trainer(trainer_name, "padded", str(tmp_path))
    setattr(trainer, option, metric)
    with pytest.raises(ValueError, match=f"{option} reads the Trainer.s predictions"):
        trainer.evaluate()


# --- two processes ---------------------------------------------------------------------------

WORLD = 2


def worker(rank: int, store: str, out_dir: str) -> None:
    """Every two-process layout at every batch size; each rank saves the results and the
    conversations each trainer evaluated."""
    start_rank(rank, WORLD, store)
    try:
        results = {}
        for trainer_name, layout in TWO_PROCESS_LAYOUTS:
            if trainer_name == "PackedSFTTrainer" and not HAS_TRL:
                continue
            trainer = build_trainer(trainer_name, layout, out_dir, ddp_backend="gloo")
            results[trainer_name, layout] = (
                evaluate_at_each_batch_size(trainer), evaluated_conversations(trainer.eval_dataset)
            )
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_eval_loss_on_two_processes_leaves_out_accelerates_copies(tmp_path):
    """Seven conversations over two processes: at batch sizes 1 and 2 the second process's last
    batch holds a copy of the first conversation, at 64 both batches are completed with copies
    (all of the second process's)."""
    spawn_ranks(worker, (rendezvous(tmp_path), str(tmp_path)), WORLD)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    assert ranks[0].keys() == ranks[1].keys() and ranks[0]
    for key, (results, found) in ranks[0].items():
        assert ranks[1][key][0] == results  # every process reports the same
        assert_matches(results, reference(found), f"two processes, {' '.join(key)}")


# --- accelerate's copies, without a model ------------------------------------------------------


@pytest.mark.parametrize("split_batches", [False, True], ids=["per-process", "split"])
def test_copies_are_found_where_accelerate_puts_them(split_batches):
    """For every data set size, batch size and process count, accelerate's own
    ``BatchSamplerShard`` deals the batches; the examples the evaluation keeps (the last batch's
    rows left unmasked by ``without_copies``, at accelerate's ``remainder``) are every example
    exactly once."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    from packed_ce.columns import EXAMPLE_TOKENS
    from packed_ce.integrations.trainers.copies import copies_layout, without_copies

    for world in (2, 3):
        for per_process in (1, 2, 3):
            size = per_process * world if split_batches else per_process
            for count in range(1, 10):
                kept = []
                for rank in range(world):
                    sampler = BatchSamplerShard(BatchSampler(SequentialSampler(range(count)), size, False),
                                                world, rank, split_batches=split_batches)
                    batches = list(sampler)
                    loader = SimpleNamespace(batch_sampler=sampler, dataset=range(count))
                    layout = copies_layout(loader, world, "test")
                    # DataLoaderShard.begin: length % total batch size
                    remainder = count % (size if split_batches else size * world)
                    last = torch.tensor(batches[-1])
                    batch = {"labels": last[:, None], EXAMPLE_TOKENS: torch.ones(len(last), dtype=torch.int64)}
                    batch = without_copies(batch, layout, remainder, ignore_index=-1)
                    kept += sum(batches[:-1], []) + batch["labels"][batch["labels"] >= 0].tolist()
                assert sorted(kept) == list(range(count)), (world, size, count, kept)


def test_eval_set_without_length_over_processes_is_refused():
    """accelerate's ``IterableDatasetShard`` completes the last batch with copies that nothing
    tells apart, and a ``datasets`` stream split by its shards gives processes uneven batches:
    refused naming the fix; with ``drop_last`` (no copies) or one process, taken."""
    from types import SimpleNamespace

    from accelerate.data_loader import IterableDatasetShard

    from packed_ce.integrations.trainers.copies import copies_layout

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(5))

    shard = IterableDatasetShard(Stream(), batch_size=2, num_processes=2)
    with pytest.raises(ValueError, match="without a length over 2 processes: .* pass a data set with a length"):
        copies_layout(SimpleNamespace(dataset=shard), 2, "PackedTrainer")
    assert copies_layout(SimpleNamespace(dataset=shard), 1, "PackedTrainer") is None
    dropping = IterableDatasetShard(Stream(), batch_size=2, drop_last=True, num_processes=2)
    assert copies_layout(SimpleNamespace(dataset=dropping), 2, "PackedTrainer") is None
    # a datasets stream of enough shards, which accelerate splits by shard (each process collating
    # its own batches): the processes' batch counts may differ
    from datasets import Dataset

    shards = Dataset.from_dict({"x": list(range(5))}).to_iterable_dataset(num_shards=2)
    with pytest.raises(ValueError, match="different numbers of batches"):
        copies_layout(SimpleNamespace(dataset=shards.shard(2, 0)), 2, "PackedTrainer")
    assert copies_layout(SimpleNamespace(dataset=shards), 1, "PackedTrainer") is None


@pytest.mark.skipif(not HAS_TRL, reason="needs trl")
@pytest.mark.parametrize(
    "layout", [dict(padding_free=True, max_length=None), dict(packing=True, max_length=512)],
    ids=["padding_free", "packing"],
)
def test_predict_prepares_untokenised_conversations(layout, tmp_path):
    """trl's ``predict()`` took a data set of conversations as it was: with a ``source`` or
    ``weight`` column its collator raised a bare ``KeyError: 'input_ids'`` (without, transformers'
    "No columns in the dataset match"). PackedSFTTrainer prepares it as ``evaluate()`` does:
    ``test_loss`` and ``test_loss/<source>`` are the weighted per-conversation means of every
    conversation alone, and ``evaluate()``'s on the same data."""
    import collators
    from packed_ce.integrations import PackedSFTTrainer

    from integration_utils import relative_error, sft_tokenizer

    tokenizer = sft_tokenizer()
    data = collators.load_default_dataset().select(range(7)).remove_columns("category")
    data = data.add_column("weight", WEIGHTS).add_column("source", SOURCES)
    trainer = PackedSFTTrainer(model=tiny_causal_lm(len(tokenizer)), args=sft_args(tmp_path, assistant_only_loss=True,
                                                                                  per_device_eval_batch_size=2, **layout),
                               train_dataset=data, processing_class=tokenizer)
    metrics = trainer.predict(data).metrics
    found = [collators.tokenize_conversation(tokenizer, m) for m in data["messages"]]
    with torch.no_grad():
        expected = one_at_a_time(trainer.model, found, WEIGHTS)
        assert relative_error(torch.tensor(metrics["test_loss"]), expected) <= 1e-5
        for source in set(SOURCES):
            picked = [i for i, s in enumerate(SOURCES) if s == source]
            mean = one_at_a_time(trainer.model, [found[i] for i in picked], [WEIGHTS[i] for i in picked])
            assert relative_error(torch.tensor(metrics[f"test_loss/{source}"]), mean) <= 1e-5
    assert metrics["test_loss"] == pytest.approx(trainer.evaluate(data)["eval_loss"], rel=1e-12)
