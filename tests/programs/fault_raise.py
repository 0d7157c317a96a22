"""One rank raises while the others wait in a collective.

`--rank R`: the rank that raises (default 1). `--sync`: Horovod-style
program (init() + run_sync, the exception reaches the top of the main
thread); default: the exception escapes `async with asynclock.start()`.
`--shutdown-in-finally` (with --sync): rank R shuts asynclock down before
the exception reaches the top; its peers must notice it will never join.
Every rank must exit non-zero quickly; only rank R prints a traceback.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import report, run
from fault_common import announce_pid, arg

import asynclock

BAD = int(arg("--rank", "1"))


async def body(c: asynclock.Coordinator) -> None:
    announce_pid(c.rank)
    total = await c.allreduce(np.ones(4))
    assert (total == c.size).all()
    report(c.rank, "warmed")
    if c.rank == BAD:
        raise ValueError(f"boom from rank {c.rank}")
    await c.allreduce(np.ones(1 << 16), name="never")  # BAD never joins
    report(c.rank, "unexpected")


async def main() -> None:
    async with asynclock.start() as c:
        await body(c)


def main_sync() -> None:
    c = asynclock.init()
    announce_pid(c.rank)
    total = c.lowlevel.run_sync(c.allreduce, np.ones(4))
    assert (total == c.size).all()
    report(c.rank, "warmed")
    try:
        if c.rank == BAD:
            raise ValueError(f"boom from rank {c.rank}")
        c.lowlevel.run_sync(c.allreduce, np.ones(1 << 16))
        report(c.rank, "unexpected")
    finally:
        if "--shutdown-in-finally" in sys.argv and c.rank == BAD:
            asynclock.shutdown()  # peers then wait on a rank that said `closing`


if "--sync" in sys.argv:
    main_sync()
else:
    run(main)
