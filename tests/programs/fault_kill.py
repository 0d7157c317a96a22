"""Rank 1 kills (`--signal KILL`) or freezes (`--signal STOP`) itself in the
middle of a collective that every rank has started; `--signal GIL` freezes
it from inside: a C call that holds the GIL, so no thread of it runs Python
(it must dump its own stacks before the peers give up on it).

The survivors must exit non-zero, naming rank 1, whether or not the
launcher cleans up (a frozen rank looks alive to every launcher).
"""

from __future__ import annotations

import ctypes
import os
import signal

import numpy as np
from _common import report, run
from fault_common import announce_pid, arg

import asynclock

VICTIM = 1
HOW = arg("--signal", "KILL")


def hold_the_gil(seconds: int) -> None:
    """libc's sleep through ctypes.PyDLL, which keeps the GIL for the call."""
    ctypes.PyDLL(None).sleep(seconds)


async def main() -> None:
    async with asynclock.start() as c:
        announce_pid(c.rank)
        assert ((await c.allreduce(np.ones(4))) == c.size).all()
        report(c.rank, "warmed")
        # every rank has written its line before the victim dies: a launcher that kills the
        # survivors at once (MPICH's Hydra) could otherwise cut one off before it printed
        await c.barrier(name="warmed")
        handle = c.allreduce_async(np.ones(1 << 18), name="step")  # 2 MiB: a data stage
        if c.rank == VICTIM and HOW == "GIL":
            hold_the_gil(60)
        elif c.rank == VICTIM:
            os.kill(os.getpid(), getattr(signal, "SIG" + HOW))
        await handle
        await c.barrier(name="after")  # the victim can never get here
        report(c.rank, "unexpected")


run(main)
