"""Rank 1 is late for a collective; the waiting ranks must say so.

Default: with a low ASYNCLOCK_STALL_WARN_S, every waiting rank logs
`missing ranks [1]` and the operation; rank 1 only joins once each of
them has sent it the report text (ordering by messages, not by sleeps).
`--abort`: rank 1 never joins; ASYNCLOCK_STALL_ABORT_S must stop every rank.
"""

from __future__ import annotations

import logging
import sys

import anyio
import numpy as np
from _common import report, run
from fault_common import announce_pid
from mpi4py import MPI

import asynclock

LATE = 1
TAG = 77
ABORT = "--abort" in sys.argv


class StallCatcher(logging.Handler):
    """Collects the watchdog's stall reports on this rank."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        logging.getLogger("asynclock.watchdog").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.texts.append(record.getMessage())

    async def first(self, timeout: float = 60) -> str:
        with anyio.fail_after(timeout):
            while not self.texts:
                await anyio.sleep(0.01)
        return self.texts[0]


def check_text(text: str, rank: int) -> None:
    for needle in (f"asynclock[rank {rank}]: stall: waiting", "missing ranks [1]",
                   "allreduce(sum) float32[2, 3] #", "on lane user name='late'",
                   "rank 1: issued up to #"):
        assert needle in text, f"{needle!r} not in {text!r}"


async def waiting_rank(c: asynclock.Coordinator) -> None:
    catcher = StallCatcher()
    handle = c.allreduce_async(np.ones((2, 3), np.float32), name="late")
    text = await catcher.first()
    check_text(text, c.rank)
    report(c.rank, "stall_reported")
    MPI.COMM_WORLD.send(text, dest=LATE, tag=TAG)
    assert ((await handle) == c.size).all()


async def late_rank(c: asynclock.Coordinator) -> None:
    if ABORT:
        await anyio.Event().wait()  # never joins: the job must be stopped for us
    for peer in range(c.size):
        if peer != LATE:
            text = await anyio.to_thread.run_sync(lambda p=peer: MPI.COMM_WORLD.recv(
                source=p, tag=TAG))
            check_text(text, peer)
    report(c.rank, "peers_reported")
    assert ((await c.allreduce(np.ones((2, 3), np.float32), name="late")) == c.size).all()


async def main() -> None:
    async with asynclock.start() as c:
        announce_pid(c.rank)
        await c.barrier()
        await (late_rank(c) if c.rank == LATE else waiting_rank(c))
        report(c.rank, "unexpected" if ABORT else "done")


run(main)
