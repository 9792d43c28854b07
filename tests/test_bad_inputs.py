"""Bad input to every public loss entry point, one table row each: the exact result or a clear error.

Every argument of ``cross_entropy``, ``fused_linear_cross_entropy``, their modules,
``LossOptions``, ``ChunkOptions`` and ``count_normaliser`` goes through wrong types, shapes,
dtypes, devices (a "meta" tensor stands in for another device), ranges, non-finite values,
overlapping or strided memory and empty inputs. A row says what must come out: ``Raises`` (the
exception type and a fragment of the message that names the argument), ``Equals`` (the exact
value, from an independent float64 computation: ``F.cross_entropy`` or a written-out number)
``Runs`` (``validate=False`` on invalid values: memory-safe, value unspecified) or ``OnMeta``
(shape inference only); a dict of them where the backends differ by design. The loss rows run on both backends (the kernel through
the Triton interpreter on CPU). Tiny shapes: the whole table runs in seconds.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import packed_ce
from packed_ce import ChunkOptions, LossOptions
from packed_ce.targets import count_normaliser

from loss_utils import CPU_BACKENDS as BACKENDS, per_sequence_loss

N, V, H = 6, 11, 4  # tokens, vocabulary, hidden size
INF, NAN = float("inf"), float("nan")


class Raises(NamedTuple):
    error: type
    match: str  # a fragment of the message: the argument's name and what is wrong


class Equals(NamedTuple):
    expected: Callable[[dict], torch.Tensor]  # float64 ground truth from the row's tensors


class Runs(NamedTuple):
    shape: tuple  # validate=False on invalid values: any value of this shape, no error, no crash


class OnMeta(NamedTuple):
    shape: tuple  # the loss of meta tensors: shape inference, no values


def _tensors() -> dict:
    """Fresh valid inputs for a row: ``(N, V)`` logits, ``(N,)`` labels, an LM head, boundaries."""
    gen = torch.Generator().manual_seed(0)
    return dict(
        logits=torch.randn(N, V, generator=gen) * 2,
        labels=torch.tensor([3, 0, 10, -100, 7, 1]),
        hidden=torch.randn(N, H, generator=gen),
        weight=torch.randn(V, H, generator=gen),
        bias=torch.randn(V, generator=gen),
        cu=torch.tensor([0, 2, 6], dtype=torch.int32),
    )


def _ce(logits, labels, **keywords) -> torch.Tensor:
    """float64 ``F.cross_entropy`` (the token mean) of the given logits."""
    return F.cross_entropy(logits.double(), labels.long(), **keywords)


def _packed_mean(logits, labels, bounds) -> torch.Tensor:
    """float64 mean over the sequences ``[bounds[s], bounds[s+1])`` with a target of their mean
    token loss: the suite's ground truth, :func:`loss_utils.per_sequence_loss`."""
    return per_sequence_loss(logits, labels, list(zip(bounds[:-1], bounds[1:])), is_packed=True, shift=False)


def _with(t: dict, name: str, value) -> dict:
    return {**t, name: value}


def _inf_at(t, value):
    x = t["logits"].clone()
    x[:, 4] = value
    return x


