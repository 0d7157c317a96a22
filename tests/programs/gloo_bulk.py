"""Bulk allreduces through asynclock's private gloo group (asynclock._core.transports.gloo_bulk).

    gloo_bulk.py EXPECT [--no-torch-on-rank0] [--trio]

Run with ASYNCLOCK_BULK set by the test. EXPECT is the start of the
backend's `bulk_choice` every rank must report (e.g. `gloo`, `mpi (one
node)`; `a|b`: either). With ASYNCLOCK_GLOO_MIN_BYTES lowered to 1 MiB, every allreduce of
1 MiB or more checks its values against numpy for each op and dtype gloo
takes, out of place too, and `gloo_calls()` proves which path it took.
`--no-torch-on-rank0` leaves torch unimported on rank 0 only: no rank may
use gloo then (the choice is agreed).
"""

from __future__ import annotations

import os
import sys

import numpy as np
from _common import report, run

import asynclock

N = (1 << 20) // 4 + 3  # just over 1 MiB of float32: a bulk data stage
OPS = {asynclock.Sum: np.add, asynclock.Min: np.minimum, asynclock.Max: np.maximum,
       asynclock.Product: np.multiply}


def rows(dtype: type, size: int) -> list[np.ndarray]:
    return [((np.arange(N) + 3 * r) % 7 + 1).astype(dtype) for r in range(size)]


async def check_ops(c: asynclock.Coordinator) -> list[int]:
    """Every op and dtype gloo takes, checked; the bytes of each call."""
    sizes = []
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        data = rows(dtype, c.size)
        for op, fold in OPS.items():
            got = await c.allreduce(data[c.rank].copy(), op)
            want = data[0].copy()
            for other in data[1:]:
                want = fold(want, other)
            assert got.dtype == want.dtype and np.array_equal(got, want), (dtype, op)
            sizes.append(got.nbytes)
        avg = await c.allreduce(data[c.rank].astype(np.float64), asynclock.Average)
        assert np.allclose(avg, np.mean(np.stack(data).astype(np.float64), axis=0))
        sizes.append(avg.nbytes)
    return sizes


async def check_half(c: asynclock.Coordinator) -> int:
    """fp16 and bf16 (gradient compression's wire types) at 1 MiB: summed 16-bit by
    MPI's ring, also where float32 goes over gloo (across hosts at 5 Gbit/s, MPICH,
    fp16-compressed MLP: 356 samples/s with the ring, 309 through gloo)."""
    import torch

    for dtype in (torch.float16, torch.bfloat16):
        got = await c.allreduce(torch.full((2 * N,), 1.5 + c.rank, dtype=dtype))
        want = sum(1.5 + r for r in range(c.size))
        assert got.dtype == dtype and torch.equal(got, torch.full_like(got, want)), dtype
        avg = await c.allreduce(torch.full((2 * N,), 2.0 * (c.rank + 1), dtype=dtype),
                                asynclock.Average)
        assert torch.equal(avg, torch.full_like(avg, float(c.size + 1))), (dtype, avg[:3])
    return 0  # no gloo call among them


def import_torch() -> None:
    """gloo is used only by programs that imported torch before start."""
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    if not ("--no-torch-on-rank0" in sys.argv and rank == "0"):
        import torch  # noqa: F401


async def main() -> None:
    expect = sys.argv[1]
    import_torch()
    async with asynclock.start() as c:
        choice = c.backend.bulk_choice
        assert choice.startswith(tuple(expect.split("|"))), f"{choice!r}, want {expect!r}"
        sizes = await check_ops(c)
        small = await c.allreduce(np.full(N, 1.5, np.float16))  # 0.5 MiB: MPI's ring
        assert (small == 1.5 * c.size).all()
        half = await check_half(c) if "--no-torch-on-rank0" not in sys.argv else 0
        calls = c.backend.gloo_calls()
        # gloo takes the calls from its threshold on: 1 MiB when forced by the test, the
        # probe's (4 or 16 MiB) where it measured gloo faster, e.g. on a loaded machine
        store = c.backend._gloo  # type: ignore[attr-defined]
        least = store.min_bytes if choice.startswith("gloo") and store is not None else None
        if least == 0:
            # every allreduce the wait thread runs over MPI: on one node (`measure`) the
            # node window takes these sizes first, so gloo may get none of them
            # (`netrig` counts them exactly across hosts, where the window has no use)
            assert 0 <= calls <= len(sizes), f"{calls} gloo calls of {len(sizes)} ({choice})"
        else:
            want = 0 if least is None else sum(n >= least for n in sizes) + half
            assert calls == want, f"{calls} gloo calls, want {want} ({choice})"
        everyone = await c.allgather_object((choice, calls))
        assert len(set(everyone)) == 1, everyone
        report(c.rank, "done", f"{choice} | gloo calls {calls}")


if __name__ == "__main__":
    run(main)
