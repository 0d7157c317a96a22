"""Communicators and windows made after start-up are agreed calls (`engine.making`),
and released with their owner (`torch._grad.release`):
ranks out of step get an error on every rank within the stray timeout, never a hang
inside MPI, and the job goes on. 3 ranks, on every MPI installed."""

from __future__ import annotations

import pytest
from mpijob import DEFAULT_KIND, OTHER_KINDS, assert_labels, run_job

KINDS = [DEFAULT_KIND, *OTHER_KINDS]
# The embedded MPICH in CI (its communicator creation is where ranks out of step hung);
# the default MPI as well with --long.
OTHER_FIRST = [pytest.param(k, marks=[] if k != DEFAULT_KIND else [pytest.mark.slow])
               for k in KINDS]
# Short, so that an out-of-step make fails fast; the job's timeout names a hang.
ENV = {"ASYNCLOCK_STRAY_S": "2"}


@pytest.mark.parametrize("kind", OTHER_FIRST)
def test_out_of_step_process_sets(kind: str) -> None:
    job = run_job("agreed_make.py", 3, timeout=90, env=ENV, kind=kind)
    assert_labels(job, 3, "desync", "differ", "takeover", "done")


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_step_optimizer(kind: str) -> None:
    job = run_job("agreed_make.py", 3, "--hvd", timeout=90, env=ENV, kind=kind)
    assert_labels(job, 3, "optimizer_desync", "optimizer_after", "done")


@pytest.mark.parametrize("kind", OTHER_FIRST)
def test_dropped_optimizers_release_threads_and_lanes(kind: str) -> None:
    """50 optimizers made, stepped past the re-plan (the shared-memory pipeline's thread)
    and dropped: threads and gradient lanes stay flat (windows stay mapped until MPI
    ends: freeing one waits for every peer's free)."""
    job = run_job("optimizer_churn.py", 2, "50", timeout=180, kind=kind)
    assert_labels(job, 2, "flat", "done")


def test_dropped_optimizers_free_their_node_windows_off_the_loop() -> None:
    """Buckets through MPI and the node window (no shared-memory pipeline): a dropped
    optimizer's channel holds a node window, whose free is collective over the node;
    the release frees none of it (on the loop it would block it, and the peers'
    next call with it), so threads and lanes stay flat and nothing hangs."""
    env = {"ASYNCLOCK_WINDOW_MIN_BYTES": "64", "ASYNCLOCK_THREAD_MIN_BYTES": "64"}
    job = run_job("optimizer_churn.py", 2, "20", "--allreduce", timeout=120, env=env)
    assert_labels(job, 2, "flat", "done")
