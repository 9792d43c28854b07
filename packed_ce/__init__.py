"""packed-ce: cross entropy that averages per packed sequence, exactly and at fused-kernel speed.

The public surface:
- :func:`cross_entropy` and :class:`PackedCrossEntropyLoss`: the loss on logits.
- :func:`fused_linear_cross_entropy` and :class:`FusedLinearPackedCrossEntropyLoss`: the LM head
  and the loss together, never materialising the ``(N, V)`` logits.
- :mod:`packed_ce.integrations`: the loss inside transformers models and the Trainer.
"""

from .cross_entropy import PackedCrossEntropyLoss, cross_entropy
from .fused_linear import FusedLinearPackedCrossEntropyLoss, fused_linear_cross_entropy

__all__ = [
    "cross_entropy",
    "PackedCrossEntropyLoss",
    "fused_linear_cross_entropy",
    "FusedLinearPackedCrossEntropyLoss",
]
__version__ = "0.1.0"
