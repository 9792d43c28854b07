"""The packed loss as a transformers causal-LM loss function: :class:`PackedCausalLMLoss`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from collators.columns import CU_SEQLENS

from ..cross_entropy import cross_entropy_call
from ..options import Boundaries, LossOptions, changed_fields
from ..stats import SequenceLosses, TokenStats
from ..validation import checked_boundaries
from .batch import sequence_boundaries
from .guards import BOUNDARIES_KEY

# With this keyword set to True in a model call, the packed loss (on the logits, or the fused
# forward's) also computes the targets' TokenStats in its own pass and keeps them on the model's
# PackedCausalLMLoss for PackedCausalLMLoss.take_token_stats(). Like BOUNDARIES_KEY it also
# reaches the attention functions, which ignore keywords they do not know.
TOKEN_STATS_KEY = "packed_ce_token_stats"
# The same for the call's SequenceLosses (PackedCausalLMLoss.take_seq_losses()): each sequence's
# share of the loss and of the weight, for a loss per data source.
SEQ_LOSSES_KEY = "packed_ce_seq_losses"


class PackedCausalLMLoss:
    """A transformers causal-LM loss function backed by :func:`packed_ce.cross_entropy`.

    Called like transformers' ``ForCausalLMLoss``: ``labels`` are aligned with ``input_ids`` and
    shifted inside (``shift=True``), never across a sequence boundary; a ``shift_labels`` keyword
    (already shifted labels, as some padding-free collators emit) is used as is. The reduction is
    "mean": with ``is_packed=True`` the mean over sequences of each sequence's mean token loss,
    with ``is_packed=False`` the mean over target tokens (what ``ForCausalLMLoss`` computes), each
    divided by ``num_items_in_batch`` instead when the caller gives it.

    ``final_logit_softcapping`` is not applied here: the models that have it (Gemma 2 and later)
    cap the logits in ``forward`` before calling the loss. The fused forward of
    :func:`apply_packed_loss`, which sees hidden states, applies it.

    Args:
        is_packed: average per sequence (True) or per token (False).
        ignore_index: label value that is not a target.
        label_smoothing: ``eps`` of :func:`packed_ce.cross_entropy`.
        z_loss_scale: weight of ``logsumexp**2`` in each token's loss.
        inplace_backward: let the backward overwrite the returned ``outputs.logits`` with their
            gradient (saves one ``(N, V)`` buffer; only when nothing reads the logits after the
            backward, and not with a model that soft-caps its logits, whose ``tanh`` backward
            reads them).
        backend: "auto", "triton" or "torch", as in :func:`packed_ce.cross_entropy`.
        validate: check labels and boundaries (on CUDA on the device, without a host sync: see
            :func:`packed_ce.check_pending`).

    A call with the keyword ``packed_ce_token_stats=True`` (:data:`TOKEN_STATS_KEY`, passed to
    ``model(...)``, which hands its extra keywords to the loss) also computes the
    :class:`packed_ce.TokenStats` of its targets in the loss's own pass over the logits and
    keeps them for :meth:`take_token_stats`; ``packed_ce_seq_losses=True``
    (:data:`SEQ_LOSSES_KEY`) keeps the call's :class:`packed_ce.SequenceLosses` for
    :meth:`take_seq_losses`; so does the fused forward of :func:`apply_packed_loss`. They live on
    this object, which the model holds, so they are found the same way under DDP, FSDP or PEFT
    wrappers.

    Example:
        >>> loss_fn = PackedCausalLMLoss(is_packed=True)
        >>> logits = torch.zeros(1, 5, 4)                   # uniform: every token loss is log 4
        >>> labels = torch.tensor([[-100, 1, 2, -100, 3]])  # two sequences: tokens 0-2 and 3-4
        >>> loss_fn(logits, labels, 4, cu_seqlens=torch.tensor([0, 3, 5], dtype=torch.int32))
        tensor(1.3863)
    """

    def __init__(
        self,
        *,
        is_packed: bool = True,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
        z_loss_scale: float = 0.0,
        inplace_backward: bool = False,
        backend: str = "auto",
        validate: bool = True,
    ):
        # checked once here; the shift and the extra outputs are set per call
        self.options = LossOptions(
            is_packed=is_packed,
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss_scale=z_loss_scale,
            inplace_backward=inplace_backward,
            backend=backend,
            validate=validate,
        )
        self.token_stats: TokenStats | None = None
        self.seq_losses: SequenceLosses | None = None

    @property
    def is_packed(self) -> bool:
        return self.options.is_packed

    @property
    def ignore_index(self) -> int:
        return self.options.ignore_index

    def take_token_stats(self) -> TokenStats | None:
        """The stats of the last call made with :data:`TOKEN_STATS_KEY`, once; then None."""
        stats, self.token_stats = self.token_stats, None
        return stats

    def take_seq_losses(self) -> SequenceLosses | None:
        """The per-sequence losses of the last call made with :data:`SEQ_LOSSES_KEY`, once."""
        losses, self.seq_losses = self.seq_losses, None
        return losses

    def keep_metrics(self, result, want_stats: bool, want_seq: bool) -> torch.Tensor:
        """The loss of a loss call's ``result``; its extra outputs kept for ``take_*``."""
        if not (want_stats or want_seq):
            return result
        loss, *extra = result
        if want_stats:
            self.token_stats = extra.pop(0)
        if want_seq:
            self.seq_losses = extra.pop(0)
        return loss

    def loss_inputs(
        self,
        labels: torch.Tensor,
        device: torch.device,
        shift_labels: torch.Tensor | None,
        num_items_in_batch: int | torch.Tensor | None,
        kwargs: Mapping[str, Any],
        **changes,
    ) -> tuple[torch.Tensor, Boundaries, LossOptions]:
        """Targets, boundaries and options of the packed loss for one model call.

        Returns:
            ``(targets, boundaries, options)``: ``labels`` (or ``shift_labels``) on ``device``, the
            boundaries read from ``kwargs`` (:func:`sequence_boundaries`), type-checked unless
            the installed forward's guard checked them, and this loss's options with ``shift``
            and ``changes``.
        """
        shift = shift_labels is None
        targets = (labels if shift else shift_labels).to(device)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(device)
        found = sequence_boundaries(targets, kwargs, is_packed=self.is_packed)
        checked = kwargs.get(CU_SEQLENS) is None and kwargs.get(BOUNDARIES_KEY) is not None
        boundaries = (Boundaries if checked else checked_boundaries)(
            num_items_in_batch=num_items_in_batch, **found
        )
        return targets, boundaries, dataclasses.replace(self.options, shift=shift, **changes)

    def __call__(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """The loss of one forward pass.

        Args:
            logits: ``(B, T, V)`` float32/bfloat16/float16, already soft-capped by the model.
            labels: ``(B, T)`` aligned with ``input_ids``; ``ignore_index`` where not trained.
            vocab_size: unused (``V`` is read from ``logits``); part of transformers' call.
            num_items_in_batch: the normaliser of the whole optimiser step (see
                :func:`count_num_items`); the local count when None.
            shift_labels: ``(B, T)`` labels already shifted (target of ``logits[t]``), or None.
            **kwargs: the model call's extra keywords, read for ``cu_seqlens``,
                ``cu_seq_lens_q``, ``position_ids``, ``packed_ce_boundaries``,
                ``packed_ce_token_stats`` and ``packed_ce_seq_losses``;
                the rest is ignored.

        Returns:
            0-d float32 loss.
        """
        want_stats, want_seq = bool(kwargs.get(TOKEN_STATS_KEY)), bool(kwargs.get(SEQ_LOSSES_KEY))
        targets, boundaries, options = self.loss_inputs(
            labels, logits.device, shift_labels, num_items_in_batch, kwargs,
            return_token_stats=want_stats, return_seq_losses=want_seq,
        )
        result = cross_entropy_call(logits, targets, boundaries, options)
        return self.keep_metrics(result, want_stats, want_seq)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({changed_fields(self.options)})"
