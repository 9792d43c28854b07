"""The audit of a model's first packed call (``packed_ce/integrations/model/audit.py``).

- the pairs it reads are every boundary query with every key of the sequence before (brute force);
- it reads each mask form as the attention does: transformers' own sdpa (bool), eager (additive)
  and flex (``BlockMask``, with full and partial blocks: every pair against the dense mask) masks
  of a packed row pass, the causal ones of the same row leak, a bool mask of the inverted
  convention (MPT's) too; flash attention passes on varlen keywords or a single row's positions
  with rotary positions that restart (stubbed on a tiny Llama; OPT's absolute positions refused);
- on tiny models: once per attention implementation and model (no hook left after it, no host
  sync after it), again after ``set_attn_implementation``; a refused family trains nothing and its
  unpacked batches still run exact; the refusal holds under gradient checkpointing, inside a PEFT
  adapter and on the fused-linear path, where an exact family stays exact (loss and gradients);
  ``remove_packed_loss`` leaves the layers' hooks as they were; conversations are where
  ``position_ids`` restart, and a packed call without them gets those of its conversations; a token
  mixer no table knows, and a model that mixes conversations far apart, only in training mode or
  across rows, are caught by the probe of the first packed call.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask
from transformers import masking_utils

from collators import PackedCollator, PaddedCollator
from packed_ce.integrations import apply_packed_loss, remove_packed_loss
from packed_ce.integrations.model import audit as packing_audit
from packed_ce.integrations.model.installation import installation_of
from packed_ce.integrations.model.audit import _boundary_pairs, _flash_leak, _mask_leak

from family_models import tiny_family_model

from integration_utils import (
    assert_gradients_close,
    assert_loss_close,
    loss_and_gradients,
    one_at_a_time,
    synthetic_conversations,
    tiny_model,
)

VOCAB = 96
LENGTHS = [9, 14, 5, 11]


def conversations():
    return synthetic_conversations(LENGTHS, VOCAB, seed=5)


def packed_batch() -> dict:
    return PackedCollator()([{**c, "seq_lengths": [len(c["input_ids"])]} for c in conversations()])


def starts_of(lengths_per_row: list[list[int]]) -> torch.Tensor:
    width = sum(lengths_per_row[0])
    starts = torch.zeros(len(lengths_per_row), width, dtype=torch.bool)
    for row, lengths in enumerate(lengths_per_row):
        starts[row, torch.tensor(lengths[:-1], dtype=torch.long).cumsum(0)] = True
    return starts


def test_boundary_pairs_are_every_boundary_query_with_the_sequence_before():
    starts = starts_of([[9, 14, 5, 11], [1, 1, 30, 7], [39]])
    expected = set()
    for row in range(starts.shape[0]):
        opens = [0] + starts[row].nonzero().flatten().tolist() + [starts.shape[1]]
        for before, first, end in zip(opens, opens[1:], opens[2:]):
            expected |= {(row, query, key) for query in (first, end - 1) for key in range(before, first)}
    found = set(zip(*(t.tolist() for t in _boundary_pairs(starts))))
    assert found == expected


def packed_and_causal(lengths: list[int]):
    """The mask_mods of one packed row: transformers' packed causal one, and the plain causal."""
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    packed = masking_utils.and_masks(
        masking_utils.causal_mask_function, masking_utils.packed_sequence_mask_function(documents)
    )
    return packed, masking_utils.causal_mask_function


def mask_forms(mask_mod, width: int) -> dict:
    bool_mask = masking_utils.sdpa_mask(
        batch_size=1, q_length=width, kv_length=width, mask_function=mask_mod, allow_is_causal_skip=False
    )
    return {
        "sdpa-bool": bool_mask,
        "inverted-bool": ~bool_mask,  # MPT masks with True
        "eager-additive": masking_utils.eager_mask(
            batch_size=1, q_length=width, kv_length=width, mask_function=mask_mod
        ),
        "block-mask-16": create_block_mask(mask_mod, 1, None, width, width, device="cpu", BLOCK_SIZE=16),
        "block-mask-128": create_block_mask(mask_mod, 1, None, width, width, device="cpu"),
    }


@pytest.mark.parametrize("form", ["sdpa-bool", "inverted-bool", "eager-additive", "block-mask-16", "block-mask-128"])
def test_each_mask_form_is_read_as_the_attention_reads_it(form):
    width = sum(LENGTHS)
    starts = starts_of([LENGTHS])
    packed, causal = packed_and_causal(LENGTHS)
    assert _mask_leak(mask_forms(packed, width)[form], _boundary_pairs(starts), starts.shape) is None
    leak = _mask_leak(mask_forms(causal, width)[form], _boundary_pairs(starts), starts.shape)
    assert leak == "a mask that lets query 9 of row 0 see key 0 of the sequence before"


