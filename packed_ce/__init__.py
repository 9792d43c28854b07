"""packed-ce: cross entropy that averages per packed sequence, exactly and at fused-kernel speed.

The public surface:
- :func:`cross_entropy` and :class:`PackedCrossEntropyLoss`
- :func:`fused_linear_cross_entropy` and :class:`FusedLinearPackedCrossEntropyLoss`
"""

from .cross_entropy import PackedCrossEntropyLoss, cross_entropy

__all__ = ["cross_entropy", "PackedCrossEntropyLoss"]
__version__ = "0.1.0"
