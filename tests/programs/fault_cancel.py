"""Cancellation torture: awaits of collectives (and cross-rank locks)
cancelled at random moments, with random skew between ranks.

Each iteration starts one operation chosen by a seed shared by all ranks
(collectives must be issued in the same order everywhere); how and when its
await is cancelled comes from a per-rank seed: `move_on_after` with a tiny
random timeout, a cancel after a random number of checkpoints, or a scope
cancelled before the await. A cancelled collective must still complete in
the background with the right value (checked after each block's drain), the
next results must be right, and at the end nothing is in flight
(`--no-locks`: collectives only). Ranks
agree every block (allreduce of the minimum count) on when to stop, so
every rank runs the same number of iterations.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
from _common import report, run
from fault_common import arg

import asynclock

KINDS = ("allreduce", "allreduce_", "broadcast", "allgather", "barrier", "lock")
BLOCK = 50

Check = Callable[[Any], None]


def start(c: asynclock.Coordinator, kind: str, n: int, it: int) -> tuple[Any, Check]:
    """Start a collective; return its handle and a check of its result."""
    size, mine = c.size, np.full(n, float(it + c.rank))
    if kind == "allreduce":
        want = float(it * size + size * (size - 1) // 2)
        return c.allreduce_async(mine), lambda v: _equal(v, np.full(n, want))
    if kind == "allreduce_":
        want = float(it * size + size * (size - 1) // 2)
        return c.allreduce_async_(mine), lambda v: _equal(v, np.full(n, want)) or _same(v, mine)
    if kind == "broadcast":
        root = it % size
        return c.broadcast_async(mine, root), lambda v: _equal(v, np.full(n, float(it + root)))
    if kind == "allgather":
        want = np.concatenate([np.full(n, float(it + r)) for r in range(size)])
        return c.allgather_async(mine), lambda v: _equal(v, want)
    return c.barrier_async(), lambda v: _equal(v, None)


def _equal(got: Any, want: Any) -> None:
    ok = got is None and want is None or np.array_equal(got, want)
    assert ok, f"wrong result after cancellations: {got!r:.200} != {want!r:.200}"


def _same(got: Any, obj: Any) -> None:
    assert got is obj, "in-place result is not the caller's array"


async def cancelled_await(make: Callable[[], Awaitable[Any]],
                          rng: random.Random) -> tuple[bool, Any]:
    """Await `make()` under a randomly timed cancellation; (cancelled, value)."""
    mode, out = rng.randrange(3), [None]

    async def body() -> None:
        out[0] = await make()

    if mode == 0:
        with anyio.move_on_after(rng.uniform(0, 300e-6)) as scope:
            await body()
    elif mode == 1:
        scope = anyio.CancelScope()

        async def waiter() -> None:
            with scope:
                await body()

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            for _ in range(rng.randrange(12)):
                await anyio.sleep(0)
            scope.cancel()
    else:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await body()
    return scope.cancelled_caught, out[0]


async def lock_step(c: asynclock.Coordinator, rng: random.Random) -> bool:
    """Take the shared lock under a random cancellation; hold it briefly."""
    lock = c.lock("torture")

    async def hold() -> None:
        async with lock:
            await anyio.sleep(0)

    cancelled, _ = await cancelled_await(hold, rng)
    return cancelled


class Torture:
    def __init__(self, c: asynclock.Coordinator, seed: int) -> None:
        self.c, self.seed = c, seed
        self.mine = random.Random(seed * 7919 + c.rank)
        self.landed = {"collective": 0, "lock": 0}
        self.pending: list[tuple[Any, Check]] = []
        self.iterations = 0
        self.locks = hasattr(c, "lock") and "--no-locks" not in sys.argv

    async def step(self) -> None:
        it = self.iterations = self.iterations + 1
        shared = random.Random(self.seed * 1_000_003 + it)
        kind = shared.choice(KINDS if self.locks else KINDS[:-1])
        sizes = [1, 16, 3000] + ([200_000] if shared.random() < 0.1 else [])  # big: wait thread
        n = shared.choice(sizes)
        if self.mine.random() < 0.3:
            await anyio.sleep(self.mine.uniform(0, 300e-6))  # skew: peers wait on us
        if kind == "lock":
            self.landed["lock"] += await lock_step(self.c, self.mine)
            return
        handle, check = start(self.c, kind, n, it)
        cancelled, value = await cancelled_await(lambda: handle, self.mine)
        if cancelled:
            self.landed["collective"] += 1
            self.pending.append((handle, check))
        else:
            check(value)

    async def settle(self) -> None:
        """Every cancelled collective completed anyway, with the right value."""
        await self.c.drain(timeout=60)
        for handle, check in self.pending:
            assert handle.done(), f"{handle!r} not done after drain"
            check(handle.result())
        self.pending.clear()
        if self.locks:
            st = self.c.lock("torture").statistics()
            assert not st.locked_here and st.tasks_waiting == 0, st


async def main() -> None:
    target, seed = int(arg("--count", "1000")), int(arg("--seed", "1"))
    async with asynclock.start() as c:
        t = Torture(c, seed)
        while True:
            for _ in range(BLOCK):
                await t.step()
            await t.settle()
            mine = np.array([float(sum(t.landed.values()))])
            if (await c.allreduce(mine, "min"))[0] >= target:
                break
        if t.locks:
            async with c.lock("torture"):  # still usable: no permit leaked
                pass
            report(c.rank, "locks_tortured", f"{t.landed['lock']} lock cancellations")
        total = await c.allreduce(np.ones(3))
        assert (total == c.size).all()
        await c.drain(timeout=60)
        stats = c.statistics()
        assert stats.in_flight == 0 and stats.issued == stats.completed, stats
        assert stats.detached > 0, stats
        report(c.rank, "done", f"{t.iterations} iterations, cancellations landed "
                               f"{t.landed}, detached {stats.detached}, issued {stats.issued}")


run(main)
