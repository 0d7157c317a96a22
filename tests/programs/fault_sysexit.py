"""`sys.exit(n)` inside `async with asynclock.start()`: a deliberate exit, not a crash.

`--code N`: the status (default 5). `--rank R`: only rank R exits, while the
others wait in an allreduce it never joins (default: every rank exits, as a
script that decides its outcome on every rank does). The exiting ranks must
leave with N and print no traceback; a rank left waiting must stop with a
clear error instead of hanging.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import report, run
from fault_common import announce_pid, arg

import asynclock

CODE = int(arg("--code", "5"))
ONLY = arg("--rank", "all")


async def main() -> None:
    async with asynclock.start() as c:
        announce_pid(c.rank)
        assert ((await c.allreduce(np.ones(4))) == c.size).all()
        if ONLY == "all" or c.rank == int(ONLY):
            report(c.rank, "exiting", str(CODE))
            sys.exit(CODE)
        await c.allreduce(np.ones(1 << 16), name="never")  # the exited rank never joins
        report(c.rank, "unexpected")


run(main)
