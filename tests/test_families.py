"""Every transformers causal-LM family: a packed batch is exact, or refused naming the family.

For every ``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, a tiny float32 model
(``family_models.py``; hybrids keep a layer of each kind) with each attention implementation it
supports among eager and sdpa runs one packed row of four conversations (untrained turns, one
conversation without a target) and a padding segment of the family's own padding token (its
embedding's ``padding_idx``, as ``PackedCollator(pad_to_multiple_of=...)`` and context parallelism
add it with their default token 0, whose embedding is 0 where the family zeroes it: a family with no
finite gradient there must be refused). The truth is every conversation alone (``one_at_a_time``); the family's own
behaviour is the same packed call without the packed loss (its logits, the packed mean over
``cu_seqlens``), exact when its loss and its gradients are the truth's (gradients too: a
convolution initialised to the identity reads nothing of the conversation before until its first
step, but its gradient does). Then with ``apply_packed_loss(model, is_packed=True)`` every family
is exact (loss and every gradient, all finite) or refused with a ``ValueError`` naming its
``model_type``:

- a family whose own packed call is exact must not be refused (except by "cannot be checked");
- a family whose own packed call is not exact (or that transformers refuses packed, its kernels
  missing) is made exact by packed-ce (its token mixers per conversation, ``families.MIXERS``;
  batch-dependent rotary embeddings per conversation) or refused: by the mask audit, the probe of
  its first packed call or ``LEAKY_FAMILIES``. A table entry that goes stale, or a leak that
  nothing catches, fails here.

Flex attention compiles for minutes on CPU and has no backward there:
:func:`test_flex_attention_masks_are_audited` reads, for a representative set of families, the
masks their attention calls receive (built uncompiled, the attention a stub), and requires a
refusal exactly where one leaks. ``test_sweep_summary`` prints the counts.
"""

from __future__ import annotations

import collections
import functools

import pytest
import torch
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import packed_ce
from collators import PackedCollator
from packed_ce.integrations import apply_packed_loss
from packed_ce.integrations.model.families import LEAKY_FAMILIES, LEAKY_IMPLEMENTATIONS, MIXERS
from packed_ce.integrations.model.mixers import mixers_of

from family_models import VOCAB, NotBuilt, supports, tiny_family_model
from integration_utils import (
    IGNORE,
    flat_relative_error,
    loss_and_gradients,
    one_at_a_time,
    relative_error,
    synthetic_conversations,
)

FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
IMPLEMENTATIONS = ("eager", "sdpa")
# Exact families differ from the truth by float32 rounding (<= 2e-7 measured); the smallest leak
# measured is 5e-6 (Zamba's Mamba state).
EXACT_RTOL = 1e-6
# What transformers raises where its kernels cannot keep packed sequences apart (Mamba 2, short
# convolutions without their CUDA kernels).
TRANSFORMERS_REFUSAL = "keep packed sequences apart"
GRAD_RTOL = 1e-5
UNAUDITABLE = "cannot be checked"
RESULTS: dict[tuple[str, str], str] = {}
MIXERS_SEEN: set[str] = set()  # the classes of families.MIXERS that some built family has
# (family, implementation) -> the relative loss and gradient errors: of the packed loss where
# exact, of the family's own packed call where refused
ERRORS: dict[tuple[str, str], tuple[float, float]] = {}


def conversations() -> list[dict]:
    found = synthetic_conversations([9, 14, 5, 11], VOCAB, seed=5)
    found[2]["labels"] = [IGNORE] * len(found[2]["labels"])  # a conversation with no target
    return found


PADDED_TO = 48  # the conversations' 39 tokens and a padding segment of 9


def packed_batch(pad_token_id: int = 0, found: list[dict] | None = None) -> dict:
    """``found`` (default: :func:`conversations`) packed in one row, padded to ``PADDED_TO``."""
    collate = PackedCollator(pad_to_multiple_of=PADDED_TO, pad_token_id=pad_token_id)
    found = conversations() if found is None else found
    return collate([{**c, "seq_lengths": [len(c["input_ids"])]} for c in found])


def padding_token(model) -> int:
    """The family's padding token: its embedding's ``padding_idx`` (a row ``nn.Embedding`` keeps
    at 0), else its configuration's ``pad_token_id``, else 0."""
    pad = getattr(model.get_input_embeddings(), "padding_idx", None)
    if pad is None:
        pad = getattr(model.config.get_text_config(), "pad_token_id", None)
    return pad if isinstance(pad, int) and 0 <= pad < VOCAB else 0


@pytest.fixture(scope="module", autouse=True)
def quietly():
    """transformers' warnings about the shrunk configurations (token ids past the vocabulary) off
    (one intra-op thread, as the whole suite runs: conftest.py)."""
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()
    yield
    logging.set_verbosity(verbosity)


def own_packed_call(model, batch):
    """The packed mean of the family's own packed call (no packed loss installed): its logits, the
    per-conversation mean over ``cu_seqlens``."""
    logits = model(**{key: value for key, value in batch.items() if key != "labels"}, use_cache=False).logits
    return packed_ce.cross_entropy(
        logits, batch["labels"], cu_seqlens=batch["cu_seqlens"], is_packed=True, shift=True
    )


