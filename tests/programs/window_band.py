"""Where large allreduces go on one node with the default sizes.

    window_band.py

Open MPI: the node window takes every size from ASYNCLOCK_WINDOW_MIN_BYTES on. The
first allreduce that needs a larger window makes it in the wait thread, as does every
allreduce from `WINDOW_LOOP_HI` on; an awaited one below it, in a window already large
enough, runs on the loop step by step. MPICH: below `mpich_loop_hi()` (the window's
smallest size, as the window is on) the allreduce stays on the loop (its non-blocking
call, polled), no wait thread and no window; from there as under Open MPI. Each result
must be the sum over ranks, and the counts of window calls, of those run on the loop
and of stages handed to the wait thread must match.
"""

from __future__ import annotations

import torch
from _common import report, run
from mpi4py import MPI

import asynclock
from asynclock._core.base import settings
from asynclock._core.transports.mpi import MPICH_LOOP_HI, WINDOW_LOOP_HI, mpich_loop_hi

MIB = 1 << 20
# in order: make the window, grow it, then the loop's sizes, then the thread's again
SIZES = [MIB, 4 * MIB, 4 * MIB, MIB, MIB - 4, MPICH_LOOP_HI - 4, MPICH_LOOP_HI, 32 * MIB]


def expected() -> tuple[int, int, int]:
    """(through the window, of them on the loop, in the wait thread) for `SIZES`."""
    windows = loop = threaded = 0
    capacity = 0
    for nbytes in SIZES:
        if nbytes < settings.number("ASYNCLOCK_WINDOW_MIN_BYTES"):
            continue  # MPI's allreduce, on the loop (under the wait thread's size too)
        if "Open MPI" not in MPI.Get_library_version() and nbytes < mpich_loop_hi():
            continue  # MPICH's non-blocking allreduce, on the loop
        windows += 1
        if nbytes < WINDOW_LOOP_HI and nbytes <= capacity:
            loop += 1
        else:
            threaded += 1
            capacity = max(capacity, nbytes)
    return windows, loop, threaded


async def main() -> None:
    async with asynclock.start() as c:
        for nbytes in SIZES:
            t = torch.full((nbytes // 4,), float(c.rank + 1))
            await c.allreduce_(t)
            want = c.size * (c.size + 1) / 2
            assert bool((t == want).all()), f"{nbytes} B: {t[:4]} != {want}"
        got = (c.backend.window_calls(), c.backend.window_loop_calls(),  # type: ignore[attr-defined]
               c.statistics().thread_waits)
        assert got == expected(), (f"{SIZES}: window, on the loop, wait thread {got}, "
                                   f"not {expected()}")
        report(c.rank, "band", f"of {len(SIZES)}: {got[0]} through the window, {got[1]} of "
                               f"them on the loop, {got[2]} in the wait thread")
    report(c.rank, "done")


if __name__ == "__main__":
    run(main)
