"""A conversation's weight follows its tokens: ``seq_targets`` and ``seq_weights`` in the loss.

Checked against two independent float64 references that never call ``packed_ce``: the
per-sequence loop of ``conftest.py`` (random packings, every option) and, for data cut by the
collators, each whole conversation's mean token loss from ``collator_reference.py`` under a
context-free model (logits from a lookup table of the input token, so a conversation has the
same logits whole, split across rows or sharded across ranks). On CPU the kernel paths run
through the Triton interpreter; the ``cuda`` cases run them compiled.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import packed_ce
from packed_ce import LossOptions, count_normaliser
from packed_ce.targets import prepare_targets

from collators import PackedCollator, pack_dataset, shard_batch

from collator_reference import IGNORE, conversation_mean_loss, lookup_table, packed_weighted_sum
from loss_utils import KERNEL_DEVICES, OPTION_SETS, assert_close, random_packing

# (backend, device, dtype; tolerances by dtype in loss_utils.assert_close): the reference in float64, the
# kernels in float32 wherever they can run
BACKENDS = [
    pytest.param(("torch", "cpu", torch.float64), id="torch-fp64"),
    *(
        pytest.param(("triton", p.values[0], torch.float32), marks=p.marks, id=f"triton-{p.values[0]}")
        for p in KERNEL_DEVICES
    ),
]
# The one-launch target kernel beside the PyTorch preparation.
PREPARATIONS = [
    pytest.param((False, "cpu"), id="torch"),
    *(pytest.param((True, p.values[0]), marks=p.marks, id=f"kernel-{p.values[0]}") for p in KERNEL_DEVICES),
]


# --- a written-out example ------------------------------------------------------------------

# Three sequences under the shift: tokens 0-2 train (4, 5), 3-5 train (6), 6-9 train (7, 8, 9).
# The first is half of a conversation of 4 targets, the last half of one of 6 weighing 3, the
# middle one whole, weighing 1/2.
LABELS = [-100, 4, 5, -100, -100, 6, -100, 7, 8, 9]
CU_SEQLENS = [0, 3, 6, 10]
SEQ_TARGETS = [4, 1, 6]
SEQ_WEIGHTS = [1.0, 0.5, 3.0]
TARGETS = [4, 5, -100, -100, 6, -100, 7, 8, 9, -100]


@pytest.mark.parametrize("preparation", PREPARATIONS)
def test_written_out_targets_and_weights(preparation):
    use_kernel, device = preparation
    labels = torch.tensor(LABELS, device=device)
    boundaries = dict(
        cu_seqlens=torch.tensor(CU_SEQLENS, dtype=torch.int32, device=device),
        seq_weights=torch.tensor(SEQ_WEIGHTS, device=device),
    )
    seq_targets = torch.tensor(SEQ_TARGETS, dtype=torch.int32, device=device)

    def coef(**keywords):
        prepared = prepare_targets(labels, use_kernel=use_kernel, shift=True, **boundaries, **keywords)
        assert prepared.targets.tolist() == TARGETS
        return prepared.coef.tolist()

    # w_t = a_s / m_s: 1/4 twice, 1/2 once, 3/6 three times; D = 2/4 + 1/2 + 3 * 3/6 = 2.5
    packed_w = [0.25, 0.25, 0, 0, 0.5, 0, 0.5, 0.5, 0.5, 0]
    assert coef(is_packed=True, seq_targets=seq_targets, reduction="sum") == pytest.approx(packed_w)
    assert coef(is_packed=True, seq_targets=seq_targets) == pytest.approx([w / 2.5 for w in packed_w])
    # is_packed=False: w_t = a_s, a weighted token mean; D = 2 + 0.5 + 9 = 11.5
    token_w = [1, 1, 0, 0, 0.5, 0, 3, 3, 3, 0]
    assert coef(reduction="sum") == token_w
    assert coef() == pytest.approx([w / 11.5 for w in token_w])


def test_count_normaliser_is_the_weight_mass():
    labels = torch.tensor(LABELS)
    cu_seqlens = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    packed = LossOptions(is_packed=True, shift=True)
    plain = count_normaliser(labels, cu_seqlens=cu_seqlens, options=packed)
    assert plain.dtype == torch.int64 and plain.item() == 3  # exact integer count, unchanged
    weighted = dict(seq_targets=torch.tensor(SEQ_TARGETS), seq_weights=torch.tensor(SEQ_WEIGHTS))
    mass = count_normaliser(labels, cu_seqlens=cu_seqlens, options=packed, **weighted)
    assert mass.dtype == torch.float64 and mass.item() == 2.5
    # seq_targets equal to the own counts (2, 1, 3): the number of sequences, as a float
    own = count_normaliser(labels, cu_seqlens=cu_seqlens, options=packed, seq_targets=torch.tensor([2, 1, 3]))
    assert own.dtype == torch.float64 and own.item() == 3.0
    tokens = count_normaliser(
        labels, cu_seqlens=cu_seqlens, options=LossOptions(shift=True), seq_weights=weighted["seq_weights"]
    )
    assert tokens.item() == 11.5


# --- every option against the per-sequence loop ---------------------------------------------


def _random_weighted(gen, vocab, device, n_tokens=60):
    """A random packing with ``seq_targets`` above each sequence's own count (it is a piece of a
    longer conversation) or equal to it, and weights among which zeros."""
    packing = random_packing(gen, vocab, n_tokens=n_tokens, device=device)
    sequences = len(packing.lengths)
    extra = torch.randint(0, 4, (sequences,), generator=gen) * (torch.rand(sequences, generator=gen) < 0.5)
    weights = torch.tensor([0.0, 0.5, 1.0, 2.5])[torch.randint(0, 4, (sequences,), generator=gen)]
    return packing, extra, weights


def _own_counts(labels, slices, shift):
    """Targets of each slice, by a loop (the ``seq_targets`` of unsplit sequences)."""
    flat = labels.reshape(-1).tolist()
    return [sum(y != IGNORE for y in flat[start + int(shift) : end]) for start, end in slices]


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("is_packed", [True, False])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("options", [OPTION_SETS["plain"], OPTION_SETS["all"]], ids=["plain", "all"])
def test_matches_the_per_sequence_loop(backend_case, is_packed, shift, reduction, options, per_sequence_loss):
    backend, device, dtype = backend_case
    gen = torch.Generator().manual_seed(11)
    vocab = 29
    packing, extra, weights = _random_weighted(gen, vocab, device)
    own = _own_counts(packing.labels, packing.slices, shift)
    whole = [max(n, 1) + int(e) for n, e in zip(own, extra)]
    per_sequence = dict(seq_weights=weights.to(device))
    if is_packed:
        per_sequence["seq_targets"] = torch.tensor(whole, dtype=torch.int32, device=device)
    logits = (torch.randn(packing.labels.numel(), vocab, generator=gen, dtype=torch.float64) * 3).to(device)
    x = logits.to(dtype).requires_grad_()
    loss = packed_ce.cross_entropy(
        x, packing.labels, cu_seqlens=packing.cu_seqlens, is_packed=is_packed, shift=shift,
        reduction=reduction, backend=backend, **per_sequence, **options,
    )
    loss = loss.sum() if reduction == "none" else loss
    (grad,) = torch.autograd.grad(loss, x)
    x64 = logits.cpu().requires_grad_()
    expected = per_sequence_loss(
        x64, packing.labels.cpu(), packing.slices, is_packed=is_packed, shift=shift,
        reduction="sum" if reduction == "none" else reduction,
        seq_targets=whole if is_packed else None, seq_weights=weights.tolist(), **options,
    )
    (expected_grad,) = torch.autograd.grad(expected, x64)
    assert_close(loss, expected, dtype)
    assert_close(grad, expected_grad, dtype)


# --- split conversations: the loss over all batches is the mean over whole conversations -----


def _conversations(seed, num, max_tokens, vocab, weights):
    """Random tokenized conversations, most longer than a row; some without any target."""
    rng = np.random.default_rng(seed)
    rows = {"input_ids": [], "labels": []}
    for _ in range(num):
        ids = rng.integers(0, vocab, int(rng.integers(2, max_tokens + 1))).tolist()
        trained = rng.random(len(ids)) < rng.choice([0.0, 0.4, 0.9])
        rows["input_ids"].append(ids)
        rows["labels"].append([t if keep else IGNORE for t, keep in zip(ids, trained)])
    if weights:
        rows["weight"] = rng.choice([0.0, 0.5, 1.0, 3.0], num).tolist()
    return rows


def _expected_mean(table, rows):
    """The (weighted) mean over conversations of each whole conversation's mean token loss."""
    means, weights = [], []
    for c, (ids, labels) in enumerate(zip(rows["input_ids"], rows["labels"])):
        mean = conversation_mean_loss(table, ids, labels)
        if mean is not None:
            means.append(mean)
            weights.append(rows["weight"][c] if "weight" in rows else 1.0)
    weights = torch.tensor(weights, dtype=torch.float64)
    return (torch.stack(means) * weights).sum() / weights.sum(), weights.sum()