def _rows_cross_entropy():
    """(argument, bad input, keywords of the call from the row's tensors, outcome)."""
    ce = lambda t: _ce(t["logits"], t["labels"])  # noqa: E731 (the plain call's true value)
    meta = torch.device("meta")
    return [
        # logits
        ("logits", "a list", lambda t: _with(t, "logits", t["logits"].tolist()), Raises(TypeError, "logits must be a torch.Tensor")),
        ("logits", "None", lambda t: _with(t, "logits", None), Raises(TypeError, "logits must be a torch.Tensor")),
        ("logits", "int64", lambda t: _with(t, "logits", t["logits"].long()), Raises(TypeError, "logits must have dtype")),
        ("logits", "float64", lambda t: _with(t, "logits", t["logits"].double()), {"torch": Equals(ce), "triton": Raises(TypeError, "logits must have dtype")}),
        ("logits", "1-D (V,)", lambda t: _with(t, "logits", t["logits"][0]), Raises(ValueError, r"logits must be \(N, V\)")),
        ("logits", "4-D", lambda t: _with(t, "logits", t["logits"][None, None]), Raises(ValueError, r"logits must be \(N, V\)")),
        ("logits", "V = 0", lambda t: _with(t, "logits", t["logits"][:, :0]), Raises(ValueError, "V >= 1")),
        ("logits", "on another device (meta)", lambda t: _with(t, "logits", t["logits"].to(meta)), {"torch": Raises(ValueError, "labels are on cpu but logits on meta"), "triton": Raises(ValueError, r"backend='triton' needs CUDA tensors \(got meta\)")}),
        ("logits", "N = 0 (mean)", lambda t: {**t, "logits": t["logits"][:0], "labels": t["labels"][:0]}, Equals(lambda t: torch.tensor(0.0))),
        ("logits", "N = 0 (none)", lambda t: {**t, "logits": t["logits"][:0], "labels": t["labels"][:0], "reduction": "none"}, Equals(lambda t: torch.zeros(0))),
        ("logits", "NaN entries", lambda t: _with(t, "logits", t["logits"].fill_(NAN)), Equals(lambda t: torch.tensor(NAN))),
        ("logits", "+inf entry (undefined)", lambda t: _with(t, "logits", _inf_at(t, INF)), Equals(lambda t: _ce(_inf_at(t, INF), t["labels"]))),
        ("logits", "-inf entry (masked class)", lambda t: _with(t, "logits", _inf_at(t, -INF)), Equals(lambda t: _ce(_inf_at(t, -INF), t["labels"]))),
        ("logits", "-inf entry, label_smoothing", lambda t: {**t, "logits": _inf_at(t, -INF), "label_smoothing": 0.1}, Equals(lambda t: torch.tensor(INF))),
        ("logits", "strided (transposed storage)", lambda t: _with(t, "logits", t["logits"].t().contiguous().t()), Equals(ce)),
        ("logits", "expanded (stride 0)", lambda t: _with(t, "logits", t["logits"][:1].expand(N, V)), Equals(lambda t: _ce(t["logits"][:1].expand(N, V), t["labels"]))),
        ("logits", "overlapping rows (as_strided)", lambda t: _with(t, "logits", t["logits"].as_strided((N, V), (1, 1))), Equals(lambda t: _ce(t["logits"].as_strided((N, V), (1, 1)), t["labels"]))),
        ("logits", "expanded + inplace_backward", lambda t: {**t, "logits": t["logits"][:1].expand(N, V), "inplace_backward": True}, Raises(ValueError, "inplace_backward=True .* contiguous")),
        # labels
        ("labels", "a list", lambda t: _with(t, "labels", t["labels"].tolist()), Raises(TypeError, "labels must be a torch.Tensor")),
        ("labels", "float", lambda t: _with(t, "labels", t["labels"].float()), Raises(TypeError, "labels must be an integer tensor")),
        ("labels", "bool", lambda t: _with(t, "labels", t["labels"] > 0), Raises(TypeError, "labels must be an integer tensor")),
        ("labels", "(N-1,) shape", lambda t: _with(t, "labels", t["labels"][:-1]), Raises(ValueError, r"labels must have shape \(6,\)")),
        ("labels", "(1, N) shape", lambda t: _with(t, "labels", t["labels"][None]), Raises(ValueError, r"labels must have shape \(6,\)")),
        ("labels", "on another device (meta)", lambda t: _with(t, "labels", t["labels"].to(meta)), Raises(ValueError, "labels are on meta")),
        ("labels", "= V", lambda t: _with(t, "labels", t["labels"].index_fill(0, torch.tensor([1]), V)), Raises(ValueError, r"labels must be in \[0, 11\)")),
        ("labels", "negative, not ignore_index", lambda t: _with(t, "labels", t["labels"].index_fill(0, torch.tensor([1]), -5)), Raises(ValueError, r"labels must be in \[0, 11\)")),
        ("labels", "= V, validate=False", lambda t: {**t, "labels": t["labels"].index_fill(0, torch.tensor([1]), V), "validate": False}, Runs(())),
        ("labels", "uint8", lambda t: _with(t, "labels", t["labels"].clamp(min=0).to(torch.uint8)), Equals(lambda t: _ce(t["logits"], t["labels"].clamp(min=0)))),
        ("labels", "expanded (stride 0)", lambda t: _with(t, "labels", t["labels"][:1].expand(N)), Equals(lambda t: _ce(t["logits"], t["labels"][:1].expand(N)))),
        ("labels", "strided", lambda t: _with(t, "labels", torch.stack([t["labels"]] * 2, 1)[:, 0]), Equals(ce)),
        ("labels", "all ignore_index", lambda t: _with(t, "labels", torch.full((N,), -100)), Equals(lambda t: torch.tensor(0.0))),
        # cu_seqlens
        ("cu_seqlens", "a list", lambda t: {**t, "cu_seqlens": [0, 2, 6], "is_packed": True}, Raises(TypeError, "cu_seqlens must be a torch.Tensor")),
        ("cu_seqlens", "float", lambda t: {**t, "cu_seqlens": t["cu"].float(), "is_packed": True}, Raises(TypeError, "cu_seqlens must be int32 or int64")),
        ("cu_seqlens", "uint8", lambda t: {**t, "cu_seqlens": t["cu"].to(torch.uint8), "is_packed": True}, Raises(TypeError, "cu_seqlens must be int32 or int64")),
        ("cu_seqlens", "2-D", lambda t: {**t, "cu_seqlens": t["cu"][None], "is_packed": True}, Raises(ValueError, r"cu_seqlens must be 1-D")),
        ("cu_seqlens", "empty", lambda t: {**t, "cu_seqlens": t["cu"][:0], "is_packed": True}, Raises(ValueError, r"cu_seqlens must be 1-D")),
        ("cu_seqlens", "one entry [0]", lambda t: {**t, "cu_seqlens": t["cu"][:1], "is_packed": True}, Raises(ValueError, "cu_seqlens must be .* one entry")),
        ("cu_seqlens", "on another device (meta)", lambda t: {**t, "cu_seqlens": t["cu"].to(meta), "is_packed": True}, Raises(ValueError, "cu_seqlens is on meta")),
        ("cu_seqlens", "[1, 2, 6] (not from 0)", lambda t: {**t, "cu_seqlens": torch.tensor([1, 2, 6]), "is_packed": True}, Raises(ValueError, "cu_seqlens must start at 0")),
        ("cu_seqlens", "[0, 2, 5] (not to N)", lambda t: {**t, "cu_seqlens": torch.tensor([0, 2, 5]), "is_packed": True}, Raises(ValueError, "cu_seqlens must end at N=6")),
        ("cu_seqlens", "[0, 4, 2, 6] (decreasing)", lambda t: {**t, "cu_seqlens": torch.tensor([0, 4, 2, 6]), "is_packed": True}, Raises(ValueError, "cu_seqlens must be non-decreasing")),
        ("cu_seqlens", "[0, 4, 2, 9], validate=False", lambda t: {**t, "cu_seqlens": torch.tensor([0, 4, 2, 9]), "is_packed": True, "validate": False}, Runs(())),
        ("cu_seqlens", "strided", lambda t: {**t, "cu_seqlens": torch.stack([t["cu"]] * 2, 1)[:, 0], "is_packed": True}, Equals(lambda t: _packed_mean(t["logits"], t["labels"], [0, 2, 6]))),
        ("cu_seqlens", "with position_ids too", lambda t: {**t, "cu_seqlens": t["cu"], "position_ids": torch.arange(N)}, Raises(ValueError, "cu_seqlens or position_ids, not both")),
        ("cu_seqlens", "missing, is_packed=True", lambda t: {**t, "is_packed": True}, Raises(ValueError, "is_packed=True needs")),
        # position_ids
        ("position_ids", "a list", lambda t: {**t, "position_ids": list(range(N)), "is_packed": True}, Raises(TypeError, "position_ids must be a torch.Tensor")),
        ("position_ids", "float", lambda t: {**t, "position_ids": torch.arange(N).float(), "is_packed": True}, Raises(TypeError, "position_ids must be an integer tensor")),
        ("position_ids", "N+1 entries", lambda t: {**t, "position_ids": torch.arange(N + 1), "is_packed": True}, Raises(ValueError, "position_ids must have one entry per token")),
        ("position_ids", "on another device (meta)", lambda t: {**t, "position_ids": torch.arange(N, device=meta), "is_packed": True}, Raises(ValueError, "position_ids is on meta")),
        ("position_ids", "negative, decreasing (a sequence per token)", lambda t: {**t, "position_ids": -torch.arange(N), "is_packed": True}, Equals(lambda t: _packed_mean(t["logits"], t["labels"], list(range(N + 1))))),
        # num_items_in_batch
        ("num_items_in_batch", "'3' (str)", lambda t: _with(t, "num_items_in_batch", "3"), Raises(TypeError, "num_items_in_batch must be an int")),
        ("num_items_in_batch", "2.5", lambda t: _with(t, "num_items_in_batch", 2.5), Raises(TypeError, "num_items_in_batch must be an int")),
        ("num_items_in_batch", "nan", lambda t: _with(t, "num_items_in_batch", NAN), Raises(TypeError, "num_items_in_batch must be an int")),
        ("num_items_in_batch", "inf, validate=False", lambda t: {**t, "num_items_in_batch": INF, "validate": False}, Raises(TypeError, "num_items_in_batch must be an int")),
        ("num_items_in_batch", "True", lambda t: _with(t, "num_items_in_batch", True), Raises(TypeError, "num_items_in_batch must be an int")),
        ("num_items_in_batch", "-1, validate=False", lambda t: {**t, "num_items_in_batch": -1, "validate": False}, Raises(ValueError, "num_items_in_batch must be >= 0")),
        ("num_items_in_batch", "0", lambda t: _with(t, "num_items_in_batch", 0), Equals(lambda t: torch.tensor(0.0))),
        ("num_items_in_batch", "numpy int64 10", lambda t: _with(t, "num_items_in_batch", np.int64(10)), Equals(lambda t: ce(t) * 5 / 10)),
        ("num_items_in_batch", "float tensor 10.0", lambda t: _with(t, "num_items_in_batch", torch.tensor(10.0)), Equals(lambda t: ce(t) * 5 / 10)),
        ("num_items_in_batch", "tensor (2,)", lambda t: _with(t, "num_items_in_batch", torch.tensor([1, 2])), Raises(ValueError, "num_items_in_batch must be an int or a 0-d tensor")),
        ("num_items_in_batch", "bool tensor", lambda t: _with(t, "num_items_in_batch", torch.tensor(True)), Raises(TypeError, "num_items_in_batch must be a real tensor")),
        ("num_items_in_batch", "tensor on another device (meta)", lambda t: _with(t, "num_items_in_batch", torch.tensor(3, device=meta)), Raises(ValueError, "num_items_in_batch is on meta")),
        ("num_items_in_batch", "tensor -1", lambda t: _with(t, "num_items_in_batch", torch.tensor(-1)), Raises(ValueError, "num_items_in_batch must be finite and >= 0")),
        ("num_items_in_batch", "tensor nan", lambda t: _with(t, "num_items_in_batch", torch.tensor(NAN)), Raises(ValueError, "num_items_in_batch must be finite and >= 0")),
        ("num_items_in_batch", "tensor inf", lambda t: _with(t, "num_items_in_batch", torch.tensor(INF)), Raises(ValueError, "num_items_in_batch must be finite and >= 0")),
        ("num_items_in_batch", "tensor -1, validate=False", lambda t: {**t, "num_items_in_batch": torch.tensor(-1), "validate": False}, Runs(())),
        ("num_items_in_batch", "tensor inf, validate=False", lambda t: {**t, "num_items_in_batch": torch.tensor(INF), "validate": False}, Runs(())),
        # options (checked by LossOptions, named in the message)
        ("is_packed", "1", lambda t: _with(t, "is_packed", 1), Raises(TypeError, "is_packed must be True or False")),
        ("shift", "None", lambda t: _with(t, "shift", None), Raises(TypeError, "shift must be True or False")),
        ("ignore_index", "1.5", lambda t: _with(t, "ignore_index", 1.5), Raises(TypeError, "ignore_index must be an int")),
        ("ignore_index", "3 while the labels use -100", lambda t: _with(t, "ignore_index", 3), Raises(ValueError, r"labels must be in \[0, 11\) or equal ignore_index=3")),
        ("ignore_index", "3, a class (labels without -100)", lambda t: {**t, "labels": t["labels"].clamp(min=0), "ignore_index": 3}, Equals(lambda t: _ce(t["logits"], t["labels"].clamp(min=0), ignore_index=3))),
        ("reduction", "None", lambda t: _with(t, "reduction", None), Raises(ValueError, "reduction must be one of")),
        ("reduction", "'average'", lambda t: _with(t, "reduction", "average"), Raises(ValueError, "reduction must be one of")),
        ("label_smoothing", "'0.1' (str)", lambda t: _with(t, "label_smoothing", "0.1"), Raises(TypeError, "label_smoothing must be a real number")),
        ("label_smoothing", "-0.1", lambda t: _with(t, "label_smoothing", -0.1), Raises(ValueError, r"label_smoothing must be in \[0, 1\]")),
        ("label_smoothing", "1.5", lambda t: _with(t, "label_smoothing", 1.5), Raises(ValueError, r"label_smoothing must be in \[0, 1\]")),
        ("label_smoothing", "nan", lambda t: _with(t, "label_smoothing", NAN), Raises(ValueError, "label_smoothing must be finite")),
        ("label_smoothing", "0-d tensor 0.1", lambda t: _with(t, "label_smoothing", torch.tensor(0.1)), Equals(lambda t: _ce(t["logits"], t["labels"], label_smoothing=0.1))),
        ("z_loss_scale", "-1", lambda t: _with(t, "z_loss_scale", -1), Raises(ValueError, "z_loss_scale must be >= 0")),
        ("z_loss_scale", "inf", lambda t: _with(t, "z_loss_scale", INF), Raises(ValueError, "z_loss_scale must be finite")),
        ("softcap", "0", lambda t: _with(t, "softcap", 0), Raises(ValueError, "softcap must be None or > 0")),
        ("softcap", "-1", lambda t: _with(t, "softcap", -1.0), Raises(ValueError, "softcap must be None or > 0")),
        ("softcap", "inf", lambda t: _with(t, "softcap", INF), Raises(ValueError, "softcap must be finite")),
        ("softcap", "True", lambda t: _with(t, "softcap", True), Raises(TypeError, "softcap must be a real number")),
        ("return_z_loss", "'yes'", lambda t: _with(t, "return_z_loss", "yes"), Raises(TypeError, "return_z_loss must be True or False")),
        ("inplace_backward", "1", lambda t: _with(t, "inplace_backward", 1), Raises(TypeError, "inplace_backward must be True or False")),
        ("backend", "'cuda'", lambda t: _with(t, "backend", "cuda"), Raises(ValueError, "backend must be")),
        ("validate", "0", lambda t: _with(t, "validate", 0), Raises(TypeError, "validate must be True or False")),
        ("options", "a dict", lambda t: _with(t, "options", {}), Raises(TypeError, "options must be a LossOptions")),
        ("**keywords", "unknown 'foo'", lambda t: _with(t, "foo", 1), Raises(TypeError, "foo: not an option")),
        ("**keywords", "a fused-only option (chunk_size)", lambda t: _with(t, "chunk_size", 4), Raises(TypeError, "chunk_size: not an option")),
    ]


