"""The packed loss inside one transformers model.

- ``install.py``: :func:`apply_packed_loss` / :func:`remove_packed_loss`, recorded in
  ``installation.py``;
- ``forward.py``: the forward it installs (the call's checks in ``guards.py``, the loss in
  ``loss.py``, the batch's boundaries and normaliser in ``batch.py``);
- ``audit.py`` and ``probe.py``: the first packed call's check of every mask and of what the
  model does;
- ``mixers.py`` and ``rotary.py``: token mixers and rotary embeddings per conversation;
- ``families.py``: what packed-ce knows of each model family, in one place;
- ``tiny.py``: a tiny random model for examples and tests.
"""
