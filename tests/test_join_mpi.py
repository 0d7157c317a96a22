"""join() in real jobs: uneven steps, refusals, Horovod's API, both MPIs, Horovod backend."""

from __future__ import annotations

import re

import pytest
from mpijob import OTHER_KINDS, assert_all_ok, horovod_status, run_job

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nranks, loop", [(1, "asyncio"), (2, "asyncio"), (3, "trio"),
                                           pytest.param(4, "asyncio", marks=pytest.mark.slow)])
def test_join_stands_in_for_uneven_steps(nranks: int, loop: str) -> None:
    """Rank r runs 2 + r steps of every allreduce path (inline, data stage, min/max/product,
    int64, float16) and a barrier, checked against the ranks still active; broadcast is
    refused by name while rank 0 has joined; every rank names the same last joiner."""
    job = run_job("join.py", nranks, *(["--trio"] if loop == "trio" else []), timeout=120)
    assert_all_ok(job, nranks)
    assert job.ok_lines("uneven") == set(range(nranks)), job.explain()
    assert f"last={nranks - 1}" in job.output, job.explain()
    if nranks > 1:
        assert job.ok_lines("refused") == set(range(nranks)), job.explain()
        assert job.ok_lines("cancelled_join") == set(range(nranks)), job.explain()
    assert job.ok_lines("all_at_once") == set(range(nranks)), job.explain()


# CI: 2 ranks here and 3 on the Horovod transport below; the rest with --long.
@pytest.mark.parametrize("nranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_join_horovod_api(nranks: int) -> None:
    """Horovod's own join test (others average, rank 0 joined: a * (size-1) / size), a
    DistributedOptimizer whose ranks run different step counts (MPI gradient buckets),
    a join while one rank has dropped an optimizer the others still hold, and an
    optimizer dropped during a join."""
    job = run_job("join.py", nranks, "--hvd", timeout=120)
    assert_all_ok(job, nranks)
    assert job.ok_lines("hvd_allreduce") == set(range(nranks)), job.explain()
    assert job.ok_lines("hvd_optimizer") == set(range(nranks)), job.explain()
    assert job.ok_lines("hvd_second_optimizer") == set(range(nranks)), job.explain()
    assert job.ok_lines("hvd_dropped_optimizer") == set(range(nranks)), job.explain()
    assert job.ok_lines("hvd_dropped_during_join") == set(range(nranks)), job.explain()


@pytest.mark.horovod
@pytest.mark.parametrize("nranks", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_join_horovod_api_on_the_horovod_backend(nranks: int) -> None:
    """The same on Horovod's transport, where checked rounds send their buckets as
    Horovod groups of handed gradients and rounds a joined rank stands in for first
    settle them into the bucket (`asynclock.torch._grad.grouped`)."""
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    job = run_job("join.py", nranks, "--hvd", timeout=180, kind=kind,
                  env={"ASYNCLOCK_BACKEND": "horovod"})
    assert_all_ok(job, nranks)
    assert job.ok_lines("hvd_optimizer") == set(range(nranks)), job.explain()


def test_join_with_shared_memory_gradient_rounds() -> None:
    """Shared-memory buckets need every rank's own data: once a rank joins, each round's
    first stage is refused on every rank and its buckets go over MPI, stood in for."""
    job = run_job("join.py", 3, "--hvd", "--shm", timeout=120)
    assert_all_ok(job, 3)
    assert job.ok_lines("hvd_optimizer") == {0, 1, 2}, job.explain()
    assert job.ok_lines("hvd_second_optimizer") == {0, 1, 2}, job.explain()
    assert job.ok_lines("hvd_dropped_optimizer") == {0, 1, 2}, job.explain()
    assert job.ok_lines("hvd_dropped_during_join") == {0, 1, 2}, job.explain()
    assert job.output.count("OK hvd_optimizer over shared memory") == 3, job.explain()


def test_join_with_gloo_gradient_rounds() -> None:
    """Rounds whose buckets go to gloo from the packing thread: once a rank joins, each
    round's check is refused on every rank and its buckets go over MPI, stood in for."""
    job = run_job("join.py", 3, "--hvd", "--gloo-rounds", timeout=120)
    assert_all_ok(job, 3)
    assert job.output.count("OK hvd_optimizer over gloo rounds") == 3, job.explain()
    assert job.ok_lines("hvd_second_optimizer") == {0, 1, 2}, job.explain()


@pytest.mark.parametrize("shm", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["mpi-buckets", "shm-buckets"])
def test_join_before_the_first_round_defers_the_replan(shm: bool) -> None:
    """Regression: rank 0 joins with no batch at all; the others' one-time re-plan (an
    allgather a joined rank cannot stand in for) used to fail the job; it now waits for
    the next epoch, where every rank re-plans at the same point."""
    job = run_job("join.py", 3, "--hvd", "--zero-steps", *(["--shm"] if shm else []),
                  timeout=120)
    assert_all_ok(job, 3)
    assert job.ok_lines("hvd_optimizer") == {0, 1, 2}, job.explain()


def test_a_joined_rank_is_not_a_stall_to_abort() -> None:
    """Regression: with ASYNCLOCK_STALL_ABORT_S set, a rank waiting in join() past it
    ended the job; joined rounds are reported like any stall, and never aborted."""
    env = {"ASYNCLOCK_STALL_WARN_S": "0.5", "ASYNCLOCK_STALL_ABORT_S": "1.0",
           "ASYNCLOCK_HEARTBEAT_S": "0.1"}
    job = run_job("join.py", 2, "--long-wait", timeout=120, env=env)
    assert_all_ok(job, 2)
    assert job.ok_lines("long_wait") == {0, 1}, job.explain()
    assert re.search(r"asynclock\[rank 0\]: stall: waiting \d+\.\d s in join #\d+", job.output), \
        job.explain()


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_join_other_mpi(kind: str) -> None:
    job = run_job("join.py", 3, timeout=120, kind=kind)
    assert_all_ok(job, 3)
    assert job.ok_lines("uneven") == {0, 1, 2}, job.explain()


@pytest.mark.horovod
def test_join_on_the_horovod_backend() -> None:
    """Stand-in data stages go through Horovod handles like any participant's."""
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    job = run_job("join.py", 2, timeout=180, kind=kind, env={"ASYNCLOCK_BACKEND": "horovod"})
    assert_all_ok(job, 2)
    assert job.ok_lines("uneven") == {0, 1}, job.explain()
    assert job.ok_lines("refused") == {0, 1}, job.explain()


@pytest.mark.horovod
@pytest.mark.slow  # checks the program against real Horovod, not asynclock: CI time
@pytest.mark.parametrize("flags", [(), ("--zero-steps",)], ids=["uneven", "zero-steps"])
def test_join_checks_pass_on_real_horovod(flags: tuple[str, ...]) -> None:
    """Conformance: the same join checks (Horovod's own join test; gradients of a
    DistributedOptimizer with uneven steps: zeros from joined ranks, average over the
    full size) pass on Horovod 0.28.1, so they pin down Horovod's semantics."""
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    job = run_job("join.py", 3, "--hvd", "--horovod", *flags, timeout=240, kind=kind)
    assert_all_ok(job, 3)
    assert job.ok_lines("hvd_optimizer") == {0, 1, 2}, job.explain()