def distance(model, compute, truth) -> tuple[float, float] | str:
    """``compute``'s loss and gradients against ``truth`` (relative errors, the gradients of all
    parameters as one vector: a scalar parameter's gradient is a sum with cancellation, DiffLlama's
    lambdas 3e-4 off from float32 rounding alone), or the ValueError's message. A non-finite
    gradient is an infinite error."""
    try:
        loss, grads = loss_and_gradients(model, compute)
    except ValueError as error:
        return str(error)
    if not all(bool(torch.isfinite(g).all()) for g in grads.values()):
        return float("inf"), float("inf")
    return relative_error(loss, truth[0]), flat_relative_error(grads, truth[1])


def exact(errors) -> bool:
    return not isinstance(errors, str) and errors[0] <= EXACT_RTOL and errors[1] <= GRAD_RTOL


def sweep(family: str, attn: str) -> str:
    """Runs one (family, implementation); returns its outcome for the summary."""
    model = tiny_family_model(family, attn)
    MIXERS_SEEN.update(type(mixer).__name__ for mixer in mixers_of(model))
    batch = packed_batch(padding_token(model))
    truth = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    own = distance(model, functools.partial(own_packed_call, batch=batch), truth)
    if isinstance(own, str) and TRANSFORMERS_REFUSAL not in own:
        raise ValueError(own)
    apply_packed_loss(model, is_packed=True, backend="torch")
    packed = distance(model, lambda m: m(**batch).loss, truth)
    where = f"{family} with {attn}"
    if isinstance(packed, str):  # refused
        if exact(own):
            assert UNAUDITABLE in packed, f"{where} is exact packed ({own}) but refused: {packed}"
            return f"unchecked: {packed}"  # refused, though exact: no layers to audit
        assert f"model_type={family!r}" in packed, packed
        ERRORS[family, attn] = (float("inf"),) * 2 if isinstance(own, str) else own
        return f"refused: {packed}"
    assert exact(packed), (
        f"{where}: loss and gradients {packed[0]:.1e}, {packed[1]:.1e} from every conversation "
        "alone, and apply_packed_loss did not refuse: add the family's token mixer to "
        "families.MIXERS or the family to LEAKY_FAMILIES with the reason, or teach the audit "
        "to read its mask"
    )
    ERRORS[family, attn] = packed
    if exact(own):
        return "exact"
    how = "refused by transformers" if isinstance(own, str) else f"{max(own):.1e}"
    return f"made exact: its own packed call {how}"


@pytest.mark.parametrize("family", FAMILIES)
def test_family_is_exact_or_refused(family):
    ran = False
    for attn in IMPLEMENTATIONS:
        try:
            if not supports(family, attn):
                RESULTS[family, attn] = "not supported"
                continue
            RESULTS[family, attn] = sweep(family, attn)
            ran = True
        except NotBuilt as error:
            RESULTS[family, attn] = f"not built: {error}"
    if not ran:
        pytest.skip(RESULTS[family, "eager"])


def test_a_padding_token_whose_embedding_is_zero_is_refused_where_gradients_are_not_finite():
    """Gemma 3n packed with a padding segment of its embedding's padding_idx (PackedCollator's
    default pad_token_id=0): its own packed call gives the exact loss and NaN gradients (AltUp's
    sqrt(mean(x**2)) at a zero embedding); with the packed loss the call is refused naming a
    padding token that works, and with that token the loss and every gradient are the truth's.
    Without gradients (evaluation) the padding_idx stays allowed: the loss is exact."""
    model = tiny_family_model("gemma3n_text", "eager")
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx == padding_token(model) == 0 and not embedding.weight[0].any()
    # the conversations without token 0, which is Gemma's padding token only
    found = [{key: [t or 2 for t in c[key]] for key in ("input_ids", "labels")} for c in conversations()]
    batches = {pad: packed_batch(pad, found) for pad in (0, 1)}
    truth = loss_and_gradients(model, lambda m: one_at_a_time(m, found))
    own = distance(model, functools.partial(own_packed_call, batch=batches[0]), truth)
    assert own == (float("inf"),) * 2
    with torch.no_grad():
        assert relative_error(own_packed_call(model, batches[0]), truth[0]) <= EXACT_RTOL
    apply_packed_loss(model, is_packed=True, backend="torch")
    refused = distance(model, lambda m: m(**batches[0]).loss, truth)
    assert isinstance(refused, str) and "model_type='gemma3n_text'" in refused, refused
    assert "collators.PackedCollator(pad_to_multiple_of=..., pad_token_id=1)" in refused
    assert exact(distance(model, lambda m: m(**batches[1]).loss, truth))
    with torch.no_grad():
        assert relative_error(model(**batches[0]).loss, truth[0]) <= EXACT_RTOL


# A representative set: plain, sliding-window, hybrid-window and MoE families that are exact,
# families whose masks leak (built without position_ids), and Doge, whose flex path leaks.
FLEX_FAMILIES = ["llama", "qwen2", "mistral", "gemma3_text", "qwen3_moe", "opt", "afmoe", "bert", "doge", "gpt_oss"]


