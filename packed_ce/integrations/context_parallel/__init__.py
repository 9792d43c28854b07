"""Context parallelism that keeps packed conversations apart: the ranks of a group share each row.

- ``enable.py``: :func:`enable_context_parallel` / :func:`disable_context_parallel`, the state on
  the model, and the checks of every call (the shard it gets, its normaliser);
- ``layout.py``: who holds which tokens of the row, and the masks;
- ``attention.py``: the attention over the whole row; ``gather.py``: its one collective,
  which the mixers of hybrid families use too.

The shards come from :func:`collators.shard_batch` (the trainers:
``collators.sharding.shard_for_rank``).
"""

from .enable import context_parallel_of, disable_context_parallel, enable_context_parallel

__all__ = ["context_parallel_of", "disable_context_parallel", "enable_context_parallel"]
