"""packed-ce: cross entropy that averages per packed sequence, exactly and at fused-kernel speed.

The public surface:
- :func:`cross_entropy` and :class:`PackedCrossEntropyLoss`: the loss on logits.
- :func:`fused_linear_cross_entropy` and :class:`FusedLinearPackedCrossEntropyLoss`: the LM head
  and the loss together, never materialising the ``(N, V)`` logits.
- :class:`LossOptions` and :class:`ChunkOptions`: the options of both, as one checked object
  (the functions also take them as keywords).
- :func:`count_normaliser`: what "mean" divides by, for counting a whole optimiser step.
- :class:`TokenStats`: entropy and top-1 sums over the targets, returned by either loss with
  ``return_token_stats=True`` from its own read of the logits (for logging).
- :class:`SequenceLosses`: each sequence's share of the loss and of the weight, returned with
  ``return_seq_losses=True`` (a loss per data source, from the loss's own pass).
- :func:`check_pending`: raises the error of a bad label or ``cu_seqlens`` given to an earlier
  call on CUDA, whose check ran on the device (call it before ``optimizer.step()``).
- :mod:`packed_ce.integrations`: the loss inside transformers models and the Trainer.
"""

from .cross_entropy import PackedCrossEntropyLoss, cross_entropy
from .fused_linear import FusedLinearPackedCrossEntropyLoss, fused_linear_cross_entropy
from .options import ChunkOptions, LossOptions
from .stats import SequenceLosses, TokenStats
from .targets import count_normaliser
from .pending import check_pending

__all__ = [
    "cross_entropy",
    "PackedCrossEntropyLoss",
    "fused_linear_cross_entropy",
    "FusedLinearPackedCrossEntropyLoss",
    "LossOptions",
    "ChunkOptions",
    "count_normaliser",
    "TokenStats",
    "SequenceLosses",
    "check_pending",
]
__version__ = "0.1.0"