def _split_batches(rows, max_length=16, rows_per_batch=4):
    datasets = pytest.importorskip("datasets")  # not on every GPU image
    packed = pack_dataset(datasets.Dataset.from_dict(rows), max_length, overflow="split")
    collator = PackedCollator(pad_to_multiple_of=8)
    starts = range(0, packed.num_rows, rows_per_batch)
    return [collator(packed.select(range(s, min(s + rows_per_batch, packed.num_rows)))) for s in starts]


def _per_sequence(batch, device, with_targets=True):
    """The batch's ``seq_targets`` / ``seq_weights`` (those it has) as loss keywords."""
    names = ("seq_targets", "seq_weights") if with_targets else ("seq_weights",)
    return {name: batch[name].to(device) for name in names if name in batch}


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_split_packing_end_to_end(backend_case, fused, weighted):
    """pack_dataset(overflow="split") + PackedCollator + the loss with the batch's seq_targets,
    summed over all batches with the step's weight mass as num_items_in_batch: the (weighted)
    mean over conversations of each unsplit conversation's mean token loss, and its gradients."""
    backend, device, dtype = backend_case
    vocab, hidden_size = 24, 8
    rows = _conversations(5, 14, 50, vocab, weighted)
    batches = _split_batches(rows)
    assert max(len(ids) for ids in rows["input_ids"]) > 2 * 16  # conversations cut in 3 and more
    options = LossOptions(is_packed=True, shift=True, backend=backend)
    gen = torch.Generator().manual_seed(2)
    if fused:  # logits = E[token] @ W.T: still a function of the input token alone
        leaves = [torch.randn(vocab, hidden_size, generator=gen, dtype=torch.float64).requires_grad_() for _ in "EW"]
    else:
        leaves = [lookup_table(vocab)]

    def loss_of(batch, num_items, with_targets=True):
        labels, ids = batch["labels"].to(device), batch["input_ids"][0].to(device)
        keywords = dict(
            cu_seqlens=batch["cu_seqlens"].to(device), num_items_in_batch=num_items, options=options,
            **_per_sequence(batch, device, with_targets),
        )
        if fused:
            embedding, head = (leaf.to(device=device, dtype=dtype) for leaf in leaves)
            return packed_ce.fused_linear_cross_entropy(embedding[ids][None], head, labels, chunk_size=16, **keywords)
        return packed_ce.cross_entropy(leaves[0].to(device=device, dtype=dtype)[ids][None], labels, **keywords)

    # The step's normaliser, counted once over its batches, as a trainer does
    mass = sum(
        count_normaliser(b["labels"], cu_seqlens=b["cu_seqlens"], options=options, **_per_sequence(b, "cpu"))
        for b in batches
    )
    loss = sum(loss_of(batch, mass.to(device)) for batch in batches)
    grads = torch.autograd.grad(loss, leaves)

    table = leaves[0] @ leaves[1].T if fused else leaves[0]
    expected, expected_mass = _expected_mean(table, rows)
    expected_grads = torch.autograd.grad(expected, leaves)
    torch.testing.assert_close(mass, expected_mass, rtol=1e-14, atol=0)
    assert_close(loss, expected, dtype)
    for grad, expected_grad in zip(grads, expected_grads):
        assert_close(grad, expected_grad, dtype)
    if backend == "torch" and not fused:
        # The check has teeth: without seq_targets each piece weighs as a conversation of its own.
        naive_mass = sum(
            count_normaliser(b["labels"], cu_seqlens=b["cu_seqlens"], options=options,
                             **_per_sequence(b, "cpu", with_targets=False))
            for b in batches
        )
        naive = sum(loss_of(batch, naive_mass, with_targets=False) for batch in batches)
        assert abs(float(naive.detach()) - float(expected.detach())) > 1e-3


