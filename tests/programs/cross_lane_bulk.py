"""Regression: bulk data stages on two lanes, reached in opposite orders on different ranks.

    cross_lane_bulk.py [--trio]

Each lane orders its own collectives, but two lanes are not ordered with
respect to each other. Bulk stages (>= 1 MiB) run blocking in a wait thread;
when every lane shared one thread, rank 0 blocked in lane A's allreduce
while rank 1 blocked in lane B's, and neither could finish (the stall
report ended the job). Each lane now has its own wait thread. Here the
world lane and a process set's lane (all ranks) allreduce 8 MiB concurrently
(from `WINDOW_LOOP_HI` on, so none runs on the loop instead), and alternate
rounds delay a different rank on each lane, so the arrival order differs
across ranks. Removing the set ends its thread.
"""

from __future__ import annotations

import threading

import anyio
import numpy as np
from _common import report, run

import asynclock
from asynclock._core.transports.mpi import WINDOW_LOOP_HI

ROUNDS = 12
N = WINDOW_LOOP_HI // 4


async def one_round(c: asynclock.Coordinator, api: object, i: int) -> None:
    async def lane(call: object, late_rank: int, value: float) -> None:
        if i % 2 and c.rank == late_rank:
            await anyio.sleep(0.02)
        got = await call(np.full(N, value, np.float32))  # type: ignore[operator]
        assert (got == value * c.size).all(), (i, late_rank)

    async with anyio.create_task_group() as tg:
        tg.start_soon(lane, c.allreduce, 0, 1.0)
        tg.start_soon(lane, api.allreduce, c.size - 1, 2.0)  # type: ignore[attr-defined]


def wait_threads() -> int:
    return sum(t.name == "asynclock-wait" for t in threading.enumerate())


async def main() -> None:
    async with asynclock.start() as c:
        subset = await c.process_set(range(c.size))
        for i in range(ROUNDS):
            await one_round(c, subset.api, i)
        waits = c.statistics().thread_waits
        assert waits >= 2 * ROUNDS, f"only {waits} bulk stages went through wait threads"
        assert wait_threads() == 2, wait_threads()  # the world's lane and the set's
        await c.remove_process_set(subset)
        assert wait_threads() == 1, f"{wait_threads()} wait threads after the set was removed"
        report(c.rank, "done", f"{ROUNDS} rounds, {waits} thread waits")


if __name__ == "__main__":
    run(main)
