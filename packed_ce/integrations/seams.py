"""Where packed-ce depends on trl and transformers beyond their public API, in one place.

The trainers override a private method or read a private attribute only where neither library
offers a public hook; :data:`PRIVATE_SEAMS` lists each place, checked against :data:`CHECKED`.
``tests/test_integration_guards.py`` fails when one of them is gone from the installed version
(an override of a method that is no longer called would silently do nothing) and when a guard
that refuses another objective stops firing:

- a ``transformers.Trainer`` other than the packed ones (trl's ``SFTTrainer`` included) refuses
  at ``train()`` a model with the packed loss (:class:`RefuseOtherTrainers`);
- a wrapper of the installed forward that runs the decoder itself (trl's ``fused_lm_head=True``)
  is refused by the decoder's pre-hook (:func:`refuse_bypass`);
- trl's ``fused_lm_head=True`` reaching the installed forward is refused (:func:`checked_call`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from packaging.specifiers import SpecifierSet
from transformers import TrainerCallback, trainer

from .installation import packed_loss_of

# The trl versions PackedSFTTrainer was tested with: the ``trl`` extra of pyproject.toml (a test
# keeps the two equal).
TRL_TESTED = ">=1.16,<1.17"
CHECKED = "trl 1.16, transformers 5.24"


@dataclass(frozen=True)
class Seam:
    """A private name of trl or transformers the trainers rely on."""

    owner: str  # the class or module holding it, as imported
    name: str
    why: str  # what it does here, and why no public hook serves


PRIVATE_SEAMS = (
    Seam("trl.SFTTrainer", "_prepare_dataset", "overridden: trl tokenises, then PackedSFTTrainer "
         "packs (bfd / bfd_split keeping weight and source) and builds assistant labels for "
         "templates without generation markers; trl has no public step between the two"),
    Seam("trl.SFTConfig", "assistant_only_loss", "set to False around SFTTrainer.__init__ for a "
         "template without generation markers, which trl refuses or replaces; the labels come "
         "from collators.tokenize_conversation instead"),
    Seam("trl.SFTTrainer", "_metrics", "trl's logged metrics, appended to as trl does"),
    Seam("trl.SFTTrainer", "_total_train_tokens", "trl's num_tokens, counted as trl counts it"),
    Seam("trl.SFTTrainer", "_tp_size", "trl's tensor-parallel divisor of num_tokens"),
    Seam("transformers.Trainer", "_get_num_items_in_batch", "overridden: the step's normaliser "
         "(sequences, not tokens), counted over all micro-batches before the first forward"),
    Seam("transformers.Trainer", "_set_signature_columns_if_needed", "overridden: keeps the "
         "packed rows' columns (seq_lengths, weights, sources) for the collator"),
    Seam("transformers.Trainer", "_signature_columns", "the kept columns, extended"),
    Seam("transformers.Trainer", "_prepare_inputs", "overridden: seq_weights move to the device "
         "in their own dtype; under DeepSpeed the Trainer casts every floating tensor of a batch "
         "to the engine's dtype (bf16 would round each weight, the normaliser would not)"),
    Seam("transformers.Trainer", "_prepare_context_parallel_inputs", "overridden: under "
         "ParallelismConfig(cp_size) each rank gets its shard of the packed row "
         "(enable_context_parallel) instead of accelerate's ring attention, which is causal over "
         "the whole row; training_step calls it after counting num_items_in_batch"),
    Seam("transformers.trainer", "DEFAULT_CALLBACKS", "the callbacks of every Trainer: "
         "RefuseOtherTrainers joins them, the one way to reach a stock Trainer"),
)


def warn_if_untested_trl() -> None:
    """Warns (once per calling line) when the installed trl is outside :data:`TRL_TESTED`."""
    import trl

    if not SpecifierSet(TRL_TESTED).contains(trl.__version__, prereleases=True):
        warnings.warn(
            f"PackedSFTTrainer is tested with trl{TRL_TESTED} (pip install 'packed-ce[trl]'), "
            f"this is trl {trl.__version__}: it relies on private trl methods "
            "(packed_ce/integrations/seams.py) that may have changed",
            UserWarning,
            stacklevel=3,
        )


class RefuseOtherTrainers(TrainerCallback):
    """Refuses, when training begins, a Trainer that is not a packed one on a packed model.

    The stock ``Trainer`` divides the loss by a token count (``num_items_in_batch``) and trl's
    ``SFTTrainer`` computes its own token mean: either trains another objective. Nothing in the
    model call tells a stock Trainer from a custom loop that passes ``count_num_items``, so the
    Trainer is refused by a callback of its own; :class:`PackedNormaliserMixin` removes it.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and packed_loss_of(model) is not None:
            raise ValueError(
                "this model has the packed loss (apply_packed_loss), but this Trainer would "
                "train another objective (transformers.Trainer divides it by a token count, "
                "trl.SFTTrainer computes its own token mean): use "
                "packed_ce.integrations.PackedTrainer instead of transformers.Trainer, or "
                "packed_ce.integrations.PackedSFTTrainer instead of trl.SFTTrainer"
            )


def refuse_in_other_trainers() -> None:
    """Gives every ``transformers.Trainer`` created from now on :class:`RefuseOtherTrainers`.

    Called by :func:`apply_packed_loss`; a Trainer created before its first call in the process
    is not checked.
    """
    if RefuseOtherTrainers not in trainer.DEFAULT_CALLBACKS:
        trainer.DEFAULT_CALLBACKS.append(RefuseOtherTrainers)