# --- context parallelism: each rank's "sum" loss, added up, is the whole batch's --------------

# With 2 ranks (4 chunks of 4 tokens of 16) the cuts fall at 4 (between the first conversation's
# user turn and its answer), at 8 (inside the second one's answer) and at 12 (a sequence start);
# the last example is one piece of a conversation of 9 targets.
SHARD_EXAMPLES = [
    {"input_ids": [1, 2, 3, 4, 5, 6], "labels": [IGNORE] * 4 + [5, 6], "weight": 1.0},
    {"input_ids": [7, 8, 9, 10, 11, 12], "labels": [IGNORE, IGNORE, 9, 10, 11, 12], "weight": 2.5},
    {"input_ids": [13, 14, 15, 16], "labels": [IGNORE, 14, 15, 16], "weight": 0.5},
    {"input_ids": [20, 21, 22, 23, 24], "labels": [IGNORE, 21, IGNORE, 23, 24], "seq_lengths": [5],
     "seq_targets": [9], "seq_weights": [3.0]},
]


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_shard_batch_ranks_add_up(backend_case, world_size, weighted):
    backend, device, dtype = backend_case
    examples = SHARD_EXAMPLES
    if not weighted:
        examples = [{k: v for k, v in e.items() if k not in ("weight", "seq_weights")} for e in examples]
    batch = PackedCollator(pad_to_multiple_of=2 * world_size)(examples)
    table = lookup_table(40).detach()
    options = LossOptions(is_packed=True, reduction="sum", backend=backend)

    ids = batch["input_ids"][0]
    whole_logits = table[ids].to(device=device, dtype=dtype)[None].requires_grad_()
    whole = packed_ce.cross_entropy(
        whole_logits, batch["labels"].to(device), cu_seqlens=batch["cu_seqlens"].to(device), shift=True,
        options=options, **_per_sequence(batch, device),
    )
    whole.backward()
    # the whole batch itself against the independent per-sequence loop
    assert_close(whole, packed_weighted_sum(table, batch)[0], dtype)

    total = 0.0
    for rank in range(world_size):
        shard = shard_batch(batch, rank, world_size)
        chunks = shard["context_parallel_shard"].chunks  # dealt out by attention work
        size = ids.numel() // (len(chunks) * len(chunks[0]))
        local = torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks[rank]])
        assert torch.equal(shard["input_ids"][0], ids[local])
        logits = table[shard["input_ids"][0]].to(device=device, dtype=dtype)[None].requires_grad_()
        part = packed_ce.cross_entropy(
            logits, shard["shift_labels"].to(device), cu_seqlens=shard["cu_seqlens"].to(device), shift=False,
            options=options, **_per_sequence(shard, device),
        )
        part.backward()
        # each rank's logit gradients: the matching slice of the whole batch's
        assert_close(logits.grad[0], whole_logits.grad[0, local.to(device)], dtype)
        total = total + part.detach()
    assert_close(total, whole, dtype)


