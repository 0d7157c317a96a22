"""A short job that ends cleanly: nothing alarming may be printed on the way out.

Every rank leaves `asynclock.start()` right after a barrier, so the ranks close
their links at about the same time: one closes while another still says
goodbye over them.
"""

from __future__ import annotations

import numpy as np
from _common import report, run

import asynclock


async def main() -> None:
    async with asynclock.start() as c:
        assert ((await c.allreduce(np.ones(4))) == c.size).all()
        await c.barrier()
        report(c.rank, "leaving", c.backend.describe())
    report(c.rank, "done")


run(main)