def _call_cross_entropy(kw: dict, backend: str):
    kw = dict(kw)
    for name in ("hidden", "weight", "bias", "cu"):
        kw.pop(name)
    kw.setdefault("backend", backend)
    return packed_ce.cross_entropy(kw.pop("logits"), kw.pop("labels"), **kw)


def _linear_ce(t, **keywords):
    """float64 ``F.cross_entropy`` of ``hidden @ weight.T + bias``."""
    logits = F.linear(t["hidden"].double(), t["weight"].double(), None if t.get("bias") is None else t["bias"].double())
    return _ce(logits, t["labels"], **keywords)


def _neg_inf_bias(t):
    bias = t["bias"].clone()
    bias[4] = -INF
    return bias


def _rows_fused():
    meta = torch.device("meta")
    return [
        ("hidden", "a list", lambda t: _with(t, "hidden", t["hidden"].tolist()), Raises(TypeError, "hidden must be a torch.Tensor")),
        ("hidden", "int64", lambda t: {**t, "hidden": t["hidden"].long(), "weight": t["weight"].long(), "bias": None}, Raises(TypeError, "hidden must have dtype")),
        ("hidden", "1-D (H,)", lambda t: _with(t, "hidden", t["hidden"][0]), Raises(ValueError, r"hidden must be \(N, H\)")),
        ("hidden", "on another device (meta)", lambda t: _with(t, "hidden", t["hidden"].to(meta)), {"torch": Raises(ValueError, "weight is on cpu but hidden on meta"), "triton": Raises(ValueError, r"backend='triton' needs CUDA tensors \(got meta\)")}),
        ("hidden", "N = 0", lambda t: {**t, "hidden": t["hidden"][:0], "labels": t["labels"][:0]}, Equals(lambda t: torch.tensor(0.0))),
        ("hidden", "H = 0 (logits = bias)", lambda t: {**t, "hidden": t["hidden"][:, :0], "weight": t["weight"][:, :0]}, Equals(lambda t: _ce(t["bias"].expand(N, V), t["labels"]))),
        ("hidden", "NaN entries", lambda t: _with(t, "hidden", t["hidden"].fill_(NAN)), Equals(lambda t: torch.tensor(NAN))),
        ("hidden", "strided", lambda t: _with(t, "hidden", t["hidden"].t().contiguous().t()), Equals(_linear_ce)),
        ("hidden", "expanded (stride 0)", lambda t: _with(t, "hidden", t["hidden"][:1].expand(N, H)), Equals(lambda t: _linear_ce({**t, "hidden": t["hidden"][:1].expand(N, H)}))),
        ("weight", "a list", lambda t: _with(t, "weight", t["weight"].tolist()), Raises(TypeError, "weight must be a torch.Tensor")),
        ("weight", "1-D", lambda t: _with(t, "weight", t["weight"][0]), Raises(ValueError, r"weight must be \(V, H\)")),
        ("weight", "(V, H-1)", lambda t: _with(t, "weight", t["weight"][:, 1:]), Raises(ValueError, r"weight must be \(V, H\) with H=4")),
        ("weight", "float64 with float32 hidden", lambda t: _with(t, "weight", t["weight"].double()), Raises(TypeError, "weight must have the dtype of hidden")),
        ("weight", "on another device (meta)", lambda t: _with(t, "weight", t["weight"].to(meta)), Raises(ValueError, "weight is on meta")),
        ("weight", "V = 0", lambda t: {**t, "weight": t["weight"][:0], "bias": None}, Raises(ValueError, "V >= 1")),
        ("weight", "expanded (stride 0)", lambda t: _with(t, "weight", t["weight"][:1].expand(V, H)), Equals(lambda t: _linear_ce({**t, "weight": t["weight"][:1].expand(V, H)}))),
        ("weight", "strided (tied embedding, transposed)", lambda t: _with(t, "weight", t["weight"].t().contiguous().t()), Equals(_linear_ce)),
        ("bias", "a list", lambda t: _with(t, "bias", t["bias"].tolist()), Raises(TypeError, "bias must be None or a torch.Tensor")),
        ("bias", "(3,)", lambda t: _with(t, "bias", t["bias"][:3]), Raises(ValueError, r"bias must be \(V,\)")),
        ("bias", "float64", lambda t: _with(t, "bias", t["bias"].double()), Raises(TypeError, "bias must have the dtype of hidden")),
        ("bias", "on another device (meta)", lambda t: _with(t, "bias", t["bias"].to(meta)), Raises(ValueError, "bias is on meta")),
        ("bias", "-inf entry (masked class)", lambda t: _with(t, "bias", _neg_inf_bias(t)), Equals(lambda t: _linear_ce({**t, "bias": _neg_inf_bias(t)}))),
        ("labels", "(N-1,)", lambda t: _with(t, "labels", t["labels"][:-1]), Raises(ValueError, r"labels must have shape \(6,\) to match hidden @ weight.T")),
        ("labels", "float", lambda t: _with(t, "labels", t["labels"].float()), Raises(TypeError, "labels must be an integer tensor")),
        ("cu_seqlens", "[0, 2, 5] (not to N)", lambda t: {**t, "cu_seqlens": torch.tensor([0, 2, 5]), "is_packed": True}, Raises(ValueError, "cu_seqlens must end at N=6")),
        ("num_items_in_batch", "tensor nan", lambda t: _with(t, "num_items_in_batch", torch.tensor(NAN)), Raises(ValueError, "num_items_in_batch must be finite")),
        ("chunk_size", "0", lambda t: _with(t, "chunk_size", 0), Raises(ValueError, "chunk_size must be None or a positive int")),
        ("chunk_size", "2.0", lambda t: _with(t, "chunk_size", 2.0), Raises(ValueError, "chunk_size must be None or a positive int")),
        ("chunk_size", "larger than N", lambda t: _with(t, "chunk_size", 1000), Equals(_linear_ce)),
        ("grad_accumulation_dtype", "torch.int32", lambda t: _with(t, "grad_accumulation_dtype", torch.int32), Raises(TypeError, "grad_accumulation_dtype must be None or a floating")),
        ("grad_accumulation_dtype", "'float32' (str)", lambda t: _with(t, "grad_accumulation_dtype", "float32"), Raises(TypeError, "grad_accumulation_dtype must be None or a floating")),
        ("grad_accumulation_dtype", "narrower than the weight (documented: the weight's)", lambda t: _with(t, "grad_accumulation_dtype", torch.float16), Equals(_linear_ce)),
        ("drop_ignored_rows", "'yes'", lambda t: _with(t, "drop_ignored_rows", "yes"), Raises(TypeError, "drop_ignored_rows must be None, True or False")),
        ("drop_ignored_rows", "None (documented: where it pays)", lambda t: _with(t, "drop_ignored_rows", None), Equals(_linear_ce)),
        ("inplace_backward", "True (documented: no effect)", lambda t: _with(t, "inplace_backward", True), Equals(_linear_ce)),
        ("chunk_options", "a dict", lambda t: _with(t, "chunk_options", {}), Raises(TypeError, "chunk_options must be a ChunkOptions")),
        ("**keywords", "a per-call tensor's typo 'cu_seqlen'", lambda t: _with(t, "cu_seqlen", t["cu"]), Raises(TypeError, "cu_seqlen: not an option")),
    ]


