"""PackedTrainer: an optimiser step over accumulated micro-batches is one per-sequence average.

Three steps with gradient accumulation 2 on packed rows of different sizes, so that the
micro-batches of a step hold different numbers of conversations (a mean of micro-batch means
would weigh them wrongly). The ground truth is a plain loop: for each step, the conversations of
its micro-batches one at a time through transformers' own loss, averaged, one SGD step. Packed
rows (PackedCollator, also with the fused linear forward and with an all-ones attention_mask)
and the same conversations padded (PaddedCollator) through PackedTrainer must all land on its
parameters. (The stock Trainer, which divides by a token count, is refused:
tests/test_integration_guards.py.)
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import SequentialSampler
from transformers import TrainingArguments

from collators import PackedCollator, PaddedCollator, pack_dataset, shard_batch
from packed_ce.integrations import PackedTrainer, apply_packed_loss, count_num_items

from integration_utils import (
    assert_loss_close,
    assert_gradients_close,
    one_at_a_time,
    split_rows,
    synthetic_conversations,
    tiny_model,
)

VOCAB = 96
BATCH_ROWS = 2  # packed rows per micro-batch
ACCUMULATION = 2
STEPS = 3
LR = 0.5

Dataset = pytest.importorskip("datasets").Dataset  # the GPU machine has no datasets


class SequentialTrainerMixin:
    """Rows in data set order, so that the ground truth knows which rows make each step."""

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)


class SequentialPackedTrainer(SequentialTrainerMixin, PackedTrainer):
    pass


def packed_rows() -> Dataset:
    """Packed rows of 32 tokens holding one to several conversations, some without a target."""
    lengths = torch.randint(1, 31, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    conversations = synthetic_conversations(lengths, VOCAB, seed=1)
    rows = pack_dataset(Dataset.from_list(conversations), max_length=32)
    assert rows.num_rows >= STEPS * ACCUMULATION * BATCH_ROWS
    return rows.select(range(STEPS * ACCUMULATION * BATCH_ROWS))


def training_args(tmp_path, **overrides) -> TrainingArguments:
    fields = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH_ROWS,
        gradient_accumulation_steps=ACCUMULATION,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        max_grad_norm=0.0,  # no clipping: compare raw gradient steps
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        dataloader_num_workers=0,
        seed=0,
    )
    return TrainingArguments(**{**fields, **overrides})


def sgd(model):
    """Plain SGD at a constant rate: the step is the gradient, nothing else."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)


