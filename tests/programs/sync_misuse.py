"""What a user tries next with the lock-like primitives: deadlines of zero or
shorter than a round trip, a semaphore's `n` disagreeing under a deadline, and
consistency points whose long names differ only at the end.

Run for Lock, Semaphore(1) and a Condition's lock, each homed on another rank
than the one acquiring, so every acquire needs the home rank's answer. Usage:
    sync_misuse.py [--trio] WORKDIR
"""

from __future__ import annotations

import zlib
from functools import partial
from typing import Any

import anyio
from _common import expect_async, report
from sync_common import LOCK_KINDS, base, homed, homed_lock, run_or_abort, settle

import asynclock
from asynclock import CollectiveTimeout, MismatchError


async def check_timeout_zero(c: asynclock.Coordinator, lk: Any) -> None:
    """acquire(timeout=0) takes a free permit on every rank, as on its home rank,
    even where the previous rank left it cached (a lease); a held one times out
    naming the holder."""
    for r in range(c.size):
        if c.rank == r:
            await lk.acquire(timeout=0)
            assert base(lk).held_by_current_task() is not None
            lk.release()
        await c.barrier()
        await settle(lk)  # the release reached the home rank (a lease may stay cached)
        await c.barrier()
    assert base(lk).statistics().timed_out == 0, base(lk).statistics()
    if c.rank == 0:
        await lk.acquire()
    await c.barrier()
    if c.rank != 0:
        await expect_async(CollectiveTimeout, "held by rank(s) [0]",
                           lambda: lk.acquire(timeout=0))
        assert base(lk).statistics().timed_out == 1
        assert not base(lk).pending, base(lk).pending
    await c.barrier()
    if c.rank == 0:
        lk.release()
    await c.barrier()


async def check_deadline_before_answer(c: asynclock.Coordinator, lk: Any) -> None:
    """A deadline shorter than the round trip to the home rank: the grant that
    crosses the withdrawal is kept, not thrown away (the lock was free)."""
    for r in range(c.size):
        if c.rank == r and base(lk).home != r:
            await lk.acquire(timeout=1e-6)
            assert base(lk).held_by_current_task() is not None
            lk.release()
            assert base(lk).release_cached() <= 1
        await c.barrier()
        await settle(lk)
        await c.barrier()


async def check_mismatch_under_deadline(c: asynclock.Coordinator) -> None:
    """A semaphore made with another `n` than its home rank's: MismatchError,
    with or without a deadline (not an unpacking error)."""
    sem = c.semaphore(homed("mm", 0, c.size), 2 if c.rank == 0 else 3)
    if c.rank != 0:
        for timeout in (None, 0, 1e-6, 5):
            await expect_async(MismatchError, "home rank 0 has 2",
                               lambda t=timeout: sem.acquire(timeout=t))
        assert not sem.pending and sem.statistics().timed_out == 0, sem.statistics()
    await c.barrier()


async def check_long_point_names(c: asynclock.Coordinator) -> None:
    """Consistency points whose names differ only after the part the mismatch
    error carries: the error still tells them apart, on every rank."""
    common = "checkpoint-shards-written-for-step-"
    name = common + str(c.rank % 2)
    exc = await expect_async(MismatchError, "ranks reached different consistency points",
                             lambda: c.consistency_point(name).wait(timeout=30))
    crcs = {f"{zlib.crc32((common + str(r % 2)).encode()):08x}" for r in range(c.size)}
    assert len(crcs) == 2 and all(crc in str(exc) for crc in crcs), exc
    await c.consistency_point("after-long-names")  # the next point works


async def main() -> None:
    async with asynclock.start() as c:
        for kind in LOCK_KINDS:
            lk = partial(homed_lock, c, kind)
            with anyio.fail_after(60):
                await check_timeout_zero(c, lk("zero", c.size - 1))
                await check_timeout_zero(c, lk("zero0", 0))
            report(c.rank, f"timeout_zero_{kind}")
            with anyio.fail_after(60):
                await check_deadline_before_answer(c, lk("short", c.size - 1))
            report(c.rank, f"deadline_before_answer_{kind}")
        with anyio.fail_after(60):
            await check_mismatch_under_deadline(c)
        report(c.rank, "mismatch_under_deadline")
        with anyio.fail_after(60):
            await check_long_point_names(c)
        report(c.rank, "long_point_names")
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