@pytest.mark.parametrize("block", [16, 128])
def test_block_mask_is_read_pair_by_pair_as_its_dense_mask(block):
    """Every (query, key) pair of a row, full and partial blocks alike, against ``create_mask``."""
    width = 64
    packed, _ = packed_and_causal([9, 50, 5])
    block_mask = create_block_mask(packed, 1, None, width, width, device="cpu", BLOCK_SIZE=block)
    assert block > 16 or block_mask.full_kv_num_blocks.sum() > 0  # full blocks are exercised
    queries, keys = torch.meshgrid(torch.arange(width), torch.arange(width), indexing="ij")
    rows = torch.zeros(width * width, dtype=torch.long)
    visible = packing_audit._block_mask_visible(block_mask, rows, queries.flatten(), keys.flatten())
    assert torch.equal(visible[:, 0], create_mask(packed, 1, 1, width, width, device="cpu").flatten())


def rotary(positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's ``(cos, sin)`` of ``positions`` ``(B, T)``: ``(B, T, 16)``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model = tiny_model("llama", VOCAB)
    return LlamaRotaryEmbedding(model.config)(torch.zeros(1), positions)


def test_flash_reads_varlen_keywords_or_a_single_rows_positions_and_rotary_positions():
    batch = packed_batch()
    starts = starts_of([LENGTHS])
    varlen = {key: batch[key] for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")}
    restarting, running = rotary(batch["position_ids"]), rotary(torch.arange(sum(LENGTHS))[None])
    assert _flash_leak({**varlen, "position_embeddings": restarting}, starts) is None
    assert _flash_leak({**varlen, "position_embeddings": running}, starts) == (
        "rotary position_embeddings that do not restart at every sequence"
    )
    assert _flash_leak(varlen, starts) == "no rotary position_embeddings to check its positions by"
    merged = {**varlen, "cu_seq_lens_q": batch["cu_seq_lens_q"][[0, 2, 3, 4]]}
    assert _flash_leak(merged, starts) == "cu_seq_lens_q that do not split every sequence"
    single = {"position_ids": batch["position_ids"], "position_embeddings": restarting}
    assert _flash_leak(single, starts) is None
    plain = {"position_ids": torch.arange(sum(LENGTHS))[None], "position_embeddings": restarting}
    assert _flash_leak(plain, starts) == "position_ids that do not restart at every sequence"
    two_rows = starts_of([LENGTHS, LENGTHS])
    found = _flash_leak({"position_ids": batch["position_ids"].expand(2, -1)}, two_rows)
    assert found == "neither varlen keywords nor the position_ids of a single row"


def layer_hooks(model) -> list[int]:
    return [len(layer._forward_pre_hooks) for _, layer in packing_audit.decoder_layers(model)]


def test_audited_once_per_implementation_with_no_hook_or_sync_after(monkeypatch):
    model = apply_packed_loss(tiny_model("llama", VOCAB, attn="sdpa"))
    hooks = layer_hooks(model)
    checks = []
    original = packing_audit._Audit._check
    monkeypatch.setattr(packing_audit._Audit, "_check", lambda *a, **k: checks.append(a[1]) or original(*a, **k))
    with torch.no_grad():
        model(**PaddedCollator()(conversations()))  # one conversation per row: nothing to audit
        model(input_ids=torch.tensor([conversations()[0]["input_ids"]]))
        assert checks == [] and model._packed_ce.audited == set()
        model(**packed_batch())
        assert checks == ["layers.0", "layers.1"] and model._packed_ce.audited == {"sdpa"}
        assert layer_hooks(model) == hooks
        monkeypatch.setattr(packing_audit, "_sequence_starts", None)  # audited: never read again
        model(**packed_batch())
        assert len(checks) == 2
        model.set_attn_implementation("eager")
        with pytest.raises(TypeError):  # a new implementation is read again
            model(**packed_batch())


def test_a_model_without_layers_mixes_nothing():
    model = apply_packed_loss(tiny_model("llama", VOCAB, num_hidden_layers=0))
    with torch.no_grad():
        assert_loss_close(model(**packed_batch()).loss, one_at_a_time(model, conversations()))
    assert model._packed_ce.audited == {"sdpa"}


def test_a_refused_family_trains_nothing_and_runs_unpacked():
    model = apply_packed_loss(tiny_model("llama", VOCAB, attn="eager"))  # to compare with
    opt = apply_packed_loss(tiny_family_model("opt", "sdpa"))
    hooks = layer_hooks(opt)
    message = (
        "packed batches are not exact on model_type='opt' with attn_implementation='sdpa': decoder "
        "layer 'layers.0' gets no mask"
    )
    with pytest.raises(ValueError, match=message):
        opt(**packed_batch()).loss.backward()
    assert all(p.grad is None for p in opt.parameters())
    assert layer_hooks(opt) == hooks and opt._packed_ce.audited == set()
    padded = PaddedCollator()(conversations())
    with torch.no_grad():
        assert_loss_close(opt(**padded).loss, one_at_a_time(opt, conversations()))
        assert_loss_close(model(**padded).loss, one_at_a_time(model, conversations()))


def with_setup(model, setup: str):
    if setup == "checkpointing":
        model.activation_checkpointing_enable()
        return apply_packed_loss(model)
    if setup == "fused":
        return apply_packed_loss(model, fused_linear=True)
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "v_proj"]
    return peft.get_peft_model(apply_packed_loss(model), peft.LoraConfig(r=4, target_modules=targets))


@pytest.mark.parametrize("setup", ["checkpointing", "fused", "peft"])
def test_audit_under_checkpointing_peft_and_the_fused_head(setup):
    """A leaking family is refused and an exact one stays exact, loss and every gradient."""
    opt = with_setup(tiny_family_model("opt", "eager"), setup)
    with pytest.raises(ValueError, match="model_type='opt' with attn_implementation='eager'"):
        opt(**packed_batch())
    model = with_setup(tiny_model("llama", VOCAB, attn="eager"), setup)
    loss, grads = loss_and_gradients(model, lambda m: m(**packed_batch()).loss)
    assert installation_of(model).audited == {"eager"}
    truth, truth_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    assert_loss_close(loss, truth)
    assert_gradients_close(grads, truth_grads)


def test_remove_packed_loss_leaves_the_layers_as_they_were():
    model = tiny_model("llama", VOCAB)
    hooks = layer_hooks(model)
    apply_packed_loss(model)
    with torch.no_grad():
        model(**packed_batch())
    remove_packed_loss(model)
    assert layer_hooks(model) == hooks and not hasattr(model, "_packed_ce")


def test_a_call_without_position_ids_gets_its_conversations_positions():
    """``cu_seqlens`` without the collator's ``position_ids``: the model gets the positions of the
    call's conversations (what transformers' masks follow), exact, loss and every gradient."""
    batch = {k: v for k, v in packed_batch().items() if k != "position_ids"}
    model = apply_packed_loss(tiny_model("llama", VOCAB, attn="sdpa"))
    loss, grads = loss_and_gradients(model, lambda m: m(**batch).loss)
    truth, truth_grads = loss_and_gradients(model, lambda m: one_at_a_time(m, conversations()))
    assert_loss_close(loss, truth)
    assert_gradients_close(grads, truth_grads)


class Leak(torch.nn.Module):
    """A tiny Llama's MLP plus a path no attention mask shows: ``far``, each token reads the one
    20 tokens before it (further than a conversation of 8 tokens reaches); ``training``, a running
    sum over the row in training mode only; ``rows``, the mean over the batch's rows."""

    def __init__(self, inner: torch.nn.Module, kind: str):
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, x):
        y = self.inner(x)
        if self.kind == "far":
            return y + 0.5 * torch.nn.functional.pad(x, (0, 0, 20, 0))[:, : x.shape[1]]
        if self.kind == "training" and self.training:
            return y + 0.5 * x.cumsum(1) / x.shape[1]
        if self.kind == "rows":
            return y + 0.5 * x.mean(0, keepdim=True)
        return y


