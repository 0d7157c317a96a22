"""A bulk data stage waited for in the wait thread takes no core while its peer is late.

    bulk_wait_cpu.py [--trio] [--fp16] [--bcast]

Run with ASYNCLOCK_NODE_WINDOW=0 (the stage goes over MPI, not the node window) and
ASYNCLOCK_SPIN_US=0. The last rank issues a 4 MiB allreduce (1 MiB with --on-loop;
or a 16-bit one: the ring, or a broadcast), tells rank 0 through a plain MPI message,
then blocks its
own loop for LATE_S, so its poller issues its data stage only then. Rank 0 issues
the same call at once: its header round finds every header already sent and
completes, and its data stage waits in the wait thread until the late rank
issues. Rank 0's process CPU over that call must be a small share of the wall
time; a wait thread sitting in a blocking MPI call keeps a core busy throughout.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from _common import report, run
from mpi4py import MPI

import asynclock

LATE_S = 1.5
# --on-loop: inside MPICH's loop band (`mpi.MPICH_LOOP_HI`), from the wait thread's size
N = (1 << 20) // 4 if "--on-loop" in sys.argv else (4 << 20) // 4
MAX_CPU_SHARE = 0.3


def payload(rank: int) -> np.ndarray:
    if "--fp16" in sys.argv:
        return np.full(N, rank + 1, np.float16)
    return np.full(N, rank + 1, np.float32)


async def main() -> None:
    world = MPI.COMM_WORLD
    async with asynclock.start() as c:
        last = c.size - 1
        bcast = "--bcast" in sys.argv
        data = payload(c.rank)
        call = (lambda: c.broadcast_(data, root=0)) if bcast else (lambda: c.allreduce_(data))
        if c.rank == last:
            handle = (c.broadcast_async_(data, root=0) if bcast else c.allreduce_async_(data))
            world.send(1, dest=0, tag=11)
            time.sleep(LATE_S)  # the loop blocked on purpose: the data stage waits
            await handle
        elif c.rank == 0:
            world.recv(source=last, tag=11)
            wall0, cpu0 = time.perf_counter(), time.process_time()
            await call()
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            assert wall > 0.5 * LATE_S, f"the call took {wall:.2f} s: the peer was not late"
            assert cpu < MAX_CPU_SHARE * wall, (
                f"rank 0 used {cpu:.2f} s of CPU in a {wall:.2f} s wait for a late peer")
        else:
            await call()
        expected = 1 if bcast else sum(range(1, c.size + 1))
        assert (data == expected).all(), data[:4]
        if "--on-loop" in sys.argv:
            assert c.statistics().thread_waits == 0, c.statistics()
        else:
            assert c.statistics().thread_waits >= 1
        report(c.rank, "done")


if __name__ == "__main__":
    run(main)
