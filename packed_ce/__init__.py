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

import importlib

# Each public name -> the module defining it, imported on first use: ``import collators`` (which
# reads the batch contract, packed_ce.columns) loads none of the loss, the kernels or triton.
_PUBLIC = {
    "cross_entropy": "logits_loss",
    "PackedCrossEntropyLoss": "logits_loss",
    "fused_linear_cross_entropy": "fused_linear",
    "FusedLinearPackedCrossEntropyLoss": "fused_linear",
    "LossOptions": "options",
    "ChunkOptions": "options",
    "count_normaliser": "targets",
    "TokenStats": "stats",
    "SequenceLosses": "stats",
    "check_pending": "pending",
}
__all__ = list(_PUBLIC)
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # later lookups find it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
