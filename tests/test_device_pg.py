"""The NCCL path's code in CI: `ASYNCLOCK_CUDA_PATH=gloo-twin` sends CPU tensors through
the channel's private process group over gloo, exactly as a GPU job sends CUDA tensors
over NCCL (`engine.device_pg`, `transports.process_group`); only the backend differs."""

from __future__ import annotations

import pytest
from mpijob import DEFAULT_KIND, OTHER_KINDS, assert_all_ok, assert_labels, crossed, run_job

TWIN = {"ASYNCLOCK_CUDA_PATH": "gloo-twin"}


@pytest.mark.parametrize("kind, nranks, loop", [
    (DEFAULT_KIND, 2, "asyncio"), *[(k, 3, "trio") for k in OTHER_KINDS]])
def test_device_path_twin(kind: str, nranks: int, loop: str) -> None:
    args = ["--trio"] if loop == "trio" else []
    job = run_job("device_pg.py", nranks, *args, timeout=120, env=TWIN, kind=kind)
    assert_labels(job, nranks, "values", "gather_scatter", "gather_errors", "mismatch_cancel",
                  "process_set", "done")


@pytest.mark.slow  # CI: test_device_path_twin covers every op the device path takes
def test_collectives_matrix_through_the_twin() -> None:
    """Every collective, every dtype and error case, with the device path on."""
    job = run_job("collectives_matrix.py", 3, timeout=240, env=TWIN)
    assert job.returncode == 0, job.explain()


def test_the_path_is_agreed_and_says_why() -> None:
    """`auto` on a CPU-only job: host staging, and `cuda.describe()` says why."""
    job = run_job("device_pg.py", 2, "--describe", timeout=60)
    assert_all_ok(job, 2, "describe")
    assert "nccl not usable on every rank" in job.output, job.explain()


@pytest.mark.slow
def test_gradient_buckets_through_the_twin() -> None:
    """`DistributedOptimizer`'s whole program with every bucket on the device group
    (no shared window: on a GPU the window is not used)."""
    env = {**TWIN, "ASYNCLOCK_NODE_WINDOW": "0", "ASYNCLOCK_BACKEND": "mpi"}
    job = run_job("torch_grads.py", 2, timeout=240, env=env)
    assert_labels(job, 2, "identical_20_steps", "caps_default", "mismatch_buckets", "done")


@pytest.mark.parametrize("kind, nranks", [(DEFAULT_KIND, 2), *[(k, 3) for k in OTHER_KINDS]])
def test_dropin_and_reset_through_the_twin(kind: str, nranks: int) -> None:
    """The drop-in's calls through the group, then a reset (`reform`): the old group
    aborted, the new world's made on a new store and exact."""
    job = run_job("device_pg.py", nranks, "--hvd", timeout=120, env=TWIN, kind=kind)
    assert_labels(job, nranks, "hvd_calls", "reset", "done")


@pytest.mark.parametrize("kind, nranks", crossed([(3,), (2,)], DEFAULT_KIND))
def test_join_through_the_twin(kind: str, nranks: int) -> None:
    """Ranks join early (`join()`, `hvd.join()`, a DistributedOptimizer's uneven steps)
    while the others reduce through the group: a joined rank's stand-ins take the
    live ranks' transport, as the header says; a call whose ranks chose different
    transports is refused on every rank."""
    job = run_job("device_pg.py", nranks, "--join", timeout=90, env=TWIN, kind=kind)
    assert_labels(job, nranks, "join", "hvd_join", "hvd_join_optimizer", "done")
    if nranks > 1:
        assert_labels(job, nranks, "path_mismatch")
