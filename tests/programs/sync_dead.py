"""A rank that stops answering (SIGSTOP: alive to the launcher, dead to MPI
peers) while it holds a lock, is a lock's home, or is awaited: every other
rank gets a clear error naming it within the stall + probe deadline, and
once it resumes the job finishes cleanly (nothing was left stuck).

Run with ASYNCLOCK_SYNC_STALL_S=0.3 ASYNCLOCK_SYNC_PROBE_S=1. Usage:
    sync_dead.py [--trio] WORKDIR
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from _common import report
from sync_common import homed, run_or_abort, settle

import asynclock
from asynclock import CollectiveTimeout, RankFailedError

VICTIM = 1
DEADLINE = 0.3 + 1.0 + 3.0  # stall + probe + slack for a loaded machine


async def expect(c: asynclock.Coordinator, label: str, exc_type: type[BaseException],
                 needle: str, fn: Callable[[], Awaitable[Any]]) -> None:
    t0 = time.monotonic()
    try:
        await fn()
    except exc_type as exc:
        elapsed = time.monotonic() - t0
        assert needle in str(exc), f"{label}: {exc}"
        assert elapsed < DEADLINE, f"{label}: took {elapsed:.2f} s"
        report(c.rank, label, f"{elapsed:.2f}s {exc}")
        return
    raise AssertionError(f"{label}: no {exc_type.__name__}")


async def survivor(c: asynclock.Coordinator, held: Any) -> None:
    """While the victim is stopped: every kind of wait on it must fail clearly."""
    home_dead = c.lock(homed("home-dead", VICTIM, c.size))
    ev = c.event(homed("ev-dead", VICTIM, c.size))
    async with anyio.create_task_group() as tg:
        tg.start_soon(expect, c, "holder_dead", RankFailedError, f"holder rank {VICTIM}",
                      held.acquire)
        tg.start_soon(expect, c, "consistency_dead", RankFailedError, f"[{VICTIM}]",
                      c.consistency_point("dead-cp").wait)
        if c.rank == 0:
            tg.start_soon(expect, c, "home_dead_timeout", CollectiveTimeout,
                          f"home rank {VICTIM} did not answer",
                          lambda: home_dead.acquire(timeout=0.3))
            tg.start_soon(expect, c, "home_dead", RankFailedError,
                          f"home rank {VICTIM} did not answer", home_dead.acquire)
            tg.start_soon(expect, c, "event_home_dead", RankFailedError,
                          f"home rank {VICTIM}", ev.wait)
        if c.rank == 2:
            tg.start_soon(expect, c, "sequential_dead", RankFailedError, f"rank {VICTIM},",
                          c.sequential("seq-dead").enter)


async def stopped(pid: int) -> None:
    """Wait until the victim is really stopped (state T in /proc), not just about to."""
    stat = Path(f"/proc/{pid}/stat")
    with anyio.fail_after(20):
        while stat.read_text().rsplit(")", 1)[1].split()[0] != "T":
            await anyio.sleep(0.005)


async def main() -> None:
    async with asynclock.start() as c:
        pids = await c.allgather_object(os.getpid())
        held = c.lock(homed("held", 0, c.size))
        survivors_done = c.event(homed("survivors-done", 0, c.size))
        if c.rank == 0:
            await c.sequential("seq-dead").enter()
            c.sequential("seq-dead").leave()
        if c.rank == VICTIM:
            await held.acquire()
        await c.barrier()
        if c.rank == VICTIM:
            os.kill(os.getpid(), signal.SIGSTOP)  # ... until rank 0 sends SIGCONT
            held.release()
            await c.consistency_point("dead-cp")
            if c.size > 2:
                async with c.sequential("seq-dead"):
                    pass
        else:
            await stopped(pids[VICTIM])
            await survivor(c, held)
            if c.rank != 0:
                survivors_done.set()
            else:
                if c.size > 2:
                    await survivors_done.wait()
                os.kill(pids[VICTIM], signal.SIGCONT)
        await c.barrier()
        await settle(held)
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