def _call_fused(kw: dict, backend: str):
    kw = dict(kw)
    for name in ("logits", "cu"):
        kw.pop(name)
    kw.setdefault("backend", backend)
    return packed_ce.fused_linear_cross_entropy(kw.pop("hidden"), kw.pop("weight"), kw.pop("labels"), **kw)


def _rows_modules():
    """(argument, bad input, call, outcome): the modules check their options once, at build."""
    module, fused_module = packed_ce.PackedCrossEntropyLoss, packed_ce.FusedLinearPackedCrossEntropyLoss
    return [
        ("PackedCrossEntropyLoss(**options)", "unknown 'foo'", lambda t, b: module(foo=1), Raises(TypeError, "foo: not an option")),
        ("PackedCrossEntropyLoss(**options)", "a fused-only option", lambda t, b: module(chunk_size=3), Raises(TypeError, "chunk_size: not an option")),
        ("PackedCrossEntropyLoss(**options)", "cu_seqlens as an option", lambda t, b: module(cu_seqlens=t["cu"]), Raises(TypeError, "cu_seqlens: a per-call tensor")),
        ("PackedCrossEntropyLoss(**options)", "label_smoothing=2", lambda t, b: module(label_smoothing=2), Raises(ValueError, "label_smoothing must be in")),
        ("PackedCrossEntropyLoss.forward", "num_items_in_batch=-1", lambda t, b: module(backend=b)(t["logits"], t["labels"], num_items_in_batch=-1), Raises(ValueError, "num_items_in_batch must be >= 0")),
        ("PackedCrossEntropyLoss.forward", "labels (N-1,)", lambda t, b: module(backend=b)(t["logits"], t["labels"][:-1]), Raises(ValueError, "labels must have shape")),
        ("PackedCrossEntropyLoss.forward", "positional cu_seqlens, is_packed", lambda t, b: module(backend=b, is_packed=True)(t["logits"], t["labels"], t["cu"]), Equals(lambda t: _packed_mean(t["logits"], t["labels"], [0, 2, 6]))),
        ("FusedLinearPackedCrossEntropyLoss(**options)", "bias as an option", lambda t, b: fused_module(bias=t["bias"]), Raises(TypeError, "bias: a per-call tensor")),
        ("FusedLinearPackedCrossEntropyLoss(**options)", "chunk_size=-2", lambda t, b: fused_module(chunk_size=-2), Raises(ValueError, "chunk_size must be None or a positive int")),
        ("FusedLinearPackedCrossEntropyLoss.forward", "bias (3,)", lambda t, b: fused_module(backend=b)(t["hidden"], t["weight"], t["labels"], bias=t["bias"][:3]), Raises(ValueError, r"bias must be \(V,\)")),
        ("FusedLinearPackedCrossEntropyLoss.forward", "weight on meta", lambda t, b: fused_module(backend=b)(t["hidden"], t["weight"].to("meta"), t["labels"]), Raises(ValueError, "weight is on meta")),
    ]


