"""How long `asynclock.start()` takes on each rank (bench/crowd.py).

    start_time.py [--horovod-first DIR] [TOKEN]

Every rank times `asynclock.start()`, checks one allreduce, and reports
`start <seconds>` and how many connections its meshes refused (`refused N`).
The time includes Horovod's init; with --horovod-first a rank initialises
Horovod first, writes DIR/horovod.<rank> and waits for DIR/go, so the time is
asynclock's own start-up (its meshes, the coordinator) on a Horovod that is up.
TOKEN only marks the job's command lines.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import anyio
import numpy as np
from _common import report, run

import asynclock

GO_WAIT_S = 60.0


async def horovod_first(folder: Path) -> None:
    import horovod.torch as hvd

    hvd.init()
    (folder / f"horovod.{hvd.rank()}").touch()
    deadline = time.monotonic() + GO_WAIT_S
    while not (folder / "go").exists() and time.monotonic() < deadline:
        await anyio.sleep(0.01)


async def main() -> None:
    if "--horovod-first" in sys.argv:
        await horovod_first(Path(sys.argv[sys.argv.index("--horovod-first") + 1]))
    begun = time.perf_counter()
    async with asynclock.start() as c:
        took = time.perf_counter() - begun
        got = await c.allreduce(np.arange(3.0) + c.rank)
        assert np.array_equal(got, sum(np.arange(3.0) + r for r in range(c.size))), got
        refused = getattr(c.backend, "refused_connections", lambda: 0)()
        report(c.rank, "start", f"{took:.3f}")
        report(c.rank, "refused", str(refused))
        await c.barrier()
    report(c.rank, "done")


run(main)
