"""Rank program: a few training-like steps recorded on the timeline and in metrics.

Each step: forward compute, an allreduce started before "backward" compute
(so communication overlaps compute), a lock-wait-like barrier and an
optimizer slice. The engine hook records every collective. Needs
ASYNCLOCK_TIMELINE. `--die`: after the steps, rank 1 opens an async slice
and SIGKILLs itself; rank 0 blocks in a barrier that can never complete
(the MPI launcher, or the test's timeout, kills it).
"""

from __future__ import annotations

import os
import signal
import sys

import numpy as np
from _common import report, run

import asynclock
from asynclock import metrics, timeline

STEPS = 4
GRAD = 200_000  # float32: 800 kB per step


def work(n: int) -> float:
    """Deterministic CPU work (no sleeps: the amount, not the time, is fixed)."""
    a = np.arange(n, dtype=np.float64)
    return float(np.sqrt(a * a + 1.0).sum())


async def step(coord: asynclock.Coordinator, rec: metrics.StepRecorder, i: int) -> None:
    grad = np.full(GRAD, coord.rank + i, np.float32)
    with rec.compute("forward"):
        work(300_000)
    with rec.comm("allreduce", nbytes=grad.nbytes):
        handle = coord.allreduce_async_(grad, name=f"grad{i}")
        with rec.compute("backward"):
            work(600_000)
        await handle
    want = sum(r + i for r in range(coord.size))
    assert (grad == want).all(), f"step {i}: {grad[:3]} != {want}"
    with rec.lock_wait("barrier"):
        await coord.barrier(name=f"step{i}")
    with rec.compute("optimizer", cat="optimizer"):
        work(100_000)


async def die(coord: asynclock.Coordinator) -> None:
    await coord.barrier(name="before-kill")  # both ranks have written every step
    report(coord.rank, "before_kill")
    if coord.rank == 1:
        timeline.begin("doomed", cat="comm")
        os.kill(os.getpid(), signal.SIGKILL)
    with timeline.span("waiting for a dead peer", cat="sync"):
        await coord.barrier(name="never")


def check_metrics(coord: asynclock.Coordinator, rec: metrics.StepRecorder) -> None:
    ms = list(rec.history)
    assert [m.step for m in ms] == list(range(STEPS)), ms
    for m in ms:
        assert m.bytes_reduced == GRAD * 4, m
        assert m.max_buckets_in_flight == 1, m
        assert 0 < m.comm_s <= m.step_time_s and 0 < m.compute_s <= m.step_time_s, m
        assert 0 <= m.exposed_comm_s <= m.comm_s and 0 <= m.overlap_pct <= 100, m
        assert m.lock_wait_s > 0, m
    report(coord.rank, "metrics", f"exposed={ms[-1].exposed_fraction:.3f}")


async def main() -> None:
    async with asynclock.start() as coord:
        assert timeline.attach(coord.lowlevel.engine), "ASYNCLOCK_TIMELINE is not set"
        rec = metrics.recorder()
        for i in metrics.progress(range(STEPS), coord, mininterval=0):
            await step(coord, rec, i)
        check_metrics(coord, rec)
        if "--die" in sys.argv:
            await die(coord)
        result = await timeline.finish(coord)
        if coord.rank == 0:
            assert result is not None and result.ranks == tuple(range(coord.size)), result
            report(0, "merged", str(result.path))
        report(coord.rank, "done")


if __name__ == "__main__":
    run(main)
