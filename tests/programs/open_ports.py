"""What a `horovodrun --gloo` job's ranks listen on once asynclock has started.

    open_ports.py DIR     (under `horovodrun --gloo`; tests/test_network_trust.py)

Every rank starts asynclock, runs calls whose headers, agreement rounds and
messages travel on the mesh (allreduce, broadcast_object, a lock, a barrier),
then writes DIR/rank.<r>: its pid, the inodes of the sockets Horovod's gloo
opened in `hvd.init()`, and whether mpi4py's MPI module was loaded. It waits
for DIR/go (the test reads the ranks' listeners meanwhile), then finishes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import anyio
import numpy as np
from _common import report, run

import asynclock

GO_WAIT_S = 60.0


async def main() -> None:
    folder = Path(sys.argv[1])
    async with asynclock.start() as c:
        got = await c.allreduce(np.ones(3) * (c.rank + 1))
        assert np.array_equal(got, np.ones(3) * sum(range(1, c.size + 1))), got
        assert await c.broadcast_object({"from": c.rank}, root=0) == {"from": 0}
        async with c.lock("ports"):
            await anyio.sleep(0.01)
        await c.barrier()
        gloo = c.backend._gloo
        inodes = sorted(int(what[8:-1]) for what in (gloo.opened.values() if gloo else ()))
        state = {"pid": os.getpid(), "horovod": inodes, "mpi4py": "mpi4py.MPI" in sys.modules}
        (folder / f"rank.{c.rank}.tmp").write_text(json.dumps(state))
        (folder / f"rank.{c.rank}.tmp").rename(folder / f"rank.{c.rank}")
        report(c.rank, "started")
        deadline = time.monotonic() + GO_WAIT_S
        while not (folder / "go").exists() and time.monotonic() < deadline:
            await anyio.sleep(0.02)
        await c.barrier()
    report(c.rank, "done")


run(main)
