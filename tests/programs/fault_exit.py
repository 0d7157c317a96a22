"""A short clean job: the watchdog must not hold up shutdown or MPI_Finalize.

The test runs it with a very long ASYNCLOCK_HEARTBEAT_S, so any wait for the
next heartbeat tick would show as a slow shutdown or a job timeout.
`--sync`: Horovod-style init()/run_sync; `--forget`: never call shutdown()
(the watchdog's atexit hook must stop it before MPI_Finalize).
"""

from __future__ import annotations

import sys
import time

import numpy as np
from _common import report, run

import asynclock


def check_closed(c: asynclock.Coordinator, seconds: float) -> None:
    assert c.lowlevel.watchdog is not None and not c.lowlevel.watchdog.statistics().running
    assert seconds < 5.0, f"shutdown took {seconds:.2f} s"
    report(c.rank, "done", f"shutdown {seconds:.3f} s")


async def main() -> None:
    async with asynclock.start() as c:
        assert ((await c.allreduce(np.ones(2))) == c.size).all()
        assert c.lowlevel.watchdog is not None and c.lowlevel.watchdog.statistics().running
        t0 = time.perf_counter()
    check_closed(c, time.perf_counter() - t0)


def main_sync() -> None:
    c = asynclock.init()
    assert (c.lowlevel.run_sync(c.allreduce, np.ones(2)) == c.size).all()
    if "--forget" in sys.argv:
        report(c.rank, "done", "leaving without shutdown()")
        return
    t0 = time.perf_counter()
    asynclock.shutdown()
    check_closed(c, time.perf_counter() - t0)


if "--sync" in sys.argv:
    main_sync()
else:
    run(main)