# --- weights: what they change and what they do not ------------------------------------------


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("is_packed", [True, False])
def test_uniform_weights_change_nothing(backend_case, is_packed):
    backend, device, dtype = backend_case
    gen = torch.Generator().manual_seed(4)
    packing = random_packing(gen, 17, n_tokens=50, device=device)
    logits = torch.randn(50, 17, generator=gen).to(device=device, dtype=dtype)
    options = LossOptions(is_packed=is_packed, shift=True, backend=backend)
    common = dict(cu_seqlens=packing.cu_seqlens, options=options)
    plain = packed_ce.cross_entropy(logits, packing.labels, **common)
    sequences = len(packing.lengths)
    uniform = torch.full((sequences,), 2.5, device=device)
    assert_close(packed_ce.cross_entropy(logits, packing.labels, seq_weights=uniform, **common), plain, dtype)
    # the sum scales with the weight
    summed = packed_ce.cross_entropy(logits, packing.labels, seq_weights=uniform, reduction="sum", **common)
    assert_close(summed, 2.5 * packed_ce.cross_entropy(logits, packing.labels, reduction="sum", **common), dtype)
    if is_packed:  # seq_targets equal to each sequence's own count (1 without a target): the plain loss
        own = [max(n, 1) for n in _own_counts(packing.labels, packing.slices, shift=True)]
        own = torch.tensor(own, device=device)
        assert_close(packed_ce.cross_entropy(logits, packing.labels, seq_targets=own, **common), plain, dtype)


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("is_packed", [True, False])
def test_zero_weight_removes_a_conversation_exactly(backend_case, is_packed, per_sequence_loss):
    backend, device, dtype = backend_case
    gen = torch.Generator().manual_seed(8)
    packing = random_packing(gen, 17, n_tokens=50, device=device)
    sequences = len(packing.lengths)
    removed = torch.rand(sequences, generator=gen) < 0.4
    logits = torch.randn(50, 17, generator=gen, dtype=torch.float64)
    x = logits.to(device=device, dtype=dtype).requires_grad_()
    loss = packed_ce.cross_entropy(
        x, packing.labels, cu_seqlens=packing.cu_seqlens, seq_weights=(~removed).float().to(device),
        is_packed=is_packed, shift=True, backend=backend,
    )
    (grad,) = torch.autograd.grad(loss, x)
    # the unweighted loop over the remaining sequences only
    kept = [s for s, gone in zip(packing.slices, removed.tolist()) if not gone]
    x64 = logits.requires_grad_()
    expected = per_sequence_loss(x64, packing.labels.cpu(), kept, is_packed=is_packed, shift=True)
    (expected_grad,) = torch.autograd.grad(expected, x64)
    assert_close(loss, expected, dtype)
    assert_close(grad, expected_grad, dtype)
    for (start, end), gone in zip(packing.slices, removed.tolist()):
        if gone:  # exactly: not a rounding-small gradient
            assert not grad[start:end].any()


