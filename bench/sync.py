"""Cross-rank lock throughput and barrier latency: asynclock vs mpi4py, same job.

Run: .venv/bin/mpiexec -n 2 .venv/bin/python bench/sync.py [--json PATH]

* acquire+release per second, contended (every rank loops on one lock) and
  uncontended (only rank 0 loops), with the lock's home on rank 0 (owner
  local) and on rank 1 (remote); against `mpi4py.util.sync.Mutex` whose
  tail lives on rank 0, resp. on rank 1 (a communicator with reversed ranks);
* barrier latency: `await coord.barrier()` (header-checked, user lane),
  `await coord.consistency_point(name)` (sync lane) vs blocking MPI Barrier;
* how late a 1 ms ticker task wakes while the asynclock loops run (median
  and 99th percentile): the loop is never blocked by a wait, and a task
  looping on fast paths still yields once a millisecond.

Each figure is the median over `--rounds` rounds; rank 0 prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import anyio
from mpi4py import MPI
from mpi4py.util.sync import Mutex
from timing import median, per_call, per_call_async, percentile

import asynclock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "programs"))
from sync_common import homed  # noqa: E402

WORLD = MPI.COMM_WORLD


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", help="write the figures here (rank 0)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=float, default=0.5, help="length of a lock round")
    p.add_argument("--barriers", type=int, default=2000, help="barriers per round")
    p.add_argument("--trio", action="store_true")
    return p.parse_args()


# -- asynclock --------------------------------------------------------------------------
async def lock_round(c: asynclock.Coordinator, lock: Any, seconds: float, looping: bool,
                     lag: list[float]) -> tuple[float, float]:
    """(acquisitions per second over all looping ranks, fairness min/max share)."""
    WORLD.Barrier()
    count, stop = 0, time.perf_counter() + seconds
    if looping:
        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker, lag)
            while time.perf_counter() < stop:
                for _ in range(20):
                    await lock.acquire()
                    lock.release()
                count += 20
            tg.cancel_scope.cancel()
    await c.barrier()  # everyone keeps serving lock traffic until all are done
    return _rate(WORLD.allgather(count if looping else -1), seconds)


def _rate(counts: list[int], seconds: float) -> tuple[float, float]:
    mine = [n for n in counts if n >= 0]
    return sum(mine) / seconds, min(mine) / max(max(mine), 1)


async def ticker(lag: list[float]) -> None:
    """Record how late each 1 ms sleep wakes up: the loop's responsiveness."""
    while True:
        t = time.perf_counter()
        await anyio.sleep(0.001)
        lag.append(time.perf_counter() - t - 0.001)


# -- mpi4py -----------------------------------------------------------------------------
def mutex_round(m: Mutex, seconds: float, looping: bool) -> tuple[float, float]:
    WORLD.Barrier()
    count, stop = 0, time.perf_counter() + seconds
    while looping and time.perf_counter() < stop:
        for _ in range(20):
            m.acquire()
            m.release()
        count += 20
    WORLD.Barrier()
    return _rate(WORLD.allgather(count if looping else -1), seconds)