def _rows_objects():
    """(argument, bad input, call, outcome): the option objects and count_normaliser."""
    return [
        ("LossOptions", "label_smoothing=nan", lambda t: LossOptions(label_smoothing=NAN), Raises(ValueError, "label_smoothing must be finite")),
        ("LossOptions", "reduction='avg'", lambda t: LossOptions(reduction="avg"), Raises(ValueError, "reduction must be one of")),
        ("LossOptions", "is_packed='yes'", lambda t: LossOptions(is_packed="yes"), Raises(TypeError, "is_packed must be True or False")),
        ("LossOptions", "ignore_index=True", lambda t: LossOptions(ignore_index=True), Raises(TypeError, "ignore_index must be an int")),
        ("LossOptions", "softcap=-inf", lambda t: LossOptions(softcap=-INF), Raises(ValueError, "softcap must be finite")),
        ("LossOptions", "z_loss_scale=None", lambda t: LossOptions(z_loss_scale=None), Raises(TypeError, "z_loss_scale must be a real number")),
        ("LossOptions", "backend=None", lambda t: LossOptions(backend=None), Raises(ValueError, "backend must be")),
        ("ChunkOptions", "grad_accumulation_dtype=float", lambda t: ChunkOptions(grad_accumulation_dtype=float), Raises(TypeError, "grad_accumulation_dtype must be None or a floating")),
        ("ChunkOptions", "chunk_size=0", lambda t: ChunkOptions(chunk_size=0), Raises(ValueError, "chunk_size must be None or a positive int")),
        ("ChunkOptions", "chunk_size=True", lambda t: ChunkOptions(chunk_size=True), Raises(ValueError, "chunk_size must be None or a positive int")),
        ("ChunkOptions", "drop_ignored_rows=1", lambda t: ChunkOptions(drop_ignored_rows=1), Raises(TypeError, "drop_ignored_rows must be None, True or False")),
        ("count_normaliser", "labels a list", lambda t: count_normaliser(t["labels"].tolist()), Raises(TypeError, "labels must be a torch.Tensor")),
        ("count_normaliser", "labels float", lambda t: count_normaliser(t["labels"].float()), Raises(TypeError, "labels must be an integer tensor")),
        ("count_normaliser", "options a dict", lambda t: count_normaliser(t["labels"], options={"is_packed": True}), Raises(TypeError, "options must be a LossOptions")),
        ("count_normaliser", "cu_seqlens float", lambda t: count_normaliser(t["labels"], cu_seqlens=t["cu"].float()), Raises(TypeError, "cu_seqlens must be int32 or int64")),
        ("count_normaliser", "cu_seqlens and position_ids", lambda t: count_normaliser(t["labels"], cu_seqlens=t["cu"], position_ids=torch.arange(N)), Raises(ValueError, "not both")),
        ("count_normaliser", "position_ids N+1", lambda t: count_normaliser(t["labels"], position_ids=torch.arange(N + 1)), Raises(ValueError, "position_ids must have one entry per token")),
        ("count_normaliser", "cu_seqlens on another device (meta)", lambda t: count_normaliser(t["labels"], cu_seqlens=t["cu"].to("meta")), Raises(ValueError, "cu_seqlens is on meta")),
        ("count_normaliser", "is_packed without boundaries", lambda t: count_normaliser(t["labels"], options=LossOptions(is_packed=True)), Raises(ValueError, "is_packed=True needs")),
        ("count_normaliser", "malformed cu_seqlens [0, 4, 2, 9] (unchecked)", lambda t: count_normaliser(t["labels"], cu_seqlens=torch.tensor([0, 4, 2, 9]), options=LossOptions(is_packed=True)), Runs(())),
        ("count_normaliser", "all labels ignored", lambda t: count_normaliser(torch.full((N,), -100)), Equals(lambda t: torch.tensor(0))),
    ]




