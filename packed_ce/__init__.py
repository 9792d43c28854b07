"""packed-ce: cross entropy that averages per packed sequence, exactly and at fused-kernel speed.

The public surface:
- :func:`cross_entropy` and :class:`PackedCrossEntropyLoss`: the loss on logits.
- :func:`fused_linear_cross_entropy` and :class:`FusedLinearPackedCrossEntropyLoss`: the LM head
  and the loss together, never materialising the ``(N, V)`` logits.
- :class:`LossOptions` and :class:`ChunkOptions`: the options of both, as one checked object
  (the functions also take them as keywords).
- :func:`count_normaliser`: what "mean" divides by, for counting a whole optimiser step.
- :class:`TokenStats`, :class:`SequenceLosses`: metrics from the loss's own pass.
- :func:`check_pending`: raises the error of a bad value an earlier call checked on the device.
- :mod:`packed_ce.integrations`: the loss inside transformers models and the Trainer.
"""

from .cross_entropy import PackedCrossEntropyLoss, cross_entropy
from .fused_linear import FusedLinearPackedCrossEntropyLoss, fused_linear_cross_entropy
from .options import ChunkOptions, LossOptions
from .pending import check_pending
from .stats import SequenceLosses, TokenStats
from .targets import count_normaliser

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