# -- driver -----------------------------------------------------------------------------
async def bench_locks(c: asynclock.Coordinator, args: argparse.Namespace) -> dict[str, Any]:
    """asynclock rounds first, then mpi4py's: its RMA windows exist only for its
    own rounds (an allocated window slows every MPI progress call)."""
    local = c.lock(homed("bench-local", 0, c.size))
    remote = c.lock(homed("bench-remote", 1 % c.size, c.size))
    cases = [("contended, home rank 0", local, "local", True),
             ("uncontended, home = rank 0 (owner-local)", local, "local", c.rank == 0),
             ("uncontended, home = rank 1 (remote)", remote, "remote", c.rank == 0)]
    out: dict[str, Any] = {}
    for label, lock, _, looping in cases:
        lag: list[float] = []
        ours = [await lock_round(c, lock, args.seconds, looping, lag)
                for _ in range(args.rounds)]
        lags = [x for rank_lags in WORLD.allgather(lag) for x in rank_lags] or [0.0]
        out[label] = {"asynclock_acq_s": median([r for r, _ in ours]),
                      "asynclock_fairness": median([f for _, f in ours]),
                      "loop_lag_p50_ms": percentile(lags, 0.5) * 1e3,
                      "loop_lag_p99_ms": percentile(lags, 0.99) * 1e3}
    reversed_comm = WORLD.Split(0, c.size - 1 - c.rank)  # mpi4py Mutex tail on rank 1
    mutexes = {"local": Mutex(comm=WORLD), "remote": Mutex(comm=reversed_comm)}
    for label, _, where, looping in cases:
        theirs = [mutex_round(mutexes[where], args.seconds, looping)
                  for _ in range(args.rounds)]
        out[label].update({"mpi4py_acq_s": median([r for r, _ in theirs]),
                           "mpi4py_fairness": median([f for _, f in theirs])})
    for m in mutexes.values():
        m.free()
    return out


async def bench_barriers(c: asynclock.Coordinator, args: argparse.Namespace
                         ) -> dict[str, Any]:
    point = c.consistency_point("bench")
    n, r = args.barriers, args.rounds
    raw = [per_call(WORLD.Barrier, n, WORLD.Barrier) for _ in range(r)]
    checked = [await per_call_async(c.barrier, n, WORLD.Barrier) for _ in range(r)]
    fast = [await per_call_async(point.wait, n, WORLD.Barrier) for _ in range(r)]
    return {"mpi_barrier_us": median(raw) * 1e6,
            "coord_barrier_us": median(checked) * 1e6,
            "consistency_point_us": median(fast) * 1e6}


def table(locks: dict[str, Any], barriers: dict[str, Any]) -> str:
    rows = ["| lock acquire+release | asynclock /s | mpi4py Mutex /s | ratio | "
            "fairness (min/max rank share) | loop lag p50 / p99 |",
            "| --- | --- | --- | --- | --- | --- |"]
    for label, v in locks.items():
        ratio = v["asynclock_acq_s"] / v["mpi4py_acq_s"]
        fair = (f"{v['asynclock_fairness']:.2f} vs {v['mpi4py_fairness']:.2f}"
                if label.startswith("contended") else "-")
        rows.append(f"| {label} | {v['asynclock_acq_s']:,.0f} | {v['mpi4py_acq_s']:,.0f} | "
                    f"{ratio:.2f}x | {fair} | {v['loop_lag_p50_ms']:.2f} / "
                    f"{v['loop_lag_p99_ms']:.2f} ms |")
    raw = barriers["mpi_barrier_us"]
    rows += ["", "| barrier | median latency | vs MPI Barrier |", "| --- | --- | --- |",
             f"| MPI Barrier (blocking) | {raw:.1f} us | 1.00x |"]
    for key, label in (("coord_barrier_us", "await coord.barrier() (header-checked)"),
                       ("consistency_point_us", "await coord.consistency_point()")):
        rows.append(f"| {label} | {barriers[key]:.1f} us | {barriers[key] / raw:.2f}x |")
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> None:
    async with asynclock.start() as c:
        locks = await bench_locks(c, args)
        barriers = await bench_barriers(c, args)
        await c.barrier()
    if c.rank == 0:
        print(table(locks, barriers))
        if args.json:
            meta = {"ranks": c.size, "loop": "trio" if args.trio else "asyncio",
                    "mpi": MPI.Get_library_version().splitlines()[0],
                    "host": platform.node(), "cpus": os.cpu_count(),
                    "rounds": args.rounds, "seconds": args.seconds,
                    "load_average": os.getloadavg()}
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "locks": locks, "barriers": barriers}, f, indent=1)


if __name__ == "__main__":
    a = parse()
    anyio.run(main, a, backend="trio" if a.trio else "asyncio")
