"""Which backend `auto` picks where the job was launched (`--expect NAME`).

On the MPI backend Horovod must never have been imported: its background
thread would negotiate every cycle, work or not, on every rank.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import report, run

import asynclock


async def main() -> None:
    want = sys.argv[sys.argv.index("--expect") + 1]
    async with asynclock.start() as c:
        assert c.backend.name == want, f"backend {c.backend.describe()}, want {want}"
        got = await c.allreduce(np.full(3, c.rank + 1.0), op="sum")
        assert np.array_equal(got, np.full(3, c.size * (c.size + 1) / 2)), got
        loaded = "horovod" in sys.modules
        assert loaded == (want == "horovod"), f"horovod imported: {loaded}"
        report(c.rank, "auto_backend", f"{c.size} ranks on {c.backend.describe()}")
    report(c.rank, "done")


run(main)
