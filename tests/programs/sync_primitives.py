"""Condition, Event, sequential sections and consistency points across ranks.

Usage: sync_primitives.py [--trio] WORKDIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
from _common import report
from sync_common import append, homed, lines, run_or_abort, settle, until, until_async, workdir

import asynclock
from asynclock import CollectiveTimeout, MismatchError


async def _cond_waiters(cond: Any, n: int) -> None:
    async def ok() -> bool:
        return bool((await cond.info()).condition_waiters == n)
    await until_async(ok, f"{n} condition waiters")


async def check_condition_notify(c: asynclock.Coordinator, log: Path) -> None:
    """notify(2) wakes exactly 2 waiters (any ranks), notify_all the rest."""
    cond = c.condition(homed("cond", c.size - 1, c.size))
    per_rank = 2
    total = per_rank * c.size

    async def waiter(k: int) -> None:
        async with cond:
            await cond.wait()
            assert cond.locked()
            append(log, f"{c.rank}.{k}")

    async with anyio.create_task_group() as tg:
        for k in range(per_rank):
            tg.start_soon(waiter, k)
        await c.barrier()
        if c.rank == 0:
            await _cond_waiters(cond, total)
            async with cond:
                cond.notify(2)
            await _cond_waiters(cond, total - 2)
            await settle(cond)
            assert len(lines(log)) == 2, lines(log)
        await c.barrier()
        if c.rank == c.size - 1:
            async with cond:
                cond.notify_all()
        await until(lambda: len(lines(log)) == total, "all woken")
    await c.barrier()
    assert sorted(lines(log)) == sorted(f"{r}.{k}" for r in range(c.size)
                                        for k in range(per_rank))


async def check_condition_wait_for(c: asynclock.Coordinator, state: Path) -> None:
    """wait_for re-checks its predicate under the lock after every notify."""
    cond = c.condition(homed("waitfor", 0, c.size))
    if c.rank == 0:
        state.write_text("0")
    await c.barrier()
    if c.rank == c.size - 1:
        async with cond:
            got = await cond.wait_for(lambda: int(state.read_text()) >= 2 * (c.size - 1))
            assert got and cond.locked()
    else:
        for _ in range(2):
            async with cond:
                state.write_text(str(int(state.read_text()) + 1))
                cond.notify_all()
            await anyio.sleep(0)
    await c.barrier()
    assert int(state.read_text()) == 2 * (c.size - 1)


async def check_condition_cancel(c: asynclock.Coordinator) -> None:
    """Regression: a cancelled condition waiter takes the lock back before leaving,
    and the condition no longer counts it."""
    cond = c.condition(homed("ccancel", 0, c.size))
    if c.rank == c.size - 1:
        held_after_cancel: list[bool] = []

        async def waiter() -> None:
            async with cond:
                try:
                    await cond.wait()
                finally:
                    held_after_cancel.append(cond.locked())

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await _cond_waiters(cond, 1)
            tg.cancel_scope.cancel()
        assert held_after_cancel == [True], held_after_cancel
        assert cond.statistics().cancelled == 1
        await _cond_waiters(cond, 0)
        await settle(cond)
    await c.barrier()


async def check_event(c: asynclock.Coordinator) -> None:
    """Set on the last rank, awaited by several tasks on every rank."""
    ev = c.event(homed("ev", 0, c.size))
    woken: list[int] = []

    async def waiter(k: int) -> None:
        await ev.wait()
        woken.append(k)

    async with anyio.create_task_group() as tg:
        for k in range(3):
            tg.start_soon(waiter, k)
        await until(lambda: ev.statistics().tasks_waiting == 3, "waiting")
        assert not woken and not ev.is_set()
        await c.barrier()
        if c.rank == c.size - 1:
            ev.set()
    assert sorted(woken) == [0, 1, 2]
    await until(ev.is_set, "is_set everywhere")
    await ev.wait()  # already set: returns at once
    await c.barrier()


async def check_event_timeout_cancel(c: asynclock.Coordinator) -> None:
    """Timeout names the event; a cancelled waiter is withdrawn at the home rank."""
    ev = c.event(homed("evt", c.size - 1, c.size))
    try:
        await ev.wait(timeout=0.1)
    except CollectiveTimeout as exc:
        assert ev.name in str(exc), exc
    else:
        raise AssertionError("event wait did not time out")
    with anyio.move_on_after(0.05):
        await ev.wait()
    assert ev.statistics().cancelled == 1 and ev.statistics().tasks_waiting == 0
    await c.barrier()
    if c.rank == 0:
        ev.set()
    await ev.wait()
    await c.barrier()


async def check_sequential(c: asynclock.Coordinator, log: Path) -> None:
    """Rounds run rank 0, 1, ..., size-1; each rank's 2 tasks take 2 rounds."""
    seq = c.sequential("seq")

    async def turn() -> None:
        async with seq as rnd:
            for _ in range(3):
                await anyio.sleep(0)
            append(log, f"{rnd}:{c.rank}")

    async with anyio.create_task_group() as tg:
        for _ in range(2):
            tg.start_soon(turn)
    await c.barrier()
    expected = [f"{g}:{r}" for g in range(2) for r in range(c.size)]
    assert lines(log) == expected, lines(log)


