"""Rank 1 kills (`--signal KILL`) or freezes (`--signal STOP`) itself in the
middle of a collective that every rank has started.

The survivors must exit non-zero, naming rank 1, whether or not the
launcher cleans up (a frozen rank looks alive to every launcher).
"""

from __future__ import annotations

import os
import signal

import numpy as np
from _common import report, run
from fault_common import announce_pid, arg

import asynclock

VICTIM = 1
SIGNAL = getattr(signal, "SIG" + arg("--signal", "KILL"))


async def main() -> None:
    async with asynclock.start() as c:
        announce_pid(c.rank)
        assert ((await c.allreduce(np.ones(4))) == c.size).all()
        report(c.rank, "warmed")
        handle = c.allreduce_async(np.ones(1 << 18), name="step")  # 2 MiB: a data stage
        if c.rank == VICTIM:
            os.kill(os.getpid(), SIGNAL)
        await handle
        await c.barrier(name="after")  # the victim can never get here
        report(c.rank, "unexpected")


run(main)
