"""The trainers: transformers' ``Trainer`` and trl's ``SFTTrainer`` minimising the mean over
conversations.

- ``transformers_trainer.py``: :class:`PackedTrainer` and what both trainers change
  (the step's normaliser, the sources' losses, the evaluation);
- ``trl_trainer.py`` and ``trl_data.py``: :class:`PackedSFTTrainer` and its data (weights,
  sources, split packing, assistant labels);
- ``data_checks.py``: a data set's checks before any tokenisation;
- ``evaluation.py`` and ``copies.py``: ``eval_loss`` over the whole eval set, and the copies
  accelerate adds to a last batch left out;
- ``seams.py``: every private name of another library packed-ce relies on.
"""
