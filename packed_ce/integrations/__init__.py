"""Integrations of the packed loss with training libraries.

- :func:`apply_packed_loss` / :func:`remove_packed_loss`: ``model(**batch)`` returns the packed
  loss (optionally fused), every call kept exact;
- :class:`PackedTrainer`, :class:`PackedSFTTrainer`: transformers' and trl's trainers, exact under
  accumulation and parallelism (imported on first use: seconds);
- :func:`enable_context_parallel` / :func:`disable_context_parallel`: ranks sharing each row;
- :func:`count_num_items`: the normaliser of one optimiser step, for custom training loops;
- :func:`tiny_causal_lm`, :func:`tiny_vision_lm`: tiny random models, for examples and tests on
  CPU.
"""

from .context_parallel import disable_context_parallel, enable_context_parallel
from .model.batch import count_num_items, next_token_targets, sequence_boundaries
from .model.forward import fusable_reason
from .model.install import apply_packed_loss, remove_packed_loss
from .model.installation import packed_loss_of
from .model.loss import PackedCausalLMLoss
from .model.tiny import tiny_causal_lm, tiny_vision_lm

__all__ = [
    "PackedCausalLMLoss",
    "PackedSFTTrainer",
    "PackedTrainer",
    "apply_packed_loss",
    "count_num_items",
    "disable_context_parallel",
    "enable_context_parallel",
    "fusable_reason",
    "next_token_targets",
    "packed_loss_of",
    "remove_packed_loss",
    "sequence_boundaries",
    "tiny_causal_lm",
    "tiny_vision_lm",
]


def __getattr__(name: str):
    if name == "PackedTrainer":
        from .trainers.transformers_trainer import PackedTrainer

        return PackedTrainer
    if name == "PackedSFTTrainer":
        from .trainers.trl_trainer import PackedSFTTrainer

        return PackedSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