async def check_sequential_cancel(c: asynclock.Coordinator, log: Path) -> None:
    """Regression: a rank cancelled before its turn gives it up; the ring goes on."""
    seq = c.sequential("seq-cancel")
    skipper = 1
    if c.rank == skipper:  # rank 0 enters only after the barrier: no turn yet
        with anyio.move_on_after(0):
            await seq.enter()
        assert seq.statistics().skipped == 1
    await c.barrier()
    if c.rank != skipper:
        async with seq as rnd:
            append(log, f"{rnd}:{c.rank}")
    async with seq as rnd:  # round 1: everyone
        append(log, f"{rnd}:{c.rank}")
    await c.barrier()
    expected = [f"0:{r}" for r in range(c.size) if r != skipper]
    expected += [f"1:{r}" for r in range(c.size)]
    assert lines(log) == expected, lines(log)


async def check_consistency_point(c: asynclock.Coordinator, wd: Path) -> None:
    """Every rank writes its shard, then the point; then every shard is readable."""
    for step in range(3):
        (wd / f"shard-{step}-{c.rank}").write_text(f"{step}:{c.rank}")
        await c.consistency_point("shards-written")
        for r in range(c.size):
            assert (wd / f"shard-{step}-{r}").read_text() == f"{step}:{r}"
        await c.consistency_point("shards-read").wait(timeout=30)
    assert c.consistency_point("shards-written").statistics().passed == 3


async def check_consistency_mismatch(c: asynclock.Coordinator) -> None:
    """Ranks at different points all raise the same MismatchError naming each."""
    name = "point-a" if c.rank == 0 else "point-b"
    try:
        await c.consistency_point(name)
    except MismatchError as exc:
        text = str(exc)
        assert "rank 0: 'point-a' round 0" in text and "rank 1: 'point-b' round 0" in text, text
    else:
        raise AssertionError("mismatched consistency points passed")
    await c.barrier()


async def main() -> None:
    wd = workdir()
    async with asynclock.start() as c:
        await check_condition_notify(c, wd / "cond.log")
        report(c.rank, "condition_notify")
        await check_condition_wait_for(c, wd / "waitfor.state")
        report(c.rank, "condition_wait_for")
        await check_condition_cancel(c)
        report(c.rank, "condition_cancel")
        await check_event(c)
        report(c.rank, "event")
        await check_event_timeout_cancel(c)
        report(c.rank, "event_timeout_cancel")
        await check_sequential(c, wd / "seq.log")
        report(c.rank, "sequential")
        await check_sequential_cancel(c, wd / "seqc.log")
        report(c.rank, "sequential_cancel")
        await check_consistency_point(c, wd)
        report(c.rank, "consistency_point")
        await check_consistency_mismatch(c)
        report(c.rank, "consistency_mismatch")
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