@pytest.mark.parametrize("backend_case", BACKENDS)
def test_mean_divides_by_the_weight_mass_unless_num_items_is_given(backend_case):
    backend, device, dtype = backend_case
    gen = torch.Generator().manual_seed(6)
    packing, extra, weights = _random_weighted(gen, 13, device)
    own = _own_counts(packing.labels, packing.slices, shift=True)
    whole = [max(n, 1) + int(e) for n, e in zip(own, extra)]
    per_sequence = dict(
        seq_targets=torch.tensor(whole, device=device), seq_weights=weights.to(device)
    )
    options = LossOptions(is_packed=True, shift=True, backend=backend)
    logits = torch.randn(packing.labels.numel(), 13, generator=gen).to(device=device, dtype=dtype)

    def loss(**keywords):
        return packed_ce.cross_entropy(
            logits, packing.labels, cu_seqlens=packing.cu_seqlens, options=options, **per_sequence, **keywords
        )

    mass = count_normaliser(packing.labels, cu_seqlens=packing.cu_seqlens, options=options, **per_sequence)
    expected_mass = sum(a * n / m for a, n, m in zip(weights.tolist(), own, whole))
    assert abs(mass.item() - expected_mass) < 1e-14 * expected_mass
    total = loss(reduction="sum")
    assert_close(loss() * mass, total, dtype)
    for num_items in (7, torch.tensor(0.75, device=device)):
        assert_close(loss(num_items_in_batch=num_items), total / num_items, dtype)


# --- weights of any scale: the mean does not depend on it -----------------------------------

# The kernels' arithmetic is float32; each scale breaks a mass formed there.
FLOAT32_BACKENDS = [
    pytest.param("torch", id="torch-fp32"),
    *(pytest.param("triton", marks=p.marks, id=f"triton-{p.values[0]}") for p in KERNEL_DEVICES[:1]),
]
SCALES = [
    pytest.param(1e-35, id="mass-1e-35"),  # below the normaliser's clamp of 1e-30
    pytest.param(1e-40, id="subnormal"),  # float32 subnormals: a_s / m_s loses its digits
    pytest.param(3e38, id="mass-overflows"),  # two such weights add up to inf in float32
]