@pytest.mark.parametrize("kind", ["far", "training", "rows"])
def test_the_probe_sees_what_a_training_step_does(kind):
    """A model (remote code, say) that mixes conversations further apart than a short probe
    reaches, only in training mode, or only across the rows of a batch: refused at its first
    packed training call, before anything trains."""
    model = tiny_model("llama", VOCAB)
    model.model.layers[0].mlp = Leak(model.model.layers[0].mlp, kind)
    apply_packed_loss(model, backend="torch").train()
    with pytest.raises(ValueError, match=r"the logits of a conversation change by .*training mode"):
        model(**packed_batch())
    assert not installation_of(model).audited


def test_conversations_are_where_position_ids_restart():
    """A context-parallel shard splits a conversation in ``cu_seqlens`` for its loss, where its
    ``position_ids`` go on: one conversation to attention, exact."""
    from collators import shard_batch

    model = apply_packed_loss(tiny_model("llama", VOCAB))
    batch = PackedCollator(pad_to_multiple_of=2)(
        [{**c, "seq_lengths": [len(c["input_ids"])]} for c in conversations()]
    )
    # the shard's tensors without its record (a model without context parallelism refuses that)
    shard = {k: v for k, v in shard_batch(batch, 0, 1).items() if k != "context_parallel_shard"}
    assert len(shard["cu_seqlens"]) > len(batch["cu_seqlens"])  # a split without a restart
    with torch.no_grad():
        assert_loss_close(model(**shard).loss, model(**batch).loss)
    assert model._packed_ce.audited == {"sdpa"}


