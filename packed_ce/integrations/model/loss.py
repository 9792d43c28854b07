"""The packed loss as a transformers causal-LM loss function: :class:`PackedCausalLMLoss`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ...columns import LAYOUT
from ...layout import loss_boundaries
from ...logits_loss import cross_entropy_call
from ...options import Boundaries, LossOptions, changed_fields
from ...stats import SequenceLosses, TokenStats
from ...validation import checked_boundaries

# Model-call keywords: keep the call's TokenStats / SequenceLosses for take_token_stats() /
# take_seq_losses() (attention functions ignore keywords they do not know).
TOKEN_STATS_KEY = "packed_ce_token_stats"
SEQ_LOSSES_KEY = "packed_ce_seq_losses"


class PackedCausalLMLoss:
    """A transformers causal-LM loss function backed by :func:`packed_ce.cross_entropy`.

    Called like transformers' ``ForCausalLMLoss``: ``labels`` aligned with ``input_ids`` are shifted
    inside, never across a sequence boundary (``shift_labels`` are used as they are). "mean": per
    sequence (``is_packed=True``) or per target token, or over ``num_items_in_batch`` when given.
    The models cap their logits (``final_logit_softcapping``) before calling it.

    Args:
        is_packed: average per sequence (True) or per token (False).
        ignore_index: label value that is not a target.
        label_smoothing: ``eps`` of :func:`packed_ce.cross_entropy`.
        z_loss_scale: weight of ``logsumexp**2`` in each token's loss.
        inplace_backward: the backward overwrites ``outputs.logits`` with their gradient (not
            with a soft-capping model, whose ``tanh`` backward reads them).
        backend, validate: as in :func:`packed_ce.cross_entropy`.

    ``model(..., packed_ce_token_stats=True)`` (:data:`TOKEN_STATS_KEY`) keeps the call's
    :class:`packed_ce.TokenStats` for :meth:`take_token_stats`, ``packed_ce_seq_losses=True`` its
    :class:`packed_ce.SequenceLosses` for :meth:`take_seq_losses`: on this object, found the same
    way under DDP, FSDP or PEFT wrappers.

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
        self.calls = 0  # calls of this loss function: the packed forward checks its model made one
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
            ``(targets, boundaries, options)``: the labels on ``device``, the boundaries of the
            call's layout (else of ``kwargs``, type-checked here), the options with ``shift`` and
            ``changes``.
        """
        shift = shift_labels is None
        targets = (labels if shift else shift_labels).to(device)
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(device)
        layout = kwargs.get(LAYOUT)  # the packed forward's, type-checked where it was built
        if layout is not None:
            boundaries = dataclasses.replace(
                layout.loss, num_items_in_batch=num_items_in_batch, **_on(device, layout.loss)
            )
        else:
            boundaries = checked_boundaries(
                num_items_in_batch=num_items_in_batch, **loss_boundaries(targets, kwargs).tensors()
            )
        if not self.is_packed:
            boundaries = dataclasses.replace(boundaries, seq_targets=None)
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
            num_items_in_batch: the step's normaliser (:func:`count_num_items`), or None.
            shift_labels: ``(B, T)`` labels already shifted, or None.
            **kwargs: the model call's extra keywords (boundaries, the keys above).

        Returns:
            0-d float32 loss.
        """
        self.calls += 1
        want_stats, want_seq = bool(kwargs.get(TOKEN_STATS_KEY)), bool(kwargs.get(SEQ_LOSSES_KEY))
        targets, boundaries, options = self.loss_inputs(
            labels,
            logits.device,
            shift_labels,
            num_items_in_batch,
            kwargs,
            return_token_stats=want_stats,
            return_seq_losses=want_seq,
        )
        result = cross_entropy_call(logits, targets, boundaries, options)
        return self.keep_metrics(result, want_stats, want_seq)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({changed_fields(self.options)})"


def _on(device: torch.device, boundaries: Boundaries) -> dict:
    """The tensors of ``boundaries`` moved to ``device`` (the logits', under model parallelism)."""
    return {key: value.to(device) for key, value in boundaries.tensors().items()}
