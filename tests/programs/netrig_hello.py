"""Launcher check across hosts: one allreduce and the ranks' host names.

Works under any runner (mpiexec, mpirun, asynclock-launch, horovodrun with
either controller): `asynclock.start()` picks the Horovod backend under
horovodrun and MPI otherwise. Prints `RANK r OK hello <backend> <hosts>`.
"""

from __future__ import annotations

import socket

import numpy as np
from _common import report, run

import asynclock


async def main() -> None:
    async with asynclock.start() as c:
        total = await c.allreduce(np.full(3, c.rank + 1.0))
        assert (total == c.size * (c.size + 1) / 2).all(), total
        hosts = await c.allgather_object(socket.gethostname())
        assert len(set(hosts)) == c.size, f"ranks share hosts: {hosts}"
        assert c.local_size == 1, f"{c.local_size} ranks on one node: shared memory"
        report(c.rank, "hello", f"{type(c.backend).__name__} {','.join(hosts)}")


run(main)
