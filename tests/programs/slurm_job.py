"""Rank program for the Slurm tests: an asynclock job whose ranks srun started.

Every rank reports `RANK r OK allreduce size=N sum=S slurm_step=J.K mpi=VENDOR`
after an allreduce over the world, so a job of singletons (the wrong srun
plugin) shows size=1. `--fail-rank R --code C`: rank R then exits with C
without leaving the coordinator, as a crashed rank does. `--hang`: every rank
reports `hanging` and waits inside the coordinator until it is killed. Any other
argument is a token the test finds the job's processes by.
"""

from __future__ import annotations

import os
import sys

import anyio
import numpy as np
from _common import report, run

import asynclock


def option(name: str) -> int | None:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else None


async def main() -> None:
    async with asynclock.start() as c:
        total = await c.allreduce(np.array([c.rank + 1.0]))
        from mpi4py import MPI

        vendor = MPI.get_vendor()[0].replace(" ", "")
        step = f"{os.environ.get('SLURM_JOB_ID', '-')}.{os.environ.get('SLURM_STEP_ID', '-')}"
        report(c.rank, "allreduce", f"size={c.size} sum={total[0]:g} slurm_step={step} "
                                    f"mpi={vendor}")
        if option("--fail-rank") == c.rank:
            os._exit(option("--code") or 1)
        if "--hang" in sys.argv:
            report(c.rank, "hanging", f"pid={os.getpid()}")
            await anyio.sleep_forever()
        await c.barrier()
    report(c.rank, "done")


run(main)
