"""A job on asynclock's TCP mesh while foreign clients try to join it.

    trust_mesh.py MARKER     (under `horovodrun --gloo`; tests/test_network_trust.py)

The test sets ASYNCLOCK_MESH_HOLD, so the ranks stop while their mesh listeners
are open and the test's clients reach them first. Then every rank checks
calls whose header rounds, agreement rounds and messages travel on the mesh
(allreduce, broadcast_object, allgather_object, a lock, barriers) and lets the
watchdog's heartbeats go round; reports how many connections its meshes
refused (`refused N`); and checks that MARKER, the file a client's pickle
creates if anything unpickles it, does not exist.

TRUST_MESH_NOFILE=RANKS:ROOM (e.g. `0,2:40`) lowers RLIMIT_NOFILE on those
ranks before anything starts, to ROOM descriptors beyond the highest one open,
so the test's flood of idle connections runs the rank out of descriptors.
"""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path

import anyio
import numpy as np
from _common import report, run

import asynclock


def lower_nofile() -> None:
    spec = os.environ.get("TRUST_MESH_NOFILE")
    if not spec:
        return
    ranks, room = spec.split(":")
    if os.environ.get("HOROVOD_RANK") not in ranks.split(","):
        return
    highest = max(int(fd) for fd in os.listdir("/proc/self/fd"))
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest + 1 + int(room), hard))


async def main() -> None:
    marker = Path(sys.argv[1])
    lower_nofile()
    async with asynclock.start() as c:
        got = await c.allreduce(np.arange(4.0) + c.rank)
        assert np.array_equal(got, sum(np.arange(4.0) + r for r in range(c.size))), got
        assert await c.broadcast_object({"from": c.rank}, root=0) == {"from": 0}
        assert await c.allgather_object(c.rank * 10) == [r * 10 for r in range(c.size)]
        async with c.lock("trust"):
            await anyio.sleep(0.01)
        await anyio.sleep(0.5)  # heartbeats every 0.1 s (the test sets it)
        await c.barrier()
        report(c.rank, "collectives")
        report(c.rank, "refused", str(c.backend.refused_connections()))
        await c.barrier()
    assert not marker.exists(), f"{marker} exists: a foreign client's pickle was loaded"
    report(c.rank, "done")


run(main)
