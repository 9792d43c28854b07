"""Integrations of the packed loss with training libraries.

- :func:`apply_packed_loss` / :func:`remove_packed_loss`: a transformers causal LM (or a PEFT
  model of one) returns the packing-aware loss from ``model(**batch)``, optionally through the
  fused linear cross entropy (:func:`fusable_reason` says why a head cannot be fused);
  packed batches stay exact whatever the call (no KV cache, no all-ones ``attention_mask``), and
  a trainer that would normalise it by a token count is refused;
- :class:`PackedTrainer`: the transformers Trainer, exact with gradient accumulation and data
  parallelism; :class:`PackedSFTTrainer`: the same for trl's SFTTrainer (both imported on first
  use: ``transformers.Trainer`` and ``trl`` take seconds to import; trl is the ``packed-ce[trl]``
  extra);
- :func:`enable_context_parallel` / :func:`disable_context_parallel`: each rank of a process group
  attends over the whole packed row that :func:`collators.shard_batch` cut up, within each
  conversation, so the ranks' loss shares and gradients add up to one process's;
- :func:`count_num_items`: the normaliser of one optimiser step, for custom training loops;
- :func:`tiny_causal_lm`: a tiny random model, for examples and tests on CPU.
"""

from .batch import count_num_items, next_token_targets, sequence_boundaries
from .context_parallel import disable_context_parallel, enable_context_parallel
from .forward import fusable_reason
from .installation import packed_loss_of
from .loss import PackedCausalLMLoss
from .tiny import tiny_causal_lm
from .transformers import apply_packed_loss, remove_packed_loss

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
]


def __getattr__(name: str):
    if name == "PackedTrainer":
        from .trainer import PackedTrainer

        return PackedTrainer
    if name == "PackedSFTTrainer":
        from .sft_trainer import PackedSFTTrainer

        return PackedSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
