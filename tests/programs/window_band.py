"""Where large allreduces go on one node with the default sizes.

    window_band.py

Open MPI: its own allreduce, in the wait thread, takes the sizes of `OPEN_MPI_BAND`,
the node window the rest. MPICH: below `MPICH_LOOP_HI` the allreduce stays on the
loop (its non-blocking call, polled), no wait thread and no window; the window takes
every size from there. Each result must be the sum over ranks, and the counts of
window calls and of stages handed to the wait thread must match.
"""

from __future__ import annotations

import torch
from _common import report, run
from mpi4py import MPI

import asynclock
from asynclock._core.transports.mpi import MPICH_LOOP_HI, OPEN_MPI_BAND

SIZES = sorted({1 << 20, OPEN_MPI_BAND[0], MPICH_LOOP_HI - 4, MPICH_LOOP_HI,
                OPEN_MPI_BAND[1] - 4, OPEN_MPI_BAND[1]})


def expected(nbytes: int) -> tuple[bool, bool]:
    """(through the window, in the wait thread) for an allreduce of `nbytes`."""
    if "Open MPI" in MPI.Get_library_version():
        lo, hi = OPEN_MPI_BAND
        return not lo <= nbytes < hi, True
    on_loop = nbytes < MPICH_LOOP_HI
    return not on_loop, not on_loop


async def main() -> None:
    async with asynclock.start() as c:
        for nbytes in SIZES:
            t = torch.full((nbytes // 4,), float(c.rank + 1))
            await c.allreduce_(t)
            want = c.size * (c.size + 1) / 2
            assert bool((t == want).all()), f"{nbytes} B: {t[:4]} != {want}"
        windows = c.backend.window_calls()  # type: ignore[attr-defined]
        threaded = c.statistics().thread_waits
        want_windows = sum(expected(n)[0] for n in SIZES)
        want_threaded = sum(expected(n)[1] for n in SIZES)
        assert (windows, threaded) == (want_windows, want_threaded), (
            f"{windows} window calls and {threaded} thread waits for {SIZES}, "
            f"not {want_windows} and {want_threaded}")
        report(c.rank, "band", f"{windows} of {len(SIZES)} through the window, "
                               f"{threaded} in the wait thread")
    report(c.rank, "done")


if __name__ == "__main__":
    run(main)