def _check(outcome, call: Callable[[], object], backend: str | None = None) -> None:
    """Runs ``call`` and asserts the row's outcome (its ``backend``'s, where they differ)."""
    outcome = outcome[backend] if isinstance(outcome, dict) else outcome
    if isinstance(outcome, Raises):
        with pytest.raises(outcome.error, match=outcome.match):
            call()
            packed_ce.check_pending()  # a value checked on the device raises here
        return
    actual = call()
    packed_ce.check_pending()  # nothing wrong was found on the device either
    if isinstance(outcome, OnMeta):
        assert actual.device.type == "meta" and tuple(actual.shape) == outcome.shape
        return
    if isinstance(outcome, Runs):
        assert tuple(actual.shape) == outcome.shape
        return
    expected = outcome.expected(_tensors())  # fresh tensors: a row may have written into its own
    assert actual.shape == expected.shape
    if expected.dtype.is_floating_point:
        # float32 arithmetic (both backends) against float64: a few float32 ulps per term
        torch.testing.assert_close(actual.double(), expected.double(), rtol=2e-5, atol=1e-6, equal_nan=True)
    else:
        assert torch.equal(actual, expected)


def _ids(rows):
    return [f"{argument}: {bad}" for argument, bad, *_ in rows]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", _rows_cross_entropy(), ids=_ids(_rows_cross_entropy()))
