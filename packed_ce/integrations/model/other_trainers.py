"""A packed model refuses the Trainers that would train another objective on it.

:func:`apply_packed_loss` gives every ``transformers.Trainer`` created from then on
:class:`RefuseOtherTrainers` (``transformers.trainer.DEFAULT_CALLBACKS``: one of
``trainers/seams.py``'s ``GLOBAL_STATE``); the packed trainers remove it from themselves.
"""

from __future__ import annotations

from transformers import TrainerCallback, trainer

from .installation import packed_loss_of


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
