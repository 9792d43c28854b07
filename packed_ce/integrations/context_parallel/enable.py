"""Enabling context parallelism on a model, and the checks of every call it then takes.

The state lives on the model (``model._packed_ce_context_parallel``, found through DDP and PEFT
wrappers); nothing is registered per process but the stateless attention function. A call's
shard says what it is (:class:`collators.sharding.ShardRecord`); before any large collective one
small all-gather shows every rank what each holds, so that a mismatch raises the same
``ValueError`` on every rank instead of aborting gloo or hanging NCCL.

The normaliser: ``num_items_in_batch`` is summed over all processes with each rank counting the
whole batch it shards (``count_num_items(batch)``, the default), so the ``W`` ranks of a group count
its row ``W`` times; the forward divides it by ``W``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from packed_ce.columns import (
    CU_SEQLENS,
    INPUT_IDS,
    LABELS,
    POSITION_IDS,
    ROW_LAYOUT,
    SEQ_TARGETS,
    SEQ_WEIGHTS,
    SHARD,
    SHIFT_LABELS,
)

from ...options import LossOptions
from ...targets import count_normaliser
from ..model.families import EXACT_LAYER_TYPES
from ..model.installation import CONTEXT_PARALLEL, base_model, installation_of
from ..model.mixers import mixers_of
from ..model.rotary import batch_dependent
from . import state
from .attention import ATTENTION_NAME, attention
from .layout import RowLayout


@dataclass
class ContextParallel:
    """What :func:`enable_context_parallel` installed on a model, to use and to undo.

    Attributes:
        group, rank, world_size: the ranks sharing each row (group None: the default group).
        previous_attention: ``config._attn_implementation`` before (None for one rank: unchanged).
        checked: whether a call showed every attention module going through the
            context-parallel attention (:meth:`finish`).
    """

    group: object
    rank: int
    world_size: int
    previous_attention: str | None = None
    checked: bool = False  # the first call's attention went through the interface

    def prepare(self, model: nn.Module, kwargs: dict) -> dict:
        """The keywords of a call of ``model`` (the packed forward's), checked: every rank's
        shard, row and normaliser are compared in one small all-gather (each mismatch the same
        ``ValueError`` on every rank), the row is laid out (:class:`RowLayout`, under
        :data:`ROW_LAYOUT`) and ``num_items_in_batch`` divided by ``W``.

        Args:
            model: the transformers model the packed forward runs (not a wrapper).
            kwargs: the call's keywords.

        Returns:
            The keywords for the rest of the forward (a new dict, the shard record removed).
        """
        record = kwargs.get(SHARD)
        kwargs = {key: value for key, value in kwargs.items() if key != SHARD}
        world = self.world_size
        if self.previous_attention is None:  # one rank: the model's own attention
            if record is not None and (record.world_size, record.rank) != (1, 0):
                raise ValueError(
                    f"the shard was cut for rank {record.rank} of {record.world_size}, but this "
                    "context-parallel group has one rank: shard with "
                    "collators.shard_batch(batch, 0, 1)"
                )
            return kwargs
        options = dataclasses.replace(installation_of(model).loss.options, shift=False)
        _check_facts(_gather_facts(self, record, kwargs, options), world)
        position_ids = kwargs[POSITION_IDS]
        kwargs[ROW_LAYOUT] = RowLayout.gather(
            self.group, self.rank, world, position_ids, record.chunks, state.streamed_mixer
        )
        if kwargs.get(LABELS) is not None:
            count = torch.as_tensor(kwargs["num_items_in_batch"], device=position_ids.device)
            kwargs["num_items_in_batch"] = count.to(torch.float64) / world
        return kwargs

    def finish(self, model: nn.Module, kwargs: dict) -> None:
        """After the first context-parallel call of ``model``: every attention module (one with
        ``is_causal``, transformers' attention contract) went through the context-parallel
        attention. A family whose attention calls its own function sees this rank's shard only;
        every rank computes the same modules, so every rank raises the same error.

        Raises:
            ValueError: naming the attention modules that bypassed the attention interface.
        """
        layout = kwargs.get(ROW_LAYOUT)
        if self.checked or layout is None:
            return
        bypassed = sorted(
            {
                type(module).__name__
                for module in model.modules()
                if hasattr(module, "is_causal") and module not in layout.reached
            }
        )
        if bypassed:
            raise ValueError(
                f"{type(model).__name__}'s attention {bypassed} does not go through transformers' "
                "attention interface, so context parallelism cannot replace it: each rank would "
                "attend over its own shard only"
            )
        self.checked = True


def context_parallel_of(model: nn.Module) -> ContextParallel | None:
    """What :func:`enable_context_parallel` installed on ``model`` (or the model it wraps)."""
    return getattr(base_model(model), CONTEXT_PARALLEL, None)


def _refusal(model: nn.Module) -> str | None:
    """Why context parallelism cannot be enabled on ``model`` exactly, or None."""
    name = type(model).__name__
    if installation_of(model) is None:
        return (
            f"enable_context_parallel needs the packed loss on this {name} first: call "
            "apply_packed_loss(model) (its forward checks every shard and its normaliser)"
        )
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    other = sorted(set(getattr(config, "layer_types", None) or ()) - EXACT_LAYER_TYPES)
    if other and not mixers_of(model):  # a mixer's layers gather their inputs (mixers.py)
        return (
            f"{name} has layers of type {other}: context parallelism reproduces full and "
            "sliding-window causal attention within each conversation, and the token mixers of "
            "families.MIXERS, only"
        )
    if getattr(config, "use_bidirectional_attention", False):
        return f"{name} uses bidirectional attention: context parallelism is causal"
    rotary = next((m for m in model.modules() if batch_dependent(m)), None)
    if rotary is not None:
        return (
            f"{name}'s rotary embedding (rope_type={rotary.rope_type!r}) chooses its frequencies "
            "from the longest position of the call, which each rank's shard would choose for "
            "itself: context parallelism supports rope types that do not depend on the call"
        )
    return None


def enable_context_parallel(model: nn.Module, group=None) -> nn.Module:
    """Makes each rank of ``group`` attend over the whole packed row, within each conversation.

    On rank ``r`` of ``W``,
    ``model(**collators.shard_batch(batch, r, W), num_items_in_batch=n).loss`` with
    ``n = count_num_items(batch)`` (summed over all processes, each rank counting the batch it
    shards) is rank ``r``'s share of the one-process loss; the shares and the gradients summed over
    the ranks are the one-process ones. Sliding windows, attention softcaps and sinks are exact.
    Works with the packed loss on the logits or fused, PEFT and gradient checkpointing (several
    forwards before a backward included).

    Args:
        model: a transformers causal LM (or a PEFT model of one) with the packed loss
            (:func:`apply_packed_loss`), whose attention goes through transformers' attention
            interface.
        group: the process group whose ranks share each row (default: the world). A group of one
            rank leaves the attention as it is.

    Returns:
        ``model``, changed in place (:func:`disable_context_parallel` undoes it).

    Raises:
        ValueError: without an initialised process group, without the packed loss, for a model
            whose attention cannot be reproduced exactly, or if it is already enabled on it.
    """
    target = base_model(model)
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "enable_context_parallel needs torch.distributed initialised: call "
            "torch.distributed.init_process_group (torchrun sets up the environment)"
        )
    if getattr(target, CONTEXT_PARALLEL, None) is not None:
        raise ValueError("context parallelism is already enabled on this model")
    reason = _refusal(target)
    if reason is not None:
        raise ValueError(reason)
    state = ContextParallel(group, dist.get_rank(group), dist.get_world_size(group))
    if state.world_size > 1:
        stream_attention(target, state)
    setattr(target, CONTEXT_PARALLEL, state)
    return model


def stream_attention(target: nn.Module, state: ContextParallel) -> None:
    """Gives ``target`` (the base model) the context-parallel attention, its own restored by
    :func:`disable_context_parallel`. :func:`enable_context_parallel` does it for two ranks or
    more; ``benchmarks/bench_context_parallel_memory.py`` for one rank too (the streamed path
    through a ring of one, against which the ranks' memory is measured).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, attention)  # stateless: once per process
    state.previous_attention = target.config._attn_implementation
    target.set_attn_implementation(ATTENTION_NAME)


def disable_context_parallel(model: nn.Module) -> nn.Module:
    """Undoes :func:`enable_context_parallel`: the model's attention is its own again.

    Raises:
        ValueError: if context parallelism is not enabled on ``model``.
    """
    target = base_model(model)
    state = getattr(target, CONTEXT_PARALLEL, None)
    if state is None:
        raise ValueError(f"context parallelism is not enabled on this {type(model).__name__}")
    if state.previous_attention is not None:
        target.set_attn_implementation(state.previous_attention)
    delattr(target, CONTEXT_PARALLEL)
    return model


# What a rank's call may lack, gathered so that every rank raises the same error.
_OK, _NOT_A_SHARD, _BAD_POSITIONS, _NO_SHIFT_LABELS, _NO_NUM_ITEMS = range(5)


class _Facts(NamedTuple):
    """What one rank holds, as the all-gather carries it (six int64, then two float64)."""

    problem: int
    length: int  # L, the local tokens
    shard_world: int
    shard_rank: int
    checksum: int
    labels: int  # 1 for a call with labels
    mass: float  # the local share of the row's normaliser
    count: float  # num_items_in_batch as given


_COLUMNS = len(_Facts._fields)


def _gather_facts(
    state: ContextParallel, record, kwargs: dict, options: LossOptions
) -> list[_Facts]:
    """What each rank of the group holds, the same list on every rank."""
    position_ids, labels = kwargs.get(POSITION_IDS), kwargs.get(LABELS)
    tokens = kwargs.get(INPUT_IDS)
    reference = position_ids if position_ids is not None else tokens
    device = reference.device if reference is not None else torch.device("cpu")
    length = position_ids.shape[-1] if position_ids is not None else 0
    count = kwargs.get("num_items_in_batch")
    problem = _OK
    if record is None:
        problem = _NOT_A_SHARD
    elif (
        position_ids is None
        or position_ids.dim() != 2
        or length * record.world_size != record.row_length
    ):
        problem = _BAD_POSITIONS
    elif labels is not None and kwargs.get(SHIFT_LABELS) is None:
        problem = _NO_SHIFT_LABELS
    elif labels is not None and count is None:
        problem = _NO_NUM_ITEMS
    mass = torch.zeros((), dtype=torch.float64, device=device)
    if problem == _OK and labels is not None:
        mass = count_normaliser(
            kwargs[SHIFT_LABELS],
            cu_seqlens=kwargs.get(CU_SEQLENS),
            seq_targets=kwargs.get(SEQ_TARGETS),
            seq_weights=kwargs.get(SEQ_WEIGHTS),
            options=options,
        ).to(device=device, dtype=torch.float64)
    given = torch.as_tensor(0 if count is None else count, device=device).to(torch.float64)
    integers = [
        problem,
        length,
        *((0, 0, 0) if record is None else (record.world_size, record.rank, record.row_checksum)),
        labels is not None,
    ]
    mine = torch.cat(
        (
            torch.tensor(integers, dtype=torch.int64, device=device),
            torch.stack((mass, given)).view(torch.int64),  # float64 bits, exact through the gather
        )
    )
    table = mine.new_empty(state.world_size * _COLUMNS)
    dist.all_gather_into_tensor(table, mine, group=state.group)
    table = table.reshape(state.world_size, _COLUMNS).cpu()
    floats = table[:, 6:].contiguous().view(torch.float64)
    return [_Facts(*ints, *reals) for ints, reals in zip(table[:, :6].tolist(), floats.tolist())]


def _check_facts(table: list[_Facts], world: int) -> None:
    """Raises the first problem of any rank: the same error on every rank."""
    for rank, facts in enumerate(table):
        problem = facts.problem
        if problem == _NOT_A_SHARD:
            raise ValueError(
                f"context parallelism is enabled on this model for {world} ranks, but rank {rank} "
                "called it with a batch that is not a shard: pass collators.shard_batch(batch, "
                f"rank, {world}) of the whole batch on every rank (or disable_context_parallel)"
            )
        if problem == _BAD_POSITIONS:
            raise ValueError(
                f"rank {rank}: a context-parallel call needs the position_ids of "
                "collators.shard_batch, of shape (1, T / W): they find the conversations of the row"
            )
        if problem == _NO_SHIFT_LABELS:
            raise ValueError(
                f"rank {rank} called the model with labels but without shift_labels: pass the "
                "shard as collators.shard_batch returns it (its shift_labels keep the target of "
                "each chunk's last token)"
            )
        if problem == _NO_NUM_ITEMS:
            raise ValueError(
                f"rank {rank} called the model with labels but without num_items_in_batch: each "
                "rank's loss is its share of the row's, so pass num_items_in_batch="
                "count_num_items(batch) of the whole batch (summed over all processes, the default)"
            )
    for rank, facts in enumerate(table):
        if facts.shard_world != world or facts.shard_rank != rank:
            raise ValueError(
                f"rank {rank} of the context-parallel group holds the shard cut for rank "
                f"{facts.shard_rank} of {facts.shard_world}: shard with collators.shard_batch("
                f"batch, torch.distributed.get_rank(group), {world})"
            )
    lengths = [facts.length for facts in table]
    if len(set(lengths)) > 1:
        raise ValueError(
            f"the ranks' shards have different lengths {lengths}: the ranks of a context-parallel "
            f"group must shard the same packed row (collate it with PackedCollator("
            f"pad_to_multiple_of=2 * {world}) and give every rank of the group the same batch)"
        )
    if len({facts.checksum for facts in table}) > 1:
        raise ValueError(
            "the ranks of the context-parallel group sharded different rows: every rank of a group "
            "must shard the same batch (a data-parallel sampler gives each rank its own: use one "
            "that gives the ranks of a group the same)"
        )
    mass = sum(facts.mass for facts in table)
    for rank, facts in enumerate(table):
        if facts.labels and facts.count < world * mass * (1 - 1e-9):
            raise ValueError(
                f"rank {rank} passed num_items_in_batch={facts.count:g}, less than {world} times "
                f"this row's own normaliser ({mass:g}): count it with count_num_items(batch) of "
                "the whole batch, summed over all processes (the default): each of the group's "
                f"{world} ranks counts the row it shards, and the model divides by {world}"
            )
