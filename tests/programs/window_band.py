"""Which large allreduces take the node window with its default sizes.

    window_band.py

On one node, Open MPI's own allreduce takes the sizes of `OPEN_MPI_BAND` and the
window the rest; under MPICH the window takes every size from its minimum. Each
result must be the sum over ranks, and the count of window calls must match.
"""

from __future__ import annotations

import torch
from _common import report, run
from mpi4py import MPI

import asynclock
from asynclock._core.transports.mpi import OPEN_MPI_BAND

SIZES = [1 << 20, OPEN_MPI_BAND[0], OPEN_MPI_BAND[1] - 4, OPEN_MPI_BAND[1]]


async def main() -> None:
    async with asynclock.start() as c:
        for nbytes in SIZES:
            t = torch.full((nbytes // 4,), float(c.rank + 1))
            await c.allreduce_(t)
            want = c.size * (c.size + 1) / 2
            assert bool((t == want).all()), f"{nbytes} B: {t[:4]} != {want}"
        windows = c.backend.window_calls()  # type: ignore[attr-defined]
        lo, hi = OPEN_MPI_BAND
        banded = sum(lo <= n < hi for n in SIZES) if "Open MPI" in MPI.Get_library_version() else 0
        assert windows == len(SIZES) - banded, f"{windows} window calls, {banded} banded"
        report(c.rank, "band", f"{windows} of {len(SIZES)} through the window")
    report(c.rank, "done")


if __name__ == "__main__":
    run(main)
