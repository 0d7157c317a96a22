"""Cross-rank Lock, Semaphore, Condition, Event, sequential sections and
consistency points: real mpiexec jobs at 2 and 3 ranks on asyncio and trio,
plus the same primitives in-process on the local (world size 1) backend.

Each rank program prints one `RANK r OK label` line per check; every label
named below is a regression test for one behaviour (see the program's
docstrings), so a job that exits 0 without running a check still fails.
"""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_all_ok, assert_labels, run_job

import asynclock
import asynclock._core.sync

pytestmark = pytest.mark.mpi

LOOPS = ["asyncio", "trio"]
# 2 ranks on asyncio and 3 on trio in CI; the other two pairs with --long.
RANKS_LOOPS = pytest.mark.parametrize("nranks, loop", [
    (2, "asyncio"), (3, "trio"), pytest.param(2, "trio", marks=pytest.mark.slow),
    pytest.param(3, "asyncio", marks=pytest.mark.slow)])
LOCK_KINDS = ["lock", "sem1", "cond"]
CONTRACT = ["exclusion", "fifo", "nowait", "timeout", "cancel_queued", "cancel_after_grant",
            "cancel_grant_crossing"]  # "lease": caching and the grant/recall race


def _args(loop: str, workdir: Path) -> list[str]:
    return (["--trio"] if loop == "trio" else []) + [str(workdir)]




@RANKS_LOOPS
def test_lock_contract(nranks: int, loop: str, tmp_path: Path) -> None:
    """Lock, Semaphore(1) and a Condition's lock: exclusion, FIFO, nowait,
    timeout, and the three cancellation paths; Semaphore(2) bounds."""
    _lock_contract(nranks, loop, tmp_path, MPI_KIND)


def _lock_contract(nranks: int, loop: str, tmp_path: Path, kind: str) -> None:
    job = run_job("sync_contract.py", nranks, *_args(loop, tmp_path), timeout=120, kind=kind)
    labels = [f"{check}_{lk}" for check in [*CONTRACT, "lease"] for lk in LOCK_KINDS]
    assert_labels(job, nranks, *labels, "semaphore_bounds", "semaphore_mismatch")


def test_lock_contract_without_leases(tmp_path: Path) -> None:
    """The same contract with lock caching off (ASYNCLOCK_SYNC_LEASE=0)."""
    job = run_job("sync_contract.py", 3, str(tmp_path), timeout=120,
                  env={"ASYNCLOCK_SYNC_LEASE": "0"})
    labels = [f"{check}_{kind}" for check in CONTRACT for kind in LOCK_KINDS]
    assert_labels(job, 3, *labels, "semaphore_bounds", "semaphore_mismatch")
    assert job.ok_lines("lease_lock") == set(), job.explain()


@RANKS_LOOPS
def test_deadlines(nranks: int, loop: str, tmp_path: Path) -> None:
    """Lock, Semaphore(1) and a Condition's lock homed on another rank:
    `acquire(timeout=0)` takes a free (or idle cached) permit as on the home rank,
    a grant that crosses a deadline shorter than the round trip is kept, and a
    semaphore's `n` mismatch under a deadline is a MismatchError; consistency
    points whose long names differ only at the end are told apart."""
    job = run_job("sync_misuse.py", nranks, *_args(loop, tmp_path), timeout=120)
    labels = [f"{check}_{lk}" for check in ("timeout_zero", "deadline_before_answer")
              for lk in LOCK_KINDS]
    assert_labels(job, nranks, *labels, "mismatch_under_deadline", "long_point_names")


@RANKS_LOOPS
def test_primitives(nranks: int, loop: str, tmp_path: Path) -> None:
    """Condition notify counts / wait_for / cancel, Event, sequential order and
    cancel, consistency points and their mismatch error."""
    _primitives(nranks, loop, tmp_path, MPI_KIND)


def _primitives(nranks: int, loop: str, tmp_path: Path, kind: str) -> None:
    job = run_job("sync_primitives.py", nranks, *_args(loop, tmp_path), timeout=120, kind=kind)
    assert_labels(job, nranks, "condition_notify", "condition_wait_for", "condition_cancel",
                  "event", "event_timeout_cancel", "sequential", "sequential_cancel",
                  "consistency_point", "consistency_mismatch")


@RANKS_LOOPS
def test_unresponsive_rank_is_named(nranks: int, loop: str, tmp_path: Path) -> None:
    """A stopped rank holding a lock, homing one, or awaited: the others raise
    RankFailedError / CollectiveTimeout naming it within stall + probe."""
    _unresponsive_rank(nranks, loop, tmp_path, MPI_KIND)


