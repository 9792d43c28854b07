"""Integrations of the packed loss with training libraries.

- :func:`apply_packed_loss` / :func:`remove_packed_loss`: a transformers causal LM returns the
  packing-aware loss from ``model(**batch)``, optionally through the fused linear cross entropy;
- :class:`PackedTrainer`: the transformers Trainer, exact with gradient accumulation and data
  parallelism (imported on first use: ``transformers.Trainer`` takes seconds to import);
- :func:`count_num_items`: the normaliser of one optimiser step, for custom training loops.
"""

from .transformers import (
    PackedCausalLMLoss,
    apply_packed_loss,
    count_num_items,
    packed_loss_of,
    remove_packed_loss,
    sequence_boundaries,
)

__all__ = [
    "PackedCausalLMLoss",
    "PackedTrainer",
    "apply_packed_loss",
    "count_num_items",
    "packed_loss_of",
    "remove_packed_loss",
    "sequence_boundaries",
]


def __getattr__(name: str):
    if name == "PackedTrainer":
        from .trainer import PackedTrainer

        return PackedTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