def _scaled_micro_batches(scale, vocab=13):
    """Two micro-batches of random packings (split sequences among them), every weight ``scale``
    times 1 or 1/3 (two of them at least ``scale``), with float64 logits."""
    gen = torch.Generator().manual_seed(21)
    batches = []
    for _ in range(2):
        packing, extra, _ = _random_weighted(gen, vocab, "cpu", n_tokens=40)
        own = _own_counts(packing.labels, packing.slices, shift=True)
        whole = [max(n, 1) + int(e) for n, e in zip(own, extra)]
        weights = [scale * (1.0 if k else 1 / 3) for k in (torch.rand(len(own), generator=gen) < 0.5).tolist()]
        weights[:2] = [scale, scale]
        logits = torch.randn(packing.labels.numel(), vocab, generator=gen, dtype=torch.float64) * 3
        batches.append((packing, whole, weights, logits))
    return batches


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("is_packed", [True, False])
def test_weights_of_any_scale_give_the_exact_mean(backend, scale, is_packed, per_sequence_loss):
    """Weights whose float32 mass underflows, is subnormal or overflows: the same loss and
    gradient as the float64 loop, alone and as two micro-batches over a step's float64 mass."""
    batches = _scaled_micro_batches(scale)
    options = LossOptions(is_packed=is_packed, shift=True, backend=backend)
    calls, expected_parts = [], []
    for packing, whole, weights, logits in batches:
        per_sequence = dict(seq_weights=torch.tensor(weights, dtype=torch.float32))
        if is_packed:
            per_sequence["seq_targets"] = torch.tensor(whole)
        calls.append((packing, per_sequence, logits.float().requires_grad_()))
        # the float32 weights the loss sees, in float64
        seq_weights = per_sequence["seq_weights"].double().tolist()
        expected_parts.append(dict(seq_weights=seq_weights, seq_targets=whole if is_packed else None))

    # one micro-batch: the mean over its own mass
    packing, per_sequence, x = calls[0]
    loss = packed_ce.cross_entropy(x, packing.labels, cu_seqlens=packing.cu_seqlens, options=options, **per_sequence)
    (grad,) = torch.autograd.grad(loss, x)
    x64 = batches[0][3].clone().requires_grad_()
    expected = per_sequence_loss(x64, packing.labels, packing.slices, is_packed=is_packed, shift=True, **expected_parts[0])
    (expected_grad,) = torch.autograd.grad(expected, x64)
    assert loss.isfinite() and grad.isfinite().all()
    assert_close(loss, expected, torch.float32)
    assert_close(grad, expected_grad, torch.float32)

    # two micro-batches of one step: each divides by the step's float64 mass, used as given
    mass = sum(
        count_normaliser(packing.labels, cu_seqlens=packing.cu_seqlens, options=options, **per_sequence)
        for packing, per_sequence, _ in calls
    )
    assert mass.dtype == torch.float64 and 0 < mass < float("inf")
    total = sum(
        packed_ce.cross_entropy(x, packing.labels, cu_seqlens=packing.cu_seqlens, options=options,
                                num_items_in_batch=mass, **per_sequence)
        for packing, per_sequence, x in calls
    )
    grads = torch.autograd.grad(total, [x for _, _, x in calls])
    # the float64 loop over both micro-batches as one batch
    offset = batches[0][0].labels.numel()
    slices = batches[0][0].slices + [(a + offset, b + offset) for a, b in batches[1][0].slices]
    x64 = torch.cat([batch[3] for batch in batches]).requires_grad_()
    expected = per_sequence_loss(
        x64, torch.cat([batch[0].labels for batch in batches]), slices, is_packed=is_packed, shift=True,
        seq_weights=sum((part["seq_weights"] for part in expected_parts), []),
        seq_targets=(expected_parts[0]["seq_targets"] + expected_parts[1]["seq_targets"]) if is_packed else None,
    )
    (expected_grad,) = torch.autograd.grad(expected, x64)
    assert_close(total, expected, torch.float32)
    assert_close(torch.cat(grads), expected_grad, torch.float32)


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS)
@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused"])
def test_weights_whose_float64_sum_overflows_are_refused(backend, fused):
    """Two weights of 1e308, each finite, have an infinite float64 mass: the mean was NaN, its
    gradients too. Refused naming seq_weights; two weights of 8e307 (a finite mass of 1.6e308)
    give the unweighted mean, loss and gradients, as the equal weights of 1 do."""
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(len(LABELS), 8, generator=gen)
    head = torch.randn(11, 8, generator=gen)
    keywords = dict(cu_seqlens=torch.tensor(CU_SEQLENS[:1] + CU_SEQLENS[2:]), is_packed=True, shift=True,
                    backend=backend)

    def loss_and_grad(weights):
        x = hidden.clone().requires_grad_()
        seq_weights = torch.tensor(weights, dtype=torch.float64)
        if fused:
            loss = packed_ce.fused_linear_cross_entropy(x, head, torch.tensor(LABELS), seq_weights=seq_weights,
                                                        **keywords)
        else:
            loss = packed_ce.cross_entropy(x @ head.T, torch.tensor(LABELS), seq_weights=seq_weights, **keywords)
        return loss, torch.autograd.grad(loss, x)[0]

    with pytest.raises(ValueError, match=r"seq_weights add up to more than float64 holds.*scale them down"):
        loss_and_grad([1e308, 1e308])
    expected, expected_grad = loss_and_grad([1.0, 1.0])
    loss, grad = loss_and_grad([8e307, 8e307])
    assert_close(loss, expected, torch.float32)
    assert_close(grad, expected_grad, torch.float32)


@pytest.mark.parametrize("preparation", PREPARATIONS[:2])
def test_a_heavy_sequence_without_a_target_weighs_nothing(preparation):
    """A sequence without a target weighing 3e38 beside weights of 1e-10: divided by the mass it
    overflows float32, but its tokens have no target, so it changes nothing (no 0 * inf = NaN)."""
    use_kernel, device = preparation
    labels = torch.tensor(LABELS, device=device)
    labels[5] = -100  # the middle sequence (tokens 3-5) loses its one target
    keywords = dict(cu_seqlens=torch.tensor(CU_SEQLENS, device=device), is_packed=True, shift=True,
                    seq_targets=torch.tensor(SEQ_TARGETS, device=device))
    heavy = prepare_targets(labels, use_kernel=use_kernel, seq_weights=torch.tensor([1e-10, 3e38, 3e-10], device=device), **keywords)
    plain = prepare_targets(labels, use_kernel=use_kernel, seq_weights=torch.tensor([1.0, 0.0, 3.0], device=device), **keywords)
    assert heavy.coef.isfinite().all()
    torch.testing.assert_close(heavy.coef, plain.coef, rtol=1e-6, atol=0)