def _unresponsive_rank(nranks: int, loop: str, tmp_path: Path, kind: str) -> None:
    env = {"ASYNCLOCK_SYNC_STALL_S": "0.3", "ASYNCLOCK_SYNC_PROBE_S": "1"}
    job = run_job("sync_dead.py", nranks, *_args(loop, tmp_path), timeout=90, env=env,
                  kind=kind)
    assert_all_ok(job, nranks)
    survivors = set(range(nranks)) - {1}
    for label in ("holder_dead", "consistency_dead"):
        assert job.ok_lines(label) == survivors, f"{label}\n{job.explain()}"
    for label in ("home_dead_timeout", "home_dead", "event_home_dead"):
        assert job.ok_lines(label) == {0}, f"{label}\n{job.explain()}"
    if nranks > 2:
        assert job.ok_lines("sequential_dead") == {2}, job.explain()


# -- the other MPI: a sample, 2 ranks -------------------------------------------------
# Every lock-like type and every primitive once on the MPI the default does not
# pick (MPICH where CI's root picks Open MPI): the contract on asyncio, the
# primitives and a dead rank on trio, so both loops meet that MPI too.
@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_lock_contract_on_the_other_mpi(kind: str, tmp_path: Path) -> None:
    _lock_contract(2, "asyncio", tmp_path, kind)


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_primitives_on_the_other_mpi(kind: str, tmp_path: Path) -> None:
    _primitives(2, "trio", tmp_path, kind)


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_unresponsive_rank_on_the_other_mpi(kind: str, tmp_path: Path) -> None:
    _unresponsive_rank(2, "trio", tmp_path, kind)

# -- world size 1 (local backend, in process) -----------------------------------------
async def _local_world() -> None:
    async with asynclock.start(backend="local") as c:
        lock, sem = c.lock("a"), c.semaphore("s", 2)
        assert c.lock("a") is lock
        async with lock:
            assert lock.locked()
            async with anyio.create_task_group() as tg:
                tg.start_soon(_refused, lock)
            with pytest.raises(RuntimeError, match="already held"):
                await lock.acquire()
        with pytest.raises(RuntimeError, match="not holding"):
            lock.release()
        await sem.acquire()
        await sem.acquire()
        with pytest.raises(asynclock.CollectiveTimeout, match=r"held by rank\(s\) \[0, 0\]"):
            await sem.acquire(timeout=0.01)
        sem.release()
        sem.release()
        assert (await sem.info()).holders == ()
        await _local_condition_event(c)
        async with c.sequential("q") as rnd:
            assert rnd == 0
        async with c.sequential("q") as rnd:
            assert rnd == 1
        await c.consistency_point("p")
        with pytest.raises(ValueError, match="already exists"):
            c.semaphore("s", 3)


async def _refused(lock: asynclock._core.sync.Lock) -> None:
    """Another task: the lock is held, so nowait must refuse."""
    with pytest.raises(anyio.WouldBlock):
        await lock.acquire_nowait()


async def _local_condition_event(c: asynclock.Coordinator) -> None:
    cond, ev, seen = c.condition("c"), c.event("e"), []

    async def waiter() -> None:
        async with cond:
            await cond.wait()
            seen.append(1)
        await ev.wait()
        seen.append(2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        while (await cond.info()).condition_waiters != 1:
            await anyio.sleep(0)
        async with cond:
            cond.notify()
        while not seen:
            await anyio.sleep(0)
        ev.set()
    assert seen == [1, 2] and ev.is_set()


@pytest.mark.parametrize("loop", LOOPS)
def test_local_world(loop: str) -> None:
    """Every primitive on one rank without MPI (messages to self never leave)."""
    anyio.run(_local_world, backend=loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_cold_pump_polls_slowly_and_still_serves_first_contact(loop: str, tmp_path: Path) -> None:
    """A rank that never used a primitive idles at the cold cadence (its loop wakes
    ~10x a second instead of ~50); a first lock request homed there is served, and
    the home rank then keeps the usual cadence."""
    job = run_job("sync_cold.py", 2, *(["--trio"] if loop == "trio" else []), timeout=90)
    assert_labels(job, 2, "cold_cadence")
    assert job.ok_lines("first_contact") == {0}, job.explain()
    assert job.ok_lines("warm_cadence") == {1}, job.explain()
