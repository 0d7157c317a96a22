"""The spin of a channel learns from whole ops, not from their header rounds.

    adaptive_spin.py [--trio]

A staged allreduce (too big to ride inline; at 512 KiB also above what a node's
ranks fold through their shared segment in the C round) is a header round and then
a data allreduce, both from one call. Its data allreduce takes several times its
header round, so a record of headers alone stands well apart from the calls' own
times, of which the Python around the engine (more of it on trio) is a small share.
The recorded times must be those of the whole calls; and calls that wait for a late
rank must leave the channel at the default spin, not burn a core.
"""

from __future__ import annotations

import statistics
import time

import anyio
import numpy as np
from _common import report, run

import asynclock

N = (512 << 10) // 4


async def timed_calls(c: asynclock.Coordinator, n: int, late_s: float = 0.0) -> list[float]:
    a, wall = np.ones(N, np.float32), []
    for _ in range(n):
        if late_s and c.rank == 1:
            await anyio.sleep(late_s)
        t0 = time.perf_counter()
        await c.allreduce_(a)
        wall.append(time.perf_counter() - t0)
    return wall


async def main() -> None:
    async with asynclock.start() as c:
        lane, engine = c.lowlevel.user_lane, c.lowlevel.engine
        await timed_calls(c, 8)
        wall = await timed_calls(c, 8)
        recorded = list(lane.recent)
        assert len(recorded) == 8, recorded
        ratio = statistics.median(recorded) / statistics.median(wall)
        assert ratio > 0.6, f"recorded {recorded} against calls of {wall}: headers only?"
        await timed_calls(c, 8, late_s=0.005)
        if c.rank == 0:  # rank 0 waited ~5 ms in each call: no point spinning that long
            assert engine.spin_for(lane) == engine.policy.spin_s, engine.spin_for(lane)
        report(c.rank, "done", f"median recorded/call {ratio:.2f}")


if __name__ == "__main__":
    run(main)
