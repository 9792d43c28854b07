"""Context parallelism that keeps packed conversations apart: the ranks of a group share each row.

- ``enable.py``: :func:`enable_context_parallel` / :func:`disable_context_parallel`, the state on
  the model, and the checks of every call (the shard it gets, its normaliser);
- ``layout.py``: who holds which tokens of the row, the masks, and what each ring step computes;
- ``attention.py``: the attention over the whole row, the keys and values streamed around the
  ranks (``ring.py``: the ring and its autograd Function; ``blocks.py``: one step's attention);
- ``state.py``: hybrid mixers that pass their state from rank to rank (Qwen3.5's gated delta
  net); ``gather.py``: the row's inputs gathered, for every other mixer.

The shards come from :func:`collators.shard_batch` (the trainers:
``collators.sharding.shard_for_rank``).
"""

from .enable import context_parallel_of, disable_context_parallel, enable_context_parallel

__all__ = ["context_parallel_of", "disable_context_parallel", "enable_context_parallel"]