def ground_truth(rows: Dataset):
    """Parameters and per-step losses of unpacked per-sequence training, one process."""
    model = tiny_model("llama", VOCAB)
    optimizer, _ = sgd(model)
    per_step = BATCH_ROWS * ACCUMULATION
    losses = []
    for step in range(STEPS):
        conversations = split_rows([rows[i] for i in range(step * per_step, (step + 1) * per_step)])
        optimizer.zero_grad()
        loss = one_at_a_time(model, conversations)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def train(trainer_class, rows, collator, tmp_path, *, fused_linear=False):
    model = apply_packed_loss(tiny_model("llama", VOCAB), is_packed=True, fused_linear=fused_linear)
    trainer = trainer_class(
        model=model,
        args=training_args(tmp_path),
        train_dataset=rows,
        data_collator=collator,
        optimizers=sgd(model),
        skip_no_assistant=True,  # packed_rows() holds conversations without a target: they weigh 0
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return model, losses


def padded_rows(rows):
    """The conversations of packed rows, one per row: the unpacked layout of the same step."""
    return PaddedCollator()(split_rows(rows))


def updates(model, initial):
    return {name: p.detach() - initial[name] for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def truth():
    rows = packed_rows()
    initial = {
        name: p.detach().clone() for name, p in tiny_model("llama", VOCAB).named_parameters()
    }
    model, losses = ground_truth(rows)
    return rows, initial, updates(model, initial), losses


def packed_rows_with_mask(rows):
    """Packed rows plus an all-ones attention_mask, which alone would let conversations attend
    to each other: the packed loss's pre-hook drops it."""
    batch = PackedCollator()(rows)
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}


COLLATORS = {
    "packed": PackedCollator(),
    "padded": padded_rows,
    "packed-fused": PackedCollator(),
    "packed-attention_mask": packed_rows_with_mask,
}


@pytest.mark.parametrize("layout", list(COLLATORS))
def test_packed_trainer_matches_unpacked_per_sequence_training(truth, layout, tmp_path):
    rows, initial, expected_updates, expected_losses = truth
    collator = COLLATORS[layout]
    fused = layout == "packed-fused"  # the loss from the hidden states, no logits
    model, losses = train(SequentialPackedTrainer, rows, collator, tmp_path, fused_linear=fused)
    # the logged loss of a step is the global per-sequence mean
    for actual, expected in zip(losses, expected_losses):
        assert_loss_close(torch.tensor(actual), torch.tensor(expected))
    worst = assert_gradients_close(updates(model, initial), expected_updates)
    print(f"{layout}: worst relative parameter-update error {worst:.2e}")


def test_packed_trainer_keeps_seq_lengths_column(truth, tmp_path):
    """remove_unused_columns must not drop seq_lengths: a packed row would become one sequence."""
    rows = truth[0]
    shared = rows.select([i for i, lengths in enumerate(rows["seq_lengths"]) if len(lengths) > 1])
    model = apply_packed_loss(tiny_model("llama", VOCAB))
    trainer = SequentialPackedTrainer(
        model=model,
        args=training_args(tmp_path),
        train_dataset=shared,
        data_collator=PackedCollator(),
        skip_no_assistant=True,  # conversations without a target stay in their rows
    )
    assert trainer.args.remove_unused_columns
    batch = next(iter(trainer.get_train_dataloader()))
    expected = [0] + torch.tensor(sum(shared[:BATCH_ROWS]["seq_lengths"], [])).cumsum(0).tolist()
    assert batch["cu_seqlens"].tolist() == expected


def test_streamed_rows_train_exactly_on_one_process(truth, tmp_path):
    """The streaming path (a datasets.IterableDataset packed by PackedIterableDataset, collated by
    PackedCollator) on one process: accelerate dispatched such data by default and cut every
    tensor to the first one's batch size, cu_seqlens (S+1,) to (1,) ("seq_targets must have shape
    (S,) = (0,)"); now each process collates its own batches and the steps are the ground truth's
    on the streamed rows. ``dispatch_batches=True`` is refused by name."""
    from collators import PackedIterableDataset

    conversations = split_rows(packed_rows())  # ordered by the packer: a stream of them repacks alike
    stream = PackedIterableDataset(Dataset.from_list(conversations).to_iterable_dataset(), max_length=32)
    rows = list(stream)[: STEPS * ACCUMULATION * BATCH_ROWS]
    model, losses = train(PackedTrainer, stream, PackedCollator(), tmp_path)
    reference, expected_losses = ground_truth(rows)
    for actual, expected in zip(losses, expected_losses, strict=True):
        assert_loss_close(torch.tensor(actual), torch.tensor(expected))
    initial = truth[1]
    assert_gradients_close(updates(model, initial), updates(reference, initial))
    with pytest.raises(ValueError, match="dispatch_batches=True slices every tensor of a batch"):
        PackedTrainer(model=model, args=training_args(tmp_path, accelerator_config={"dispatch_batches": True}),
                      train_dataset=stream, data_collator=PackedCollator())


def test_packed_trainer_needs_the_packed_loss(tmp_path):
    with pytest.raises(ValueError, match="apply_packed_loss"):
        PackedTrainer(model=tiny_model("llama", VOCAB), args=training_args(tmp_path))


def test_bad_label_raises_before_the_optimiser_step(truth, tmp_path, monkeypatch):
    """On CUDA the values are checked on the device and the error comes later: the trainer reads
    it before the optimiser step, so no step trains on the batch's NaN gradients. Deferred here
    on CPU tensors as on CUDA."""
    from packed_ce import pending

    monkeypatch.setattr(pending, "defers_checks", lambda device: True)
    rows = truth[0]
    # in the step's last micro-batch: no later loss call of the step would raise it
    bad = rows.map(lambda row, i: {"labels": row["labels"][:-1] + [VOCAB + 5]} if i == 3 else {},
                   with_indices=True)
    model = apply_packed_loss(tiny_model("llama", VOCAB), backend="triton")
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = SequentialPackedTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1),
        train_dataset=bad,
        data_collator=PackedCollator(),
        optimizers=sgd(model),
        skip_no_assistant=True,  # conversations without a target stay in their rows
    )
    with pytest.raises(ValueError, match="labels must be in"):
        trainer.train()
    assert pending.pending_count() == 0
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), initial[name]), f"{name} was stepped on bad input"