def test_a_token_mixer_no_table_knows_is_caught_by_the_probe(monkeypatch):
    """LFM2's short convolution without its MIXERS entry: no attention mask shows it, the probe of
    the first packed call does (B's logits change with the conversation before it)."""
    from packed_ce.integrations.model import families

    model = tiny_family_model("lfm2", "eager")
    monkeypatch.delitem(families.MIXERS, "Lfm2ShortConv")
    apply_packed_loss(model, backend="torch")
    with pytest.raises(ValueError, match=r"model_type='lfm2'.*the logits of a conversation change by .* when the "
                                         r"conversation before it in the row"):
        model(**packed_batch())
    monkeypatch.undo()
    apply_packed_loss(model, backend="torch")  # with its entry: run per conversation, exact
    model(**packed_batch())
    assert model._packed_ce.audited == {"eager"}


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_flash_attention_layers_are_audited_by_their_keywords(family, monkeypatch):
    """flash_attention_2 (no CUDA here: its mask built as transformers does, the attention a stub):
    a rotary family whose layers get the collator's varlen keywords is accepted, unless the call
    drops them; a family with absolute position embeddings (OPT) cannot be checked, refused."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    monkeypatch.setitem(
        ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2",
        lambda module, query, key, value, attention_mask, **kwargs: (query.transpose(1, 2), None),
    )
    model = tiny_family_model(family, "eager")
    model.config._attn_implementation = "flash_attention_2"
    apply_packed_loss(model)
    batch = packed_batch()
    two_rows = {key: batch[key].expand(2, -1) for key in ("input_ids", "labels", "position_ids")}
    with pytest.raises(ValueError, match="neither varlen keywords nor the position_ids of a single row"):
        model(**two_rows)
    if family == "opt":
        with pytest.raises(ValueError, match="no rotary position_embeddings to check its positions by"):
            model(**batch)
    else:
        with torch.no_grad():
            model(**batch)
        assert model._packed_ce.audited == {"flash_attention_2"}


def test_a_refusal_names_what_works_on_this_machine():
    """gpt-oss on a CPU: eager leaks, sdpa it does not support, flex leaks too (LEAKY_IMPLEMENTATIONS):
    the message names no other attention implementation, only unpacked training, which is exact."""
    model = tiny_family_model("gpt_oss", "eager")
    apply_packed_loss(model, backend="torch")
    with pytest.raises(ValueError) as refused:
        model(**packed_batch())
    message = str(refused.value)
    assert "no other attention implementation of gpt_oss runs on this machine" in message
    assert "SFTConfig(packing=False, padding_free=False)" in message and "PaddedCollator" in message
    loss = model(**PaddedCollator()(conversations())).loss
    assert_loss_close(loss, one_at_a_time(model, conversations()))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_a_mask_built_without_the_conversations_names_no_implementation_that_gets_it_too(attn):
    """Granite 4.0-H (transformers 5.24 builds its masks without position_ids): eager's mask and
    sdpa's none leak alike, and flex attention gets the same mask, so neither refusal may send the
    user to another of them (it named sdpa from eager and eager from sdpa); without rotary
    embeddings flash attention is refused too, so only unpacked training is named, and it is
    exact."""
    model = tiny_family_model("granitemoehybrid", attn)
    apply_packed_loss(model, backend="torch")
    with pytest.raises(ValueError, match=f"model_type='granitemoehybrid' with attn_implementation='{attn}'") as refused:
        model(**packed_batch())
    message = str(refused.value)
    assert "load the model with" not in message, message
    assert "eager, sdpa, flex_attention get their masks from the same code" in message
    assert "flash attention is refused without rotary position embeddings" in message
    assert "SFTConfig(packing=False, padding_free=False)" in message and "PaddedCollator" in message
    loss = model(**PaddedCollator()(conversations())).loss
    assert_loss_close(loss, one_at_a_time(model, conversations()))