def test_cross_entropy(row, backend):
    _, _, change, outcome = row
    _check(outcome, lambda: _call_cross_entropy(change(_tensors()), backend), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", _rows_fused(), ids=_ids(_rows_fused()))
def test_fused_linear_cross_entropy(row, backend):
    _, _, change, outcome = row
    _check(outcome, lambda: _call_fused(change(_tensors()), backend), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row", _rows_modules(), ids=_ids(_rows_modules()))
def test_modules(row, backend):
    _, _, call, outcome = row
    _check(outcome, lambda: call(_tensors(), backend), backend)


@pytest.mark.parametrize("row", _rows_objects(), ids=_ids(_rows_objects()))
def test_options_and_count_normaliser(row):
    _, _, call, outcome = row
    _check(outcome, lambda: call(_tensors()))


@pytest.mark.parametrize(
    "backend,outcome",
    [
        pytest.param("torch", OnMeta(()), id="torch: shape inference"),
        pytest.param("triton", Raises(ValueError, "backend='triton' needs CUDA tensors"), id="triton: refused"),
    ],
)
def test_every_tensor_on_meta(backend, outcome):
    """All tensors on one device without data: the reference infers the shape, the kernel (which
    needs CUDA or interpreted CPU tensors) refuses by name."""
    t = {name: value.to("meta") for name, value in _tensors().items()}
    _check(outcome, lambda: _call_cross_entropy(t, backend))
