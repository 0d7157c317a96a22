#!/usr/bin/env python3
"""Rank program for Horovod smoke checks and a tiny latency measurement.

Why a file and not `python -c`: the same checks run under horovodrun (MPI and
Gloo controllers), plain mpirun/mpiexec, and with mpi4py owning MPI_Init, and
each prints one comparable line per rank.

Modes (argv[1]):
  allreduce  hvd.init(); allreduce(ones(3) * rank)
  mpi4py     mpi4py initialises MPI; hvd.init(comm=MPI.COMM_WORLD)
  mpi4py-dup same, with hvd.init(comm=MPI.COMM_WORLD.Dup())
  latency    median/p90 of N (argv[2], default 1000) 4-byte allreduces
"""
from __future__ import annotations

import statistics
import sys
import time
from typing import Any


def init(mode: str) -> tuple[Any, float]:
    """Initialise Horovod as the mode says; return (hvd, init seconds)."""
    start = time.perf_counter()
    if mode.startswith("mpi4py"):
        from mpi4py import MPI  # initialises MPI (THREAD_MULTIPLE) before Horovod

        comm = MPI.COMM_WORLD.Dup() if mode == "mpi4py-dup" else MPI.COMM_WORLD
        import horovod.torch as hvd

        hvd.init(comm=comm)
    else:
        import horovod.torch as hvd

        hvd.init()
    return hvd, time.perf_counter() - start


def check_allreduce(hvd: Any, mode: str, init_s: float) -> None:
    """Allreduce ones*rank (sum) and print one line per rank."""
    import torch

    got = hvd.allreduce(torch.ones(3) * hvd.rank(), op=hvd.Sum, name="smoke")
    want = float(sum(range(hvd.size())))
    extra = ""
    if mode.startswith("mpi4py"):
        from mpi4py import MPI

        extra = f" mpi4py_sum={MPI.COMM_WORLD.allreduce(hvd.rank())}"
    ok = bool(torch.allclose(got, torch.full((3,), want)))
    print(f"[{mode}] rank {hvd.rank()}/{hvd.size()} allreduce={got.tolist()} ok={ok} "
          f"mpi_enabled={hvd.mpi_enabled()} gloo_enabled={hvd.gloo_enabled()} "
          f"init_s={init_s:.2f}{extra}", flush=True)
    if not ok:
        raise SystemExit(1)


def latency(hvd: Any, iters: int) -> None:
    """Time synchronous 4-byte (one float32) allreduces; rank 0 prints stats."""
    import torch

    x = torch.ones(1, dtype=torch.float32)
    for _ in range(50):  # warm-up: negotiation caches, response cache
        hvd.allreduce(x, name="lat")
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        hvd.allreduce(x, name="lat")
        times.append(time.perf_counter() - start)
    if hvd.rank() == 0:
        times.sort()
        print(f"[latency] size={hvd.size()} iters={iters} 4-byte allreduce "
              f"median={statistics.median(times) * 1e6:.0f}us "
              f"p90={times[int(0.9 * len(times))] * 1e6:.0f}us "
              f"min={times[0] * 1e6:.0f}us", flush=True)


def main() -> int:
    """Entry point: run one mode."""
    mode = sys.argv[1] if len(sys.argv) > 1 else "allreduce"
    hvd, init_s = init(mode)
    if mode == "latency":
        latency(hvd, int(sys.argv[2]) if len(sys.argv) > 2 else 1000)
    else:
        check_allreduce(hvd, mode, init_s)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
