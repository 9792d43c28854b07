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

from __future__ import annotations

import importlib

# name -> module; imported on first use, so that `packed-ce --help` does not load torch
_EXPORTS = {
    **dict.fromkeys(
        [
            "load_data",
            "naming_flag",
            "offline_unless_reachable",
            "pack",
            "pack_to_disk",
            "split_rows",
        ],
        "data",
    ),
    **dict.fromkeys(["build_model", "load_model_config", "tiny_config"], "models"),
    **dict.fromkeys(["format_report", "plot_losses", "save_plot"], "report"),
    **dict.fromkeys(
        [
            "TOLERANCE",
            "Variant",
            "model_loss",
            "padded_loss",
            "per_sequence_mean_loss",
            "run_demo",
            "step_batches",
            "train_runs",
        ],
        "training",
    ),
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