def test_split_and_weighted_conversations_keep_their_weight(tmp_path):
    """Conversations longer than the row split into pieces (overflow="split") and weighted by a
    `weight` column: one PackedTrainer step (two micro-batches) equals the loop that runs every
    piece alone and weighs each target by its conversation's weight / whole target count,
    divided by the weight mass of the step. Without the seq_targets / seq_weights columns (the
    trainer keeps them) a split conversation would weigh as many conversations as it has pieces."""
    import torch.nn.functional as F

    lengths = [70, 5, 45, 12, 33, 20, 64, 9]
    conversations = synthetic_conversations(lengths, VOCAB, seed=3)
    for i, conversation in enumerate(conversations):
        conversation["weight"] = [0.5, 1.0, 2.0][i % 3]
    rows = pack_dataset(Dataset.from_list(conversations), max_length=32, overflow="split")
    assert max(len(t) for t in rows["seq_targets"]) and rows.num_rows > 2

    truth = tiny_model("llama", VOCAB)
    optimizer, _ = sgd(truth)
    total, mass = 0.0, 0.0
    for row in rows:
        start = 0
        for length, targets, weight in zip(row["seq_lengths"], row["seq_targets"], row["seq_weights"]):
            ids = torch.tensor([row["input_ids"][start : start + length]])
            labels = torch.tensor(row["labels"][start : start + length])
            labels[0] = -100  # the collator's first label of every sequence
            start += length
            trained = (labels[1:] != -100).sum().item()
            if trained == 0:
                continue
            logits = truth(input_ids=ids, use_cache=False).logits[0, :-1]
            token_sum = F.cross_entropy(logits, labels[1:], ignore_index=-100, reduction="sum")
            total = total + weight / targets * token_sum
            mass += weight * trained / targets
    (total / mass).backward()
    optimizer.step()

    model = apply_packed_loss(tiny_model("llama", VOCAB), is_packed=True)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = SequentialPackedTrainer(
        model=model,
        args=training_args(tmp_path, max_steps=1, per_device_train_batch_size=(rows.num_rows + 1) // 2),
        train_dataset=rows,
        data_collator=PackedCollator(),
        optimizers=sgd(model),
    )
    trainer.train()
    expected = updates(truth, initial)
    worst = assert_gradients_close(updates(model, initial), expected)
    print(f"split + weighted: worst relative parameter-update error {worst:.2e}")


@pytest.mark.parametrize("engine_dtype", [torch.float32, torch.bfloat16])
def test_weights_keep_their_dtype_where_deepspeed_casts_the_batch(engine_dtype, tmp_path, monkeypatch):
    """Under DeepSpeed the Trainer casts every floating tensor of a batch to the engine's dtype
    (stood in for: no DeepSpeed engine is needed to prepare a batch); the weights of the
    objective stay float64, exactly as collated, while the activations' inputs are cast."""
    from types import SimpleNamespace

    model = apply_packed_loss(tiny_model("llama", VOCAB), is_packed=True)
    trainer = PackedTrainer(model=model, args=training_args(tmp_path), data_collator=PackedCollator())
    plugin = SimpleNamespace(hf_ds_config=SimpleNamespace(dtype=lambda: engine_dtype))
    monkeypatch.setattr(trainer, "is_deepspeed_enabled", True)
    monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))
    # neither float32 (0 and inf) nor bf16 (0.10009765625) holds these weights
    weights = torch.tensor([1e-46, 0.1, 1e39], dtype=torch.float64)
    batch = {"input_ids": torch.tensor([[5, 6, 7]]), "seq_weights": weights,
             "inputs_embeds": torch.zeros(1, 3, 2)}  # fmt: skip
    prepared = trainer._prepare_inputs(batch)
    assert prepared["inputs_embeds"].dtype == engine_dtype  # the Trainer's cast is on
    assert prepared["input_ids"].dtype == torch.int64
    torch.testing.assert_close(prepared["seq_weights"], weights, rtol=0, atol=0)
    assert batch["seq_weights"] is weights  # the caller's batch is left as it was


def one_rank_context_parallel(tmp_path):
    """A PackedTrainer whose model has context parallelism over a group of one rank (the row unchanged)."""
    from packed_ce.integrations import enable_context_parallel
    from packed_ce.integrations.context_parallel import context_parallel_of

    model = enable_context_parallel(apply_packed_loss(tiny_model("llama", VOCAB), is_packed=True))
    trainer = PackedTrainer(model=model, args=training_args(tmp_path), data_collator=PackedCollator())
    trainer._context_parallel = context_parallel_of(model)
    return model, trainer, PackedCollator()(synthetic_conversations([9, 7], VOCAB))


def test_context_parallel_step_refuses_an_unsharded_row(tmp_path, one_rank_group):
    """With context parallelism on, a model call whose row did not pass through
    ``_prepare_context_parallel_inputs`` (a Trainer that stopped calling it) raises instead of
    training every rank on the whole row; after the override ran, the call goes through."""
    model, trainer, batch = one_rank_context_parallel(tmp_path)
    with pytest.raises(RuntimeError, match="did not call Trainer._prepare_context_parallel_inputs"):
        trainer.compute_loss(model, batch)
    _, sharded = trainer._prepare_context_parallel_inputs(model, batch)
    assert torch.isfinite(trainer.compute_loss(model, sharded, num_items_in_batch=count_num_items(batch)))
    with pytest.raises(RuntimeError, match="did not call"):  # decided by each call's batch
        trainer.compute_loss(model, batch)


def test_context_parallel_evaluation_gives_the_loss_only(tmp_path, one_rank_group):
    """Under context parallelism a rank holds a shard of the row's logits: a prediction step
    asking for them (predict()) is refused, naming the fix; the loss alone is computed on the
    shard with the row's normaliser (compared with the per-conversation mean in
    tests/test_context_parallel.py)."""
    model, trainer, batch = one_rank_context_parallel(tmp_path)
    with pytest.raises(ValueError, match="loss only: set prediction_loss_only=True"):
        trainer.prediction_step(model, batch, prediction_loss_only=False)
    loss, logits, labels = trainer.prediction_step(model, batch, prediction_loss_only=True)
    assert logits is None and labels is None
    with torch.no_grad():
        expected = model(**shard_batch(batch, 0, 1), num_items_in_batch=count_num_items(batch)).loss
    torch.testing.assert_close(loss, expected)
