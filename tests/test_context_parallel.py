"""Context parallelism: the ranks' loss shares add up to the one-process loss, their gradients too,
and every misuse is the same ``ValueError`` on every rank (never an abort or a hang).

Two gloo processes (``integration_utils.spawn_ranks``) each run
``model(**shard_batch(batch, rank, 2), num_items_in_batch=n)`` with :func:`enable_context_parallel`
and write their loss share and gradients to files; the test compares their sums with one process
running ``model(**batch)``, or, for the families with sliding windows, softcaps and sinks, with
every conversation run alone (float32, 1e-5 relative for the loss and, norm-wise, for every
gradient).

The batch packs conversations that cross chunk and rank borders (a row of 96 tokens in 4 chunks
of 24), one that lies wholly inside one chunk, one without a target, the padding segment, per-
conversation weights and the pieces of a split conversation (``seq_targets`` of the whole).

Run the same workers on two GPUs (NCCL, flex attention, float32 and bfloat16) with
``PYTHONPATH=$PWD python -m pytest -q -p no:cacheprovider -m cuda -s tests/test_context_parallel.py``.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from collators import PackedCollator, shard_batch
from integration_utils import (
    assert_gradients_close,
    assert_loss_close,
    gradients,
    rendezvous,
    spawn_ranks,
    start_rank,
    synthetic_conversations,
    tiny_model,
)
from packed_ce.integrations import (
    apply_packed_loss,
    count_num_items,
    disable_context_parallel,
    enable_context_parallel,
    tiny_causal_lm,
)

VOCAB = 96
WORLD = 2
# conversation lengths of one row: 31 crosses the first chunk border, 7 lies inside chunk 1,
# 2 has at most one target, 40 crosses two borders (and the ranks), 9 is split in two pieces
LENGTHS = [31, 7, 2, 40, 5, 4]
WEIGHTS = [1.0, 2.0, 0.5, 3.0, 1.5, 1.5]  # the two pieces of one conversation share its weight
ROW = 96  # a multiple of 2 * WORLD; the collator pads 89 tokens up to it

# The set-ups under test: (model family, apply_packed_loss keywords, gradient checkpointing, LoRA)
SETUPS = {
    "llama-logits": ("llama", {}, False, False),
    "llama-fused-checkpointing": ("llama", {"fused_linear": True}, True, False),
    "qwen2-logits-lora": ("qwen2", {}, False, True),
}
# Families trained on long conversations, with windows (8 tokens: shorter than most of LENGTHS)
# on all layers or alternating ones, Gemma 2's attention softcap and gpt-oss's attention sinks.
WINDOW = 8
FAMILIES = {
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 30.0},
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "cohere2": {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
    "gpt_oss": {"head_dim": 16, "sliding_window": WINDOW, "num_local_experts": 4,
                "num_experts_per_tok": 2, "layer_types": ["sliding_attention", "full_attention"]},
}


def packed_batch(scale: int = 1, seed: int = 7) -> dict:
    """The row of LENGTHS (each length times ``scale``), padded to ROW * scale tokens."""
    conversations = synthetic_conversations([n * scale for n in LENGTHS], VOCAB, seed=seed)
    # the last two are the pieces of one split conversation: its targets count once for both
    pieces = conversations[-2:]
    whole = sum(sum(label != -100 for label in c["labels"][1:]) for c in pieces)
    examples = []
    for index, (conversation, weight) in enumerate(zip(conversations, WEIGHTS)):
        example = {**conversation, "seq_weights": [weight]}
        if index >= len(conversations) - 2:
            example["seq_targets"] = [max(whole, 1)]
        examples.append(example)
    return PackedCollator(pad_to_multiple_of=ROW * scale)(examples)


def build_model(setup: str, device: str = "cpu", dtype=torch.float32):
    arch, loss_options, checkpointing, lora = SETUPS[setup]
    model = tiny_model(arch, VOCAB, sliding_window=None).to(device=device, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if lora:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], init_lora_weights=False)
        torch.manual_seed(1)  # random adapters (not the zero B of a fresh LoRA), the same in every process
        model = get_peft_model(model, config)
    apply_packed_loss(model, backend="torch", **loss_options)
    model.train()
    return model


def build_family(family: str, device: str = "cpu", dtype=torch.float32):
    """A tiny model of ``family`` (FAMILIES) with the packed loss; eager attention, which every
    family has and which is exact for a conversation alone."""
    model = tiny_causal_lm(VOCAB, model_type=family, attn_implementation="eager", **FAMILIES[family])
    return apply_packed_loss(model.to(device=device, dtype=dtype), backend="torch").train()


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def init_group(rank: int, store: str, backend: str = "gloo", world: int = WORLD) -> torch.device:
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    start_rank(rank, world, store, backend)
    return device


def save_share(model, loss, path: str) -> None:
    grads = {k: v.float().cpu() for k, v in gradients(model).items()}
    torch.save({"loss": loss.detach().float().cpu(), "grads": grads}, path)


def worker(
    rank: int, store: str, backend: str, out_dir: str, setups: list, dtype_name: str, scale: int = 1,
    chunk_tokens: int | None = None,
) -> None:
    device = init_group(rank, store, backend)
    dtype = getattr(torch, dtype_name)
    if chunk_tokens is not None:  # rows cut as finely as long ones are (m > 2 chunks per rank)
        import collators.sharding

        collators.sharding.CHUNK_TOKENS = chunk_tokens
    try:
        batch = to_device(packed_batch(scale), device)
        local = count_num_items(batch, all_reduce=False)
        # the contract's normaliser: summed over the ranks, each counting the batch it shards
        # (counted before any model enables context parallelism: the count does not depend on it)
        num_items = count_num_items(batch)
        assert num_items.item() == WORLD * local.item(), (num_items, local)
        shard = shard_batch(batch, rank, WORLD)
        for setup in setups:
            model = (build_family if setup in FAMILIES else build_model)(setup, device, dtype)
            enable_context_parallel(model)
            model.zero_grad(set_to_none=True)
            loss = model(**shard, num_items_in_batch=num_items).loss
            loss.backward()
            save_share(model, loss, os.path.join(out_dir, f"{setup}-rank{rank}.pt"))
            disable_context_parallel(model)
    finally:
        dist.destroy_process_group()


def run_ranks(
    tmp_path, backend: str, setups: list, dtype_name: str = "float32", scale: int = 1, chunk_tokens=None
) -> dict:
    spawn_ranks(
        worker, (rendezvous(tmp_path), backend, str(tmp_path), setups, dtype_name, scale, chunk_tokens), WORLD
    )
    results = {}
    for setup in setups:
        ranks = [torch.load(tmp_path / f"{setup}-rank{rank}.pt") for rank in range(WORLD)]
        results[setup] = {
            "loss": sum(r["loss"] for r in ranks),
            "grads": {k: sum(r["grads"][k] for r in ranks) for k in ranks[0]["grads"]},
        }
    return results


def one_process(setup: str, device="cpu", dtype=torch.float32, scale: int = 1) -> tuple[torch.Tensor, dict]:
    """The loss and gradients the shares must add up to: one process's packed row (SETUPS), or
    every conversation alone (FAMILIES: independent of the family's own packed masks)."""
    if setup in FAMILIES:
        model = build_family(setup, device, dtype)
        loss = per_conversation_mean(model, scale)
    else:
        model = build_model(setup, device, dtype)
        loss = model(**to_device(packed_batch(scale), device)).loss
    loss.backward()
    return loss.detach().float().cpu(), {k: v.float().cpu() for k, v in gradients(model).items()}


def per_conversation_mean(model, scale: int = 1) -> torch.Tensor:
    """The weighted mean of each conversation's mean token loss, every conversation alone."""
    device = next(model.parameters()).device
    conversations = synthetic_conversations([n * scale for n in LENGTHS], VOCAB, seed=7)
    sums, counts = [], []
    for conversation in conversations:
        ids = torch.tensor([conversation["input_ids"]], device=device)
        labels = torch.tensor(conversation["labels"][1:], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        losses = torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")
        sums.append(losses.sum())
        counts.append((labels != -100).sum())
    # the two pieces are one conversation
    sums = sums[:-2] + [sums[-2] + sums[-1]]
    counts = counts[:-2] + [counts[-2] + counts[-1]]
    weights = WEIGHTS[:-1]
    total = sum(w * s / c for w, s, c in zip(weights, sums, counts) if c > 0)
    return total / sum(w for w, c in zip(weights, counts) if c > 0)


@pytest.fixture(scope="module")
def gloo_results(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("cp"), "gloo", [*SETUPS, *FAMILIES])


@pytest.mark.parametrize("setup", list(SETUPS))
def test_shares_add_up_to_one_process(setup, gloo_results):
    """Two gloo ranks, float32: the shares' sum within 1e-5 of one process's loss (itself the
    per-conversation mean), every summed gradient within 1e-5 norm-wise of its gradient (about 2e-7
    measured)."""
    expected_loss, expected_grads = one_process(setup)
    assert_loss_close(gloo_results[setup]["loss"], expected_loss)
    assert_loss_close(expected_loss, per_conversation_mean(build_model(setup)).detach())
    worst = assert_gradients_close(gloo_results[setup]["grads"], expected_grads, rtol=1e-5)
    print(f"{setup}: worst relative gradient error {worst:.1e}")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_windows_softcaps_and_sinks_are_exact(family, gloo_results):
    """Sliding windows (on every layer, or alternating with full ones), Gemma 2's attention
    softcap and gpt-oss's sinks: the two ranks' shares add up to every conversation run alone, loss
    and every gradient (1e-5). The window (8) is shorter than most conversations: a share that
    ignored it would be off by far more."""
    expected_loss, expected_grads = one_process(family)
    assert_loss_close(gloo_results[family]["loss"], expected_loss)
    worst = assert_gradients_close(gloo_results[family]["grads"], expected_grads, rtol=1e-5)
    print(f"{family}: worst relative gradient error {worst:.1e}")


def test_shares_add_up_with_many_chunks_per_rank(tmp_path):
    """Rows cut into 6 chunks per rank (as long rows are: chunks dealt out to balance the ranks'
    attention work, not the zig-zag): the shares still add up to one process, with and without a
    sliding window (1e-5)."""
    results = run_ranks(tmp_path, "gloo", ["llama-logits", "mistral"], chunk_tokens=8)
    for setup in results:
        expected_loss, expected_grads = one_process(setup)
        assert_loss_close(results[setup]["loss"], expected_loss)
        assert_gradients_close(results[setup]["grads"], expected_grads, rtol=1e-5)


def _groups_worker(rank: int, store: str, out_dir: str, world: int, cp_sizes: list, setups: list) -> None:
    """``world`` ranks, for each of ``cp_sizes`` in groups of that many consecutive ranks; group
    ``g`` shares row ``g`` (data parallelism across the groups)."""
    init_group(rank, store, world=world)
    try:
        for cp_size in cp_sizes:
            groups = [dist.new_group(list(range(g, g + cp_size))) for g in range(0, world, cp_size)]
            row = packed_batch(seed=7 + rank // cp_size)
            shard = shard_batch(row, rank % cp_size, cp_size)
            num_items = count_num_items(row)  # every rank counts the row it shards, over the world
            for setup in setups:
                model = (build_family if setup in FAMILIES else build_model)(setup)
                enable_context_parallel(model, group=groups[rank // cp_size])
                loss = model(**shard, num_items_in_batch=num_items).loss
                loss.backward()
                save_share(model, loss, os.path.join(out_dir, f"{setup}-{cp_size}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, cp_sizes", [(4, [4, 2]), pytest.param(8, [8], marks=pytest.mark.slow)], ids=["4-ranks", "8-ranks"]
)
def test_groups_of_four_and_eight_and_data_parallel_groups(tmp_path, world, cp_sizes):
    """Context parallelism over 4 and 8 gloo processes, and on 4 two groups of 2 each sharing its
    own row (context x data parallelism): every rank's share summed over the world equals one
    process on every group's row with the step's normaliser, loss and gradients (1e-5), with and
    without a sliding window, with Gemma 2's softcap."""
    setups = ["llama-logits", "mistral", "gemma2"]
    spawn_ranks(_groups_worker, (rendezvous(tmp_path), str(tmp_path), world, cp_sizes, setups), world)
    for cp_size in cp_sizes:
        rows = [packed_batch(seed=7 + g) for g in range(world // cp_size)]
        count = count_num_items(rows)
        for setup in setups:
            ranks = [torch.load(tmp_path / f"{setup}-{cp_size}-rank{rank}.pt") for rank in range(world)]
            model = (build_family if setup in FAMILIES else build_model)(setup)
            expected = sum(model(**row, num_items_in_batch=count).loss for row in rows)
            expected.backward()
            assert_loss_close(sum(r["loss"] for r in ranks), expected.detach())
            summed = {k: sum(r["grads"][k] for r in ranks) for k in ranks[0]["grads"]}
            assert_gradients_close(summed, gradients(model), rtol=1e-5)


def test_batch_crosses_chunks_and_ranks():
    """The batch exercises what the docstring says: conversations across chunk and rank borders,
    one inside a chunk, the padding segment."""
    batch = packed_batch()
    bounds = batch["cu_seqlens"].tolist()
    chunk = ROW // (2 * WORLD)
    crossing = [(a, b) for a, b in zip(bounds, bounds[1:]) if a // chunk != (b - 1) // chunk]
    inside = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a and a // chunk == (b - 1) // chunk]
    assert len(crossing) >= 2 and inside and bounds[-1] == ROW and bounds[-2] < ROW


def test_one_rank_group_is_the_plain_model(tmp_path):
    spawn_ranks(_one_rank_worker, (rendezvous(tmp_path), str(tmp_path)), 1)
    loss = torch.load(tmp_path / "one.pt")
    assert_loss_close(loss, one_process("llama-logits")[0])


def _one_rank_worker(rank: int, store: str, out_dir: str) -> None:
    init_group(0, store, world=1)
    try:
        model = build_model("llama-logits")
        attention = model.config._attn_implementation
        enable_context_parallel(model)
        assert model.config._attn_implementation == attention
        batch = packed_batch()
        loss = model(**shard_batch(batch, 0, 1), num_items_in_batch=count_num_items(batch)).loss
        torch.save(loss.detach(), os.path.join(out_dir, "one.pt"))
        disable_context_parallel(model)
    finally:
        dist.destroy_process_group()


# --- misuse: the same ValueError on every rank ---------------------------------------------------


def _misuses(rank: int, batch: dict, shard: dict, num_items, device) -> dict:
    """Each misuse as ``(model builder, call)``; the model built fresh for each."""
    other_row = to_device(packed_batch(seed=8), device)  # the same length, other tokens
    longer = to_device(PackedCollator(pad_to_multiple_of=ROW + 2 * WORLD)(
        [{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}] * 33
    ), device)
    n = num_items

    def on_device(model):
        return model.to(device)

    def cp():
        return enable_context_parallel(on_device(build_model("llama-logits")))

    def dropout(make):
        return lambda: enable_context_parallel(apply_packed_loss(on_device(make())))

    return {
        "shard without context parallelism": (lambda: on_device(build_model("llama-logits")), lambda m: m(**shard, num_items_in_batch=n)),
        "the whole batch": (cp, lambda m: m(**batch, num_items_in_batch=n)),
        "a shard for 4 ranks": (cp, lambda m: m(**shard_batch(batch, rank, 4), num_items_in_batch=n)),
        "the ranks' shards swapped": (cp, lambda m: m(**shard_batch(batch, 1 - rank, WORLD), num_items_in_batch=n)),
        "rows of different lengths": (cp, lambda m: m(**shard_batch(longer if rank else batch, rank, WORLD), num_items_in_batch=n)),
        "different rows": (cp, lambda m: m(**shard_batch(other_row if rank else batch, rank, WORLD), num_items_in_batch=n)),
        "no num_items_in_batch": (cp, lambda m: m(**shard)),
        "the local count": (cp, lambda m: m(**shard, num_items_in_batch=count_num_items(batch, all_reduce=False))),
        "no shift_labels": (cp, lambda m: m(**{k: v for k, v in shard.items() if k != "shift_labels"}, num_items_in_batch=n)),
        "no position_ids": (cp, lambda m: m(**{**shard, "position_ids": None}, num_items_in_batch=n)),
        "the decoder called directly": (cp, lambda m: _no_grad(m.model)(input_ids=shard["input_ids"], position_ids=shard["position_ids"])),
        "attention dropout in training": (
            dropout(lambda: tiny_model("llama", VOCAB, attention_dropout=0.1)), lambda m: m(**shard, num_items_in_batch=n),
        ),
        "GPT-2's attn_pdrop in training": (
            dropout(lambda: tiny_causal_lm(VOCAB, model_type="gpt2", attn_pdrop=0.1)), lambda m: m(**shard, num_items_in_batch=n),
        ),
    }


def _no_grad(function):
    """``function`` under ``torch.no_grad()`` (a decoder called directly for another purpose)."""
    return torch.no_grad()(function)


# What each misuse's error says, on every rank.
MISUSE_MESSAGES = {
    "shard without context parallelism": "not enabled on this",
    "the whole batch": "not a shard",
    "a shard for 4 ranks": r"shard cut for rank \d of 4",
    "the ranks' shards swapped": "holds the shard cut for rank",
    "rows of different lengths": "different lengths",
    "different rows": "sharded different rows",
    "no num_items_in_batch": "without num_items_in_batch",
    "the local count": "less than 2 times",
    "no shift_labels": "without shift_labels",
    "no position_ids": "position_ids",
    "the decoder called directly": "not its decoder",
    "attention dropout in training": "config.attention_dropout",
    "GPT-2's attn_pdrop in training": "config.attn_pdrop",
}


def _misuse_worker(rank: int, store: str, out_dir: str, backend: str) -> None:
    device = init_group(rank, store, backend)
    try:
        batch = to_device(packed_batch(), device)
        shard = shard_batch(batch, rank, WORLD)
        num_items = count_num_items(batch)
        misuses = _misuses(rank, batch, shard, num_items, device)
        seen = {}
        for name, (build, call) in misuses.items():
            model = build()
            try:
                call(model)
                seen[name] = "no error"
            except ValueError as error:
                seen[name] = str(error)
        # the group is still in step: a correct call after every refusal, a dropout model in eval
        for build in (misuses["attention dropout in training"][0], misuses["the whole batch"][0]):
            model = build().eval()
            seen.setdefault("after", []).append(float(model(**shard, num_items_in_batch=num_items).loss))
        torch.save(seen, os.path.join(out_dir, f"misuse-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


TWO_GPUS = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=TWO_GPUS)])
def test_every_misuse_is_the_same_error_on_every_rank(tmp_path, backend):
    """Each wrong wiring of a hand-written loop raises a ValueError naming the fix, on both ranks
    alike (a mismatch is found by one small all-gather before any large collective); afterwards
    the group still computes, and a model with attention dropout evaluates."""
    import re

    spawn_ranks(_misuse_worker, (rendezvous(tmp_path), str(tmp_path), backend), WORLD)
    seen = [torch.load(tmp_path / f"misuse-rank{rank}.pt") for rank in range(WORLD)]
    for name, pattern in MISUSE_MESSAGES.items():
        for rank in range(WORLD):
            assert re.search(pattern, seen[rank][name]), (name, rank, seen[rank][name])
    eval_loss = one_process("llama-logits")[0]  # the dropout model's weights are the same
    for rank_losses in zip(*(ranks["after"] for ranks in seen)):
        assert_loss_close(torch.tensor(sum(rank_losses)), eval_loss)


def _checkpointing_worker(rank: int, store: str, out_dir: str) -> None:
    """Two forwards (two rows) before one backward, under gradient checkpointing."""
    init_group(rank, store)
    try:
        model = enable_context_parallel(build_model("llama-fused-checkpointing"))
        rows = [packed_batch(), packed_batch(seed=8)]
        total = sum(
            model(**shard_batch(row, rank, WORLD), num_items_in_batch=count_num_items(rows)).loss
            for row in rows
        )
        total.backward()
        save_share(model, total, os.path.join(out_dir, f"two-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_checkpointing_with_two_forwards_before_the_backward(tmp_path):
    """Gradient checkpointing recomputes each forward's layers with that forward's row: two rows
    through the model, then one backward, equal one process (1e-5)."""
    spawn_ranks(_checkpointing_worker, (rendezvous(tmp_path), str(tmp_path)), WORLD)
    ranks = [torch.load(tmp_path / f"two-rank{rank}.pt") for rank in range(WORLD)]
    model = build_model("llama-fused-checkpointing")
    rows = [packed_batch(), packed_batch(seed=8)]
    count = count_num_items(rows)
    expected = sum(model(**row, num_items_in_batch=count).loss for row in rows)
    expected.backward()
    assert_loss_close(sum(r["loss"] for r in ranks), expected.detach())
    assert_gradients_close({k: sum(r["grads"][k] for r in ranks) for k in ranks[0]["grads"]}, gradients(model), rtol=1e-5)


def test_gradient_reaches_the_collective_contiguous(one_rank_group):
    """The gather of the mixers' inputs (``gather.py``) gets its gradient back as a permuted view
    of ``(1, H, T, D)``; the one buffer handed to the collective is contiguous (NCCL's
    reduce-scatter splits raw memory: a buffer keeping a view's strides mixed the ranks'
    gradients), and the gradient passes through it unchanged."""
    from packed_ce.integrations.context_parallel.gather import gather_tokens

    leaf = torch.randn(6, 2, 4, requires_grad=True)  # (L, H, D), token-major
    upstream = torch.randn(1, 2, 6, 4)  # (1, H, T, D), as an attention layout reads it
    contiguous = []
    all_reduce = dist.all_reduce

    def spy(tensor, *args, **kwargs):
        contiguous.append(tensor.is_contiguous())
        return all_reduce(tensor, *args, **kwargs)

    with mock.patch.object(dist, "all_reduce", spy):
        gathered = gather_tokens(leaf, None, 0, 1).transpose(0, 1)[None]  # (1, H, T, D)
        (gathered * upstream).sum().backward()
    assert contiguous == [True]
    torch.testing.assert_close(leaf.grad, upstream[0].transpose(0, 1), rtol=0, atol=0)


def test_refusals_without_a_process_group():
    model = build_model("llama-logits")
    with pytest.raises(ValueError, match="init_process_group"):
        enable_context_parallel(model)
    with pytest.raises(ValueError, match="not enabled"):
        disable_context_parallel(model)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model_type": "llama", "packed_loss": False}, "apply_packed_loss"),
        ({"model_type": "qwen2", "layer_types": ["full_attention", "chunked_attention"]}, "chunked_attention"),
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True, "head_dim": 16}, "bidirectional"),
    ],
    ids=["no-packed-loss", "other-layer-types", "bidirectional"],
)
def test_refuses_what_it_cannot_keep_exact(one_rank_group, overrides, message):
    overrides = dict(overrides)
    arch = overrides.pop("model_type")
    packed = overrides.pop("packed_loss", True)
    model = tiny_causal_lm(VOCAB, model_type=arch, attn_implementation="eager", **overrides)
    if packed:
        apply_packed_loss(model)
    with pytest.raises(ValueError, match=message):
        enable_context_parallel(model)


def _own_attention_worker(rank: int, store: str, out_dir: str) -> None:
    """A Llama whose first layer computes its attention by its own function, past transformers'
    interface (as a family that never looks the implementation up does)."""
    from transformers.models.llama import modeling_llama

    init_group(rank, store)
    try:
        model = apply_packed_loss(tiny_model("llama", VOCAB))
        attention = model.model.layers[0].self_attn
        own = type(attention).forward

        def eager_only(self, *args, **kwargs):
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(modeling_llama.ALL_ATTENTION_FUNCTIONS, "get_interface",
                              lambda *a, **k: modeling_llama.eager_attention_forward)
                return own(self, *args, **kwargs)

        attention.forward = eager_only.__get__(attention)
        enable_context_parallel(model)
        batch = packed_batch()
        try:
            model(**shard_batch(batch, rank, WORLD), num_items_in_batch=count_num_items(batch))
            outcome = "ran"
        except ValueError as error:
            outcome = str(error)
        torch.save(outcome, os.path.join(out_dir, f"own-{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_attention_past_the_interface_is_refused_on_every_rank(tmp_path):
    """Judged by what the first call does, not by a class flag: an attention module that never
    reached the context-parallel attention is named, the same error on every rank."""
    spawn_ranks(_own_attention_worker, (rendezvous(tmp_path), str(tmp_path)), WORLD)
    outcomes = [torch.load(tmp_path / f"own-{rank}.pt") for rank in range(WORLD)]
    assert outcomes[0] == outcomes[1]
    assert "attention ['LlamaAttention'] does not go through transformers' attention interface" in outcomes[0]


# --- the trainers: accelerate's ParallelismConfig(cp_size=2) ------------------------------------

TRAIN_LENGTHS = [20, 12, 18, 14, 25, 7, 16, 17]  # 129 tokens: the trainers pad the row to 132
TRAIN_WEIGHTS = [1.0, 2.0, 0.5, 0.0, 3.0, 1.0, 1.5, 1.0]
TRAIN_SOURCES = ["chat", "code", "chat", "code", "chat", "code", "chat", "code"]
LR = 0.5


def train_conversations() -> list[dict]:
    conversations = synthetic_conversations(TRAIN_LENGTHS, VOCAB, seed=3)
    return [
        {**c, "weight": w, "source": s}
        for c, w, s in zip(conversations, TRAIN_WEIGHTS, TRAIN_SOURCES)
    ]


def allow_cpu_processes(parallelism_config_class) -> None:
    """Lifts one check of accelerate for this CPU test process. The check bypassed:
    ``ParallelismConfig._validate_accelerator`` raises "ParallelismConfig is only compatible
    DistributedType.FSDP (version 2) or DistributedType.Multi{Device} or DistributedType.DEEPSPEED"
    for processes of type MULTI_CPU, so the trainers' ``cp_size`` route cannot start on CPUs. Why:
    the device mesh and the data sharding it sets up work on gloo, and the rest of the check runs
    as on GPUs (``multi_device`` reads True), so the trainer's context-parallel path here is the one
    the ``cuda`` test runs unpatched on two GPUs. Users run this route on GPUs (README)."""
    from accelerate import Accelerator

    validate = parallelism_config_class._validate_accelerator

    def as_on_gpus(self, accelerator):
        with mock.patch.object(Accelerator, "multi_device", new_callable=mock.PropertyMock, return_value=True):
            return validate(self, accelerator)

    parallelism_config_class._validate_accelerator = as_on_gpus


def trainer_worker(
    rank: int, store: str, out_dir: str, trainer_name: str, backend: str = "gloo", world: int = WORLD
) -> None:
    """One optimiser step over every conversation, each row shared by two ranks; with ``world``
    4, two data-parallel groups of two ranks each train half of the conversations."""
    from accelerate import ParallelismConfig
    from datasets import Dataset

    on_gpus = backend == "nccl"
    if on_gpus:
        torch.cuda.set_device(rank)
    else:
        allow_cpu_processes(ParallelismConfig)
    start_rank(rank, world, store, backend)
    try:
        data = Dataset.from_list(train_conversations())
        model = tiny_model("llama", VOCAB)
        common = dict(
            max_steps=1, learning_rate=LR, lr_scheduler_type="constant", max_grad_norm=0.0,
            optim="sgd", per_device_train_batch_size=len(TRAIN_LENGTHS) * WORLD // world,
            per_device_eval_batch_size=len(TRAIN_LENGTHS) * WORLD // world, logging_steps=1,
            report_to=[], save_strategy="no", use_cpu=not on_gpus, ddp_backend=backend, bf16=False,
            dataloader_num_workers=0, disable_tqdm=True, ddp_find_unused_parameters=False,
            parallelism_config=ParallelismConfig(cp_size=WORLD, dp_shard_size=world // WORLD),
        )
        if on_gpus:
            # accelerate's context parallelism on GPUs needs FSDP2 (it shards the model over the
            # data- and context-parallel ranks)
            common.update(
                fsdp="full_shard auto_wrap",
                fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
            )
        if trainer_name == "PackedTrainer":
            from transformers import TrainingArguments

            from collators import PackedCollator
            from packed_ce.integrations import PackedTrainer

            apply_packed_loss(model)
            trainer = PackedTrainer(
                model=model, args=TrainingArguments(out_dir, **common), train_dataset=data,
                eval_dataset=data, data_collator=PackedCollator(),
            )
        else:
            from integration_utils import sft_args, tiny_tokenizer
            from packed_ce.integrations import PackedSFTTrainer

            trainer = PackedSFTTrainer(
                model=model, args=sft_args(out_dir, padding_free=True, max_length=None, **common),
                train_dataset=data, eval_dataset=data, processing_class=tiny_tokenizer(VOCAB),
            )
        trainer.train()
        evaluation = trainer.evaluate()
        # 3 per data-parallel rank: on four processes the second group's last batch is a copy
        trainer.args.per_device_eval_batch_size = 3
        evaluation_by_3 = trainer.evaluate()
        from packed_ce.integrations.context_parallel import context_parallel_of

        assert context_parallel_of(trainer.model).world_size == WORLD
        logs = trainer.state.log_history[0]
        params = {  # FSDP2 holds each rank's shard as a DTensor
            name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for name, p in trainer.model.named_parameters()
        }
        torch.save(
            {"params": params, "logs": logs, "evaluations": [evaluation, evaluation_by_3]},
            os.path.join(out_dir, f"{trainer_name}-rank{rank}.pt"),
        )
    finally:
        dist.destroy_process_group()


def reference_step() -> tuple[dict, dict]:
    """One SGD step of every conversation alone, weighted; the per-source means before it and
    the weighted per-conversation means after it (``"eval_loss"``, ``"eval_loss/<source>"``)."""
    from integration_utils import one_at_a_time, per_conversation_sgd_step

    model = tiny_model("llama", VOCAB)
    conversations = train_conversations()
    by_source = {}
    for source in sorted(set(TRAIN_SOURCES)):
        mine = [c for c in conversations if c["source"] == source]
        by_source[f"loss/{source}"] = float(one_at_a_time(model, mine, [c["weight"] for c in mine]))
    per_conversation_sgd_step(model, conversations, lr=LR, weights=TRAIN_WEIGHTS)
    with torch.no_grad():
        by_source["eval_loss"] = float(one_at_a_time(model, conversations, TRAIN_WEIGHTS))
        for source in sorted(set(TRAIN_SOURCES)):
            mine = [c for c in conversations if c["source"] == source]
            by_source[f"eval_loss/{source}"] = float(one_at_a_time(model, mine, [c["weight"] for c in mine]))
    return {name: p.detach() for name, p in model.named_parameters()}, by_source


@pytest.mark.parametrize(
    "backend, world",
    [
        pytest.param("gloo", WORLD, id="gloo"),
        pytest.param("gloo", 2 * WORLD, id="gloo-data-parallel"),
        pytest.param("nccl", WORLD, id="nccl", marks=TWO_GPUS),
    ],
)
@pytest.mark.parametrize("trainer_name", ["PackedTrainer", "PackedSFTTrainer"])
def test_trainer_step_with_context_parallelism(tmp_path, trainer_name, backend, world):
    """One SGD step of either trainer with ``ParallelismConfig(cp_size=2)`` equals one process
    stepping on every conversation alone (float32: the parameters move by at most 1e-4 norm-wise
    apart), and the logged ``loss/<source>`` are the per-source means (1e-5 relative); after it,
    ``eval_loss`` and ``eval_loss/<source>`` at two eval batch sizes are the weighted
    per-conversation means. On four processes the other dimension is data parallel
    (``dp_shard_size=2``): two groups of two ranks, each group sharing a row of half the
    conversations (at eval batch size 3, the second group's last row a copy)."""
    if trainer_name == "PackedSFTTrainer":
        pytest.importorskip("trl")
    spawn_ranks(trainer_worker, (rendezvous(tmp_path), str(tmp_path), trainer_name, backend, world), world)
    initial = {name: p.detach() for name, p in tiny_model("llama", VOCAB).named_parameters()}
    expected, by_source = reference_step()
    for rank in range(world):
        result = torch.load(tmp_path / f"{trainer_name}-rank{rank}.pt")
        assert_gradients_close(
            {k: result["params"][k] - initial[k] for k in initial},
            {k: expected[k] - initial[k] for k in initial},
        )
        for evaluation in result["evaluations"]:
            logged = {**result["logs"], **evaluation}
            for key, value in by_source.items():
                assert abs(logged[key] - value) <= 1e-5 * abs(value), (key, logged)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("scale", [1, 64], ids=["dense-mask", "flex-attention"])
def test_two_gpus_float32_and_bfloat16(tmp_path, scale):
    """On two GPUs (NCCL; rows of 96 tokens take the dense mask, rows of 6144 flex attention):
    float32 shares within the CPU tolerances of one GPU's float32 loss (for the families: every
    conversation alone); bfloat16 no farther from that float32 reference than one GPU's own bfloat16
    run, up to a factor of 2 plus 1e-3 (bfloat16 rounds each sum to 8 bits: the bound is what
    one process already loses, not a fixed number)."""
    setups = [*SETUPS, "mistral", "gpt_oss"]  # and a sliding-window family, one with sinks
    (tmp_path / "fp32").mkdir()
    (tmp_path / "bf16").mkdir()
    fp32 = run_ranks(tmp_path / "fp32", "nccl", setups, "float32", scale)
    bf16 = run_ranks(tmp_path / "bf16", "nccl", setups, "bfloat16", scale)
    for setup in setups:
        loss32, grads32 = one_process(setup, "cuda", scale=scale)
        loss16, grads16 = one_process(setup, "cuda", torch.bfloat16, scale)
        assert_loss_close(fp32[setup]["loss"], loss32)
        assert_gradients_close(fp32[setup]["grads"], grads32)
        from integration_utils import relative_error

        one_loss = relative_error(loss16, loss32)
        cp_loss = relative_error(bf16[setup]["loss"], loss32)
        one_grad = max(relative_error(grads16[k], grads32[k]) for k in grads32 if grads32[k].norm() > 0)
        cp_grad = max(relative_error(bf16[setup]["grads"][k], grads32[k]) for k in grads32 if grads32[k].norm() > 0)
        print(f"{setup}: bf16 loss error one GPU {one_loss:.2e}, two GPUs {cp_loss:.2e}; "
              f"worst gradient error one GPU {one_grad:.2e}, two GPUs {cp_grad:.2e}")
        assert cp_loss <= 2 * one_loss + 1e-3
        assert cp_grad <= 2 * one_grad + 1e-3


def fsdp2_worker(rank: int, store: str, out_dir: str) -> None:
    """The row shared by two ranks whose parameters FSDP2 shards as accelerate groups them (each
    decoder layer; the final norm with the head; the root), fused head; the loss times 2 cancels
    FSDP's gradient averaging."""
    from torch.distributed.fsdp import fully_shard

    start_rank(rank, WORLD, store)
    try:
        model = build_model("llama-fused-checkpointing")
        enable_context_parallel(model)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
        fully_shard(model)
        batch = packed_batch()
        loss = model(**shard_batch(batch, rank, WORLD), num_items_in_batch=count_num_items(batch)).loss
        (loss * WORLD).backward()
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            torch.save({"loss": total, "grads": grads}, os.path.join(out_dir, "fsdp2.pt"))
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_with_context_parallelism(tmp_path):
    """FSDP2 (torch's fully_shard on gloo) and context parallelism together: the loss and every
    gradient of one process, within the float32 tolerances."""
    spawn_ranks(fsdp2_worker, (rendezvous(tmp_path), str(tmp_path)), WORLD)
    result = torch.load(tmp_path / "fsdp2.pt")
    expected_loss, expected_grads = one_process("llama-fused-checkpointing")
    assert_loss_close(result["loss"], expected_loss)
    assert_gradients_close(result["grads"], expected_grads)