@pytest.mark.parametrize("preparation", PREPARATIONS[:2])
def test_weights_over_a_zero_or_bad_mass(preparation):
    """Divided by the mass in float64 before the kernels see them, the weights keep the
    normaliser's rules: a zero mass gives zero coefficients, a negative or non-finite
    ``num_items_in_batch`` NaN ones, on the kernel and the PyTorch paths alike."""
    use_kernel, device = preparation
    keywords = dict(
        cu_seqlens=torch.tensor(CU_SEQLENS, device=device), is_packed=True, shift=True,
        seq_targets=torch.tensor(SEQ_TARGETS, device=device), validate=False,
    )
    labels = torch.tensor(LABELS, device=device)
    zero = prepare_targets(labels, use_kernel=use_kernel, seq_weights=torch.zeros(3, device=device), **keywords)
    assert torch.equal(zero.coef, torch.zeros(len(LABELS), device=device))
    weights = torch.tensor(SEQ_WEIGHTS, device=device)
    for bad in (-1.0, float("inf"), float("nan")):
        num_items = torch.tensor(bad, dtype=torch.float64, device=device)
        coef = prepare_targets(
            labels, use_kernel=use_kernel, seq_weights=weights, num_items_in_batch=num_items, **keywords
        ).coef
        assert coef.isnan().all(), bad
    given_zero = prepare_targets(labels, use_kernel=use_kernel, seq_weights=weights, num_items_in_batch=0, **keywords)
    assert torch.equal(given_zero.coef, torch.zeros(len(LABELS), device=device))


@pytest.mark.parametrize("preparation", PREPARATIONS[1:])
def test_unvalidated_bad_values_are_memory_safe(preparation):
    """With validation off (as under torch.compile), seq_targets below 1 or below a sequence's
    own count and negative or non-finite weights run on every path without an error or an
    out-of-range access; their value is unspecified."""
    _, device = preparation
    labels = torch.tensor(LABELS, device=device)
    keywords = dict(
        cu_seqlens=torch.tensor(CU_SEQLENS, device=device), is_packed=True, shift=True,
        seq_targets=torch.tensor([0, -3, 1], device=device),
        seq_weights=torch.tensor([float("inf"), -2.0, float("nan")], device=device),
    )
    for use_kernel in (True, False):
        prepared = prepare_targets(labels, use_kernel=use_kernel, **keywords)
        assert prepared.coef.shape == labels.shape
    logits = torch.randn(len(LABELS), 11, device=device)
    for backend in ("triton", "torch"):
        loss = packed_ce.cross_entropy(logits, labels, backend=backend, validate=False, **keywords)
        assert loss.shape == ()


@pytest.mark.parametrize("backend_case", BACKENDS)
def test_cu_seqlens_without_a_sequence_is_refused(backend_case):
    """cu_seqlens = [0] over N > 0 tokens (S = 0, empty seq_targets and seq_weights) holds the
    tokens in no sequence: refused from its shape, validated or not."""
    backend, device, dtype = backend_case
    logits = torch.randn(4, 7, dtype=dtype, device=device, requires_grad=True)
    empty = dict(seq_targets=torch.zeros(0, dtype=torch.int32, device=device),
                 seq_weights=torch.zeros(0, device=device))
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_ce.cross_entropy(
            logits, torch.tensor([1, 2, 3, 4], device=device),
            cu_seqlens=torch.zeros(1, dtype=torch.int32, device=device),
            is_packed=True, backend=backend, validate=False, **empty,
        )


def test_modules_take_them_in_forward():
    gen = torch.Generator().manual_seed(1)
    labels = torch.tensor(LABELS)
    keywords = dict(
        cu_seqlens=torch.tensor(CU_SEQLENS), seq_targets=torch.tensor(SEQ_TARGETS),
        seq_weights=torch.tensor(SEQ_WEIGHTS),
    )
    hidden, weight = torch.randn(10, 6, generator=gen), torch.randn(11, 6, generator=gen)
    options = dict(is_packed=True, shift=True)
    expected = packed_ce.cross_entropy(hidden @ weight.T, labels, **keywords, **options)
    assert packed_ce.PackedCrossEntropyLoss(**options)(hidden @ weight.T, labels, **keywords) == expected
    fused = packed_ce.FusedLinearPackedCrossEntropyLoss(**options)(hidden, weight, labels, **keywords)
    torch.testing.assert_close(fused, expected)
    plain = packed_ce.cross_entropy(hidden @ weight.T, labels, cu_seqlens=keywords["cu_seqlens"], **options)
    assert abs(float(plain) - float(expected)) > 1e-3  # the weights reached the loss


