"""Shared fixtures: the one independent per-sequence reference loss of the test suite
(:func:`loss_utils.per_sequence_loss`), and an empty queue of value checks around each test."""

from __future__ import annotations

import os

import pytest

from loss_utils import per_sequence_loss

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the GPU image runs the cuda tests without hypothesis
    settings = None

# Property tests draw the same examples on every CI run (a failure there is a bug in the tree,
# never bad luck); elsewhere hypothesis explores, and prints a failing example's seed. Nowhere
# does an example fail on time: no deadline, and no health check of how fast examples are drawn
# (both fail on a loaded machine).
if settings is not None:
    settings.register_profile("untimed", deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.register_profile("ci", settings.get_profile("untimed"), derandomize=True, print_blob=True)
    settings.load_profile("ci" if os.environ.get("CI") else "untimed")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """One intra-op thread for the whole suite and the processes it starts (the notebook's kernel,
    the benchmark scripts, the README's torchrun; spawned ranks set theirs in ``start_rank``):
    their tensors are tiny, and a second thread only waits on the first. On a 2-core machine with
    another job beside it, torch's default (a thread per core) makes each op wait for a core the
    other job holds: beside one busy process, tests/test_sft_trainer.py took 15 s instead of 9 s,
    and tests/test_notebook.py 148 s instead of 19 s."""
    import torch

    threads, variable = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if variable is None:
        os.environ.pop("OMP_NUM_THREADS")
    else:
        os.environ["OMP_NUM_THREADS"] = variable


@pytest.fixture(name="per_sequence_loss", scope="session")
def per_sequence_loss_fixture():
    """:func:`loss_utils.per_sequence_loss`, the ground truth of every loss test."""
    return per_sequence_loss


@pytest.fixture(autouse=True)
def no_pending_checks_between_tests():
    """Each test starts and ends with no value check pending (on CUDA they are read one call
    later): a test that expects a deferred error reads it with ``packed_ce.check_pending()``, and
    a leftover never raises inside the next, unrelated test."""
    from packed_ce import pending

    pending.discard_pending()
    yield
    pending.discard_pending()


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (gloo, in-memory store), destroyed after the test;
    yields its device mesh, for DTensors like FSDP2's."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()
