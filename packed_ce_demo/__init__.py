"""packed-ce's demo and command line, a layer on top of ``packed_ce`` and ``collators``.

- :mod:`packed_ce_demo.training`: ``packed-ce demo``, one tiny model trained packed, padded and
  naive from the same weights (:func:`run_demo`, :func:`train_runs`, :func:`step_batches`).
- :mod:`packed_ce_demo.report`: its printed table and loss plot.
- :mod:`packed_ce_demo.data`: conversations, tokenizer, packing, and :func:`split_rows`.
- :mod:`packed_ce_demo.models`: a tiny causal LM from a configuration (:func:`tiny_config`,
  :func:`build_model`).
- :mod:`packed_ce_demo.cli`: the ``packed-ce`` console script.

Needs the ``demo`` extra (``pip install packed-ce[demo]``: the corpus and matplotlib).
"""

from .data import load_data, pack, pack_to_disk, split_rows
from .models import build_model, load_model_config, tiny_config
from .report import format_report, plot_losses, save_plot
from .training import (
    TOLERANCE,
    Variant,
    model_loss,
    padded_loss,
    per_sequence_mean_loss,
    run_demo,
    step_batches,
    train_runs,
)

__all__ = [
    "TOLERANCE",
    "Variant",
    "build_model",
    "format_report",
    "load_data",
    "load_model_config",
    "model_loss",
    "pack",
    "pack_to_disk",
    "padded_loss",
    "per_sequence_mean_loss",
    "plot_losses",
    "run_demo",
    "save_plot",
    "split_rows",
    "step_batches",
    "tiny_config",
    "train_runs",
]