@pytest.mark.parametrize("family", FLEX_FAMILIES)
def test_flex_attention_masks_are_audited(family, monkeypatch):
    """With flex attention a family is refused exactly when the mask its attention calls receive
    lets a conversation see the one before (read by the audit's reader, in a stub of the
    attention: compiling flex on CPU takes minutes, and it has no backward there), naming
    ``flex_attention``; the mask is built uncompiled."""
    from torch.nn.attention import flex_attention
    from transformers import masking_utils
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from packed_ce.integrations.model import audit as packing_audit

    batch = packed_batch()
    starts = packing_audit._restarts(batch["position_ids"], tuple(batch["input_ids"].shape))
    pairs = packing_audit._boundary_pairs(starts)
    leaks = []

    def stub(module, query, key, value, attention_mask, **kwargs):
        if query.shape[2] == starts.shape[1]:  # not the probe's shorter rows
            leaks.append(packing_audit._mask_leak(attention_mask, pairs, starts.shape))
        return torch.zeros_like(query).transpose(1, 2), None

    build = functools.partial(flex_attention.create_block_mask, _compile=False)
    monkeypatch.setattr(masking_utils, "create_block_mask", lambda *a, _compile, **k: build(*a, **k))
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flex_attention", stub)
    model = tiny_family_model(family, "flex_attention")
    leaks.clear()  # of the building's unpacked call
    with torch.no_grad():
        own_packed_call(model, batch)
    assert leaks, "the stub was not called"
    apply_packed_loss(model, backend="torch")
    if not any(leaks):
        with torch.no_grad():
            model(**batch)
        assert model._packed_ce.audited == {"flex_attention"}
    else:
        with pytest.raises(ValueError, match=f"model_type='{family}' with attn_implementation='flex_attention'"):
            model(**batch)


def test_every_leaky_implementation_is_checked_here():
    """Each LEAKY_IMPLEMENTATIONS entry is a flex one of FLEX_FAMILIES (eager and sdpa run for
    every family), so a fixed one fails above."""
    assert all(a == "flex_attention" and f in FLEX_FAMILIES for f, a in LEAKY_IMPLEMENTATIONS)


def test_sweep_summary(capsys):
    """Prints the sweep's counts; every LEAKY_FAMILIES entry must have been seen refused and every
    MIXERS class seen in a built family."""
    if len({family for family, _ in RESULTS}) < len(FAMILIES):
        pytest.skip("the sweep ran only in part")
    kind = {key: outcome.split(":")[0] for key, outcome in RESULTS.items()}
    lines = []
    for attn in IMPLEMENTATIONS:
        count = collections.Counter(k for (_, a), k in kind.items() if a == attn)
        lines.append(
            f"{attn}: {sum(count.values()) - count['not built'] - count['not supported']} built "
            f"({count['exact']} exact, {count['made exact']} made exact by packed-ce, "
            f"{count['refused']} refused, {count['unchecked']} exact but refused unchecked), "
            f"{count['not built']} not built, {count['not supported']} without {attn}"
        )
    verdicts = collections.defaultdict(set)
    for (family, _), k in kind.items():
        verdicts[family].add("refused" if k in ("refused", "unchecked") else k)
    built = {f: v - {"not built", "not supported"} for f, v in verdicts.items()}
    built = {f: v for f, v in built.items() if v}
    lines.append(
        f"{len(FAMILIES)} families, {len(built)} built: "
        f"{sum(v == {'exact'} for v in built.values())} exact, "
        f"{sum(v == {'made exact'} for v in built.values())} made exact, "
        f"{sum(v == {'refused'} for v in built.values())} refused, "
        f"{sum(len(v) > 1 for v in built.values())} exact with one implementation only"
    )
    exact = [e for key, e in ERRORS.items() if kind[key] in ("exact", "made exact")]
    leaks = [max(e) for key, e in ERRORS.items() if kind[key] == "refused"]
    lines.append(
        f"worst exact: loss {max(e[0] for e in exact):.1e}, gradients {max(e[1] for e in exact):.1e}; "
        f"smallest leak refused: {min(leaks):.1e}"
    )
    for label in ("made exact", "refused", "unchecked", "not built"):
        lines.append(f"{label}:")
        lines += [f"  {f} {a}: {o[len(label) + 2:]}" for (f, a), o in sorted(RESULTS.items()) if kind[f, a] == label]
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    refused = {family for (family, _), k in kind.items() if k == "refused"}
    assert not set(LEAKY_FAMILIES) - refused, "LEAKY_FAMILIES entries the sweep did not refuse"
    # a refusal for a leaking mask says eager, sdpa and flex attention get it from the same code
    # (none of them a way out): then none may be exact
    same_code = {f for (f, _), o in RESULTS.items() if "get their masks from the same code" in o}
    exact_too = {f for (f, _), k in kind.items() if f in same_code and k in ("exact", "made exact")}
    assert not exact_too, f"refused for their masks, yet exact with another implementation: {exact_too}"
    assert not set(MIXERS) - MIXERS_SEEN, f"MIXERS entries no family has: {set(MIXERS) - MIXERS_SEEN}"