# --- bad inputs: each names the argument ----------------------------------------------------

# (name, keywords over a good call, error type, message pattern); the good call packs LABELS
# under the shift with CU_SEQLENS
BAD_INPUTS = [
    ("targets-not-tensor", dict(seq_targets=[4, 1, 6]), TypeError, r"seq_targets must be a torch.Tensor"),
    ("targets-float", dict(seq_targets=torch.tensor([4.0, 1.0, 6.0])), TypeError, r"seq_targets must be an integer"),
    ("targets-bool", dict(seq_targets=torch.tensor([True, True, True])), TypeError, r"seq_targets must be an integer"),
    ("targets-short", dict(seq_targets=torch.tensor([4, 1])), ValueError,
     r"seq_targets must have shape \(S,\) = \(3,\)"),
    ("targets-2d", dict(seq_targets=torch.tensor([[4, 1, 6]])), ValueError, r"seq_targets must have shape \(S,\)"),
    ("targets-unpacked", dict(seq_targets=torch.tensor(SEQ_TARGETS), is_packed=False), ValueError,
     r"seq_targets weighs each target by its conversation \(is_packed=True\)"),
    ("targets-position-ids", dict(seq_targets=torch.tensor(SEQ_TARGETS), cu_seqlens=None,
                                  position_ids=torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 3])),
     ValueError, r"seq_targets needs cu_seqlens"),
    ("targets-zero", dict(seq_targets=torch.tensor([4, 0, 6])), ValueError,
     r"seq_targets must be >= 1 .*got \[0\] at sequences \[1\]"),
    ("targets-below-own", dict(seq_targets=torch.tensor([4, 1, 2])), ValueError,
     r"seq_targets must count the targets of each whole conversation.*sequences \[2\] have \[3\] targets"),
    ("targets-device", dict(seq_targets=torch.tensor([4, 1, 6], device="meta")), ValueError,
     r"seq_targets is on meta but logits on"),
    ("weights-int", dict(seq_weights=torch.tensor([1, 1, 1])), TypeError, r"seq_weights must be a float tensor"),
    ("weights-long", dict(seq_weights=torch.ones(4)), ValueError, r"seq_weights must have shape \(S,\) = \(3,\)"),
    ("weights-nan", dict(seq_weights=torch.tensor([1.0, float("nan"), 1.0])), ValueError,
     r"seq_weights must be finite and >= 0: got \[nan\] at sequences \[1\]"),
    ("weights-inf", dict(seq_weights=torch.tensor([1.0, 1.0, float("inf")])), ValueError,
     r"seq_weights must be finite and >= 0"),
    ("weights-negative", dict(seq_weights=torch.tensor([1.0, -0.5, 1.0])), ValueError,
     r"seq_weights must be finite and >= 0: got \[-0.5\]"),
    ("weights-sum-overflows", dict(seq_weights=torch.tensor([1e308, 1.0, 1e308], dtype=torch.float64)), ValueError,
     r"seq_weights add up to more than float64 holds"),
    ("weights-grad", dict(seq_weights=torch.ones(3, requires_grad=True)), ValueError,
     r"seq_weights must not require a gradient"),
    ("weights-no-boundaries", dict(seq_weights=torch.ones(3), cu_seqlens=None, is_packed=False), ValueError,
     r"seq_weights needs cu_seqlens"),
]


@pytest.mark.parametrize("backend_case", BACKENDS)
@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(backend_case, case):
    backend, device, dtype = backend_case
    _, changes, error, pattern = case
    keywords = dict(cu_seqlens=torch.tensor(CU_SEQLENS), is_packed=True, shift=True, backend=backend)
    keywords.update(changes)
    # (meta tensors stay where they are: the device check must see them)
    keywords = {k: v.to(device) if torch.is_tensor(v) and not v.is_meta else v for k, v in keywords.items()}
    logits = torch.zeros(len(LABELS), 11, dtype=dtype, device=device)
    with pytest.raises(error, match=pattern):
        packed_ce.cross_entropy(logits, torch.tensor(LABELS, device=device), **keywords)
        packed_ce.check_pending()


def test_count_normaliser_checks_its_arguments():
    labels = torch.tensor(LABELS)
    with pytest.raises(ValueError, match=r"seq_targets must have shape \(S,\) = \(3,\)"):
        count_normaliser(labels, cu_seqlens=torch.tensor(CU_SEQLENS), seq_targets=torch.tensor([1]),
                         options=LossOptions(is_packed=True))
    with pytest.raises(ValueError, match=r"seq_weights needs cu_seqlens"):
        count_normaliser(labels, seq_weights=torch.ones(3))
