"""The contract every lock-like primitive must meet, on this job's ranks.

Run for Lock, Semaphore(1), a Condition's lock and (bounds) Semaphore(2),
with several tasks per rank. Every check is ordered by barriers or by
polling the home rank's state, never by sleeping. Usage:
    sync_contract.py [--trio] WORKDIR
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import anyio
from _common import report
from mpi4py import MPI
from sync_common import (
    LOCK_KINDS,
    append,
    base,
    homed,
    homed_lock,
    lines,
    run_or_abort,
    settle,
    until,
    workdir,
)

import asynclock
from asynclock import CollectiveTimeout

TASKS, ITERS = 3, 15


async def check_exclusion(c: asynclock.Coordinator, lk: Any, counter: Path) -> None:
    """A read-yield-write counter loses updates unless the lock excludes."""
    if c.rank == 0:
        counter.write_text("0")
    await c.barrier()

    async def worker() -> None:
        for _ in range(ITERS):
            async with lk:
                value = int(counter.read_text())
                for _ in range(3):
                    await anyio.sleep(0)
                counter.write_text(str(value + 1))

    async with anyio.create_task_group() as tg:
        for _ in range(TASKS):
            tg.start_soon(worker)
    await c.barrier()
    total = int(counter.read_text())
    assert total == c.size * TASKS * ITERS, f"lost updates: {total}"
    assert base(lk).statistics().acquired >= TASKS * ITERS


async def check_fifo(c: asynclock.Coordinator, lk: Any, log: Path) -> None:
    """Grants follow arrival order at the home rank, across ranks."""
    order = [r for _ in range(2) for r in reversed(range(c.size))]
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()

    async def waiter(k: int) -> None:
        async with lk:
            append(log, str(k))

    mine = 0
    async with anyio.create_task_group() as tg:
        for k, r in enumerate(order):
            if c.rank == r:
                tg.start_soon(waiter, k)
                mine += 1
                await until(lambda m=mine: base(lk).statistics().tasks_waiting == m, "queued")
                await settle(lk, holders=1, waiters=k + 1)
            await c.barrier()
        if c.rank == 0:
            lk.release()
    await c.barrier()
    assert lines(log) == [str(k) for k in range(len(order))], lines(log)


async def check_nowait(c: asynclock.Coordinator, lk: Any) -> None:
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()

    async def refused() -> None:
        try:
            await lk.acquire_nowait()
        except anyio.WouldBlock:
            return
        raise AssertionError("acquire_nowait succeeded while held")

    async with anyio.create_task_group() as tg:
        tg.start_soon(refused)
    await c.barrier()
    if c.rank == 0:
        lk.release()
        await settle(lk)
    await c.barrier()
    if c.rank == c.size - 1:
        await lk.acquire_nowait()
        lk.release()
        await settle(lk)
    await c.barrier()


async def check_timeout(c: asynclock.Coordinator, lk: Any) -> None:
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()
    if c.rank == c.size - 1:
        try:
            await lk.acquire(timeout=0.2)
        except CollectiveTimeout as exc:
            text = str(exc)
            assert base(lk).name in text and "held by rank(s) [0]" in text, text
        else:
            raise AssertionError("no timeout")
        assert base(lk).statistics().timed_out == 1
        await settle(lk, holders=1)
    await c.barrier()
    if c.rank == 0:
        lk.release()
        await settle(lk)
    await c.barrier()


async def check_cancel_queued(c: asynclock.Coordinator, lk: Any) -> None:
    """Regression: a waiter cancelled while queued is withdrawn at the home rank."""
    last = c.size - 1
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()
    if c.rank == last:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lk.acquire)
            await settle(lk, holders=1, waiters=1)
            tg.cancel_scope.cancel()
        assert base(lk).statistics().cancelled == 1
        await settle(lk, holders=1, waiters=0)
    await c.barrier()
    if c.rank == 0:
        lk.release()
        await settle(lk)
    await c.barrier()
    if c.rank == last:
        await lk.acquire_nowait()  # nothing stuck: free again
        lk.release()
        await settle(lk)
    await c.barrier()


async def check_cancel_after_grant_local(c: asynclock.Coordinator, lk: Any) -> None:
    """Regression: granted (on the home rank, synchronously) and cancelled before
    the task resumed: the permit is passed on, never kept."""
    if c.rank == base(lk).home:
        await lk.acquire()
        before = base(lk).statistics()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_hold_briefly, lk)
            await until(lambda: base(lk).statistics().tasks_waiting == 1, "queued")
            lk.release()  # grants the waiter at once
            tg.cancel_scope.cancel()  # before it could resume
        after = base(lk).statistics()
        cancelled = after.cancelled - before.cancelled
        acquired = after.acquired - before.acquired
        assert (cancelled, acquired) in ((1, 0), (0, 1)), (cancelled, acquired)
        await settle(lk)
        await lk.acquire_nowait()
        lk.release()
        await settle(lk)
    await c.barrier()


async def _hold_briefly(lk: Any) -> None:
    async with lk:
        await anyio.sleep(30)


async def check_cancel_grant_crossing(c: asynclock.Coordinator, lk: Any) -> None:
    """Regression: the waiter's CANCEL and the home's GRANT cross in flight.

    Rank 0 (home) sits in two blocking MPI barriers with its loop frozen,
    so it grants before it can read the CANCEL; the grant then lands on an
    abandoned ticket and must be released ("orphaned")."""
    world = MPI.COMM_WORLD
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()
    if c.rank == 1:
        tg_scope = anyio.CancelScope()

        async def wait() -> None:
            with tg_scope:
                await lk.acquire()
        async with anyio.create_task_group() as tg:
            tg.start_soon(wait)
            await settle(lk, holders=1, waiters=1)
            await c.barrier()
            world.Barrier()
            tg_scope.cancel()
            await until(lambda: base(lk).statistics().cancelled == 1, "cancel processed")
            world.Barrier()
        await until(lambda: base(lk).statistics().orphaned == 1, "orphan grant released")
    else:
        await c.barrier()
        world.Barrier()
        world.Barrier()  # rank 0: no yield between the barriers: CANCEL not read yet
        if c.rank == 0:
            lk.release()  # grants rank 1's abandoned ticket
    await c.barrier()
    if c.rank == 0:
        await settle(lk)
        await lk.acquire_nowait()
        lk.release()
        await settle(lk)
    await c.barrier()


async def check_lease(c: asynclock.Coordinator, lk: Any) -> None:
    """Lock caching: rank 1's repeated uncontended acquires of a lock homed on
    rank 0 send no messages after the first; another rank's acquire_nowait
    recalls the idle lease and succeeds."""
    if c.rank == 1:
        for _ in range(5):
            async with lk:
                pass
        sent = c.lowlevel.sync.sent
        for _ in range(50):
            async with lk:
                pass
        assert c.lowlevel.sync.sent == sent, (sent, c.lowlevel.sync.sent)
        assert base(lk).statistics().cached == 1
    await c.barrier()
    if c.rank == 0:
        await lk.acquire_nowait()  # the idle lease comes back at once
        lk.release()
        await settle(lk)
    await c.barrier()
    if c.rank == 1:
        assert base(lk).statistics().cached == 0
    await c.barrier()


async def check_lease_recall_race(c: asynclock.Coordinator, lk: Any) -> None:
    """Regression: a GRANT with a lease and a RECALL land in the same poll, before
    the waiting task resumed; the permit must still go back (BUSY, then RELEASE).

    Rank 1's loop is frozen in two blocking MPI barriers while rank 0 (home)
    grants it the lock and queues a local waiter, which recalls the lease."""
    world = MPI.COMM_WORLD
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()
    async with anyio.create_task_group() as tg:
        if c.rank == 1:
            tg.start_soon(_hold_and_release, lk)
            await settle(lk, holders=1, waiters=1)
        await c.barrier()
        world.Barrier()
        if c.rank == 0:
            lk.release()  # GRANT (lease: nobody else queued) to rank 1
            tg.start_soon(_hold_and_release, lk)  # queues: RECALL to rank 1
            await until(lambda: base(lk).statistics().tasks_waiting == 1, "queued")
        world.Barrier()
    await c.barrier()
    await settle(lk)
    if c.rank == 1:
        assert base(lk).statistics().cached == 0


async def _hold_and_release(lk: Any) -> None:
    async with lk:
        for _ in range(3):
            await anyio.sleep(0)


async def check_semaphore_bounds(c: asynclock.Coordinator, log: Path) -> None:
    """Semaphore(2): never more than 2 holders; a third is refused while 2 hold."""
    sem = c.semaphore(homed("bounds", c.size - 1, c.size), 2)

    async def worker() -> None:
        for _ in range(ITERS):
            async with sem:
                append(log, "+1")
                for _ in range(3):
                    await anyio.sleep(0)
                append(log, "-1")

    async with anyio.create_task_group() as tg:
        for _ in range(TASKS):
            tg.start_soon(worker)
    await c.barrier()
    running, peak = 0, 0
    for step in lines(log):
        running += int(step)
        peak = max(peak, running)
    assert peak <= 2 and running == 0, (peak, running)
    await _semaphore_full(c, sem)


async def _semaphore_full(c: asynclock.Coordinator, sem: Any) -> None:
    sem.release_cached()  # start from no idle leases anywhere
    await c.barrier()
    await settle(sem)
    await c.barrier()
    for r in (0, 1):
        if c.rank == r:
            await sem.acquire()
            await settle(sem, holders=r + 1)
        await c.barrier()
    if c.rank == c.size - 1:
        try:
            await sem.acquire_nowait()
        except anyio.WouldBlock:
            pass
        else:
            raise AssertionError("third permit granted")
    await c.barrier()
    if c.rank in (0, 1):
        sem.release()
    await c.barrier()


async def check_semaphore_mismatch(c: asynclock.Coordinator) -> None:
    name = homed("mismatch", 0, c.size)
    if c.rank == 0:
        async with c.semaphore(name, 2):
            pass
    await c.barrier()
    if c.rank == c.size - 1:
        try:
            await c.semaphore(name, 3).acquire()
        except asynclock.MismatchError as exc:
            assert "capacity 3" in str(exc) and "has 2" in str(exc), exc
        else:
            raise AssertionError("mismatched capacity accepted")
    await c.barrier()
    # the disagreeing rank acquires first: the home rank's own capacity still decides
    first = homed("mismatch-first", 0, c.size)
    sem = c.semaphore(first, 3 if c.rank == c.size - 1 else 2)
    await c.barrier()
    if c.rank == c.size - 1:
        try:
            await sem.acquire()
        except asynclock.MismatchError as exc:
            assert "capacity 3" in str(exc) and "has 2" in str(exc), exc
        else:
            raise AssertionError("the first acquirer's capacity overrode the home rank's")
    await c.barrier()
    if c.rank != c.size - 1:
        async with sem:
            pass
    await c.barrier()


async def main() -> None:
    wd = workdir()
    async with asynclock.start() as c:
        for kind in LOCK_KINDS:
            lk = partial(homed_lock, c, kind)
            await check_exclusion(c, lk("excl", c.size - 1), wd / f"{kind}.counter")
            await check_exclusion(c, lk("excl0", 0), wd / f"{kind}.counter0")
            report(c.rank, f"exclusion_{kind}")
            await check_fifo(c, lk("fifo", c.size - 1), wd / f"{kind}.fifo")
            await check_fifo(c, lk("fifo0", 0), wd / f"{kind}.fifo0")
            report(c.rank, f"fifo_{kind}")
            await check_nowait(c, lk("nowait", c.size - 1))
            report(c.rank, f"nowait_{kind}")
            await check_timeout(c, lk("timeout", c.size - 1))
            report(c.rank, f"timeout_{kind}")
            await check_cancel_queued(c, lk("cq", c.size - 1))
            await check_cancel_queued(c, lk("cq0", 0))
            report(c.rank, f"cancel_queued_{kind}")
            await check_cancel_after_grant_local(c, lk("cag", 1))
            report(c.rank, f"cancel_after_grant_{kind}")
            await check_cancel_grant_crossing(c, lk("cross", 0))
            report(c.rank, f"cancel_grant_crossing_{kind}")
            if c.lowlevel.sync.policy.lease:
                await check_lease(c, lk("lease", 0))
                await check_lease_recall_race(c, lk("race", 0))
                report(c.rank, f"lease_{kind}")
        await check_semaphore_bounds(c, wd / "bounds.log")
        report(c.rank, "semaphore_bounds")
        await check_semaphore_mismatch(c)
        report(c.rank, "semaphore_mismatch")
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
