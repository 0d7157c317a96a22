"""What the header round costs as the job grows: bytes and latency per checked call.

Run: mpiexec -n N python bench/agreement.py [--json PATH]
Times, in the same job, an awaited 4-byte allreduce and an awaited barrier
through asynclock against a blocking 4-byte MPI_Allreduce from mpi4py (the
systems take turns round by round; each figure is the median of the rounds),
and reports the header bytes each rank contributes and receives per checked
call: one COMPACT_BYTES element reduced (the compact round) plus the rows
rounds the lane actually ran, or, on a version without the compact round,
a SLOT_BYTES slot gathered from every rank. Where the compact round goes
through node shared memory (`"round": "node"`), no header byte travels
through MPI: a rank writes its record and reads every rank's, which the
row gives as sent / received. Point PYTHONPATH at another checkout to
measure that version in the same way.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
from mpi4py import MPI
from timing import median, per_call_async

import asynclock
from asynclock._core.base import header

WORLD = MPI.COMM_WORLD


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--json", help="append the row here (rank 0)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000, help="calls per round")
    return p.parse_args()


async def blocking(fn: Callable[[], Any]) -> None:
    fn()


def header_bytes(rows_per_call: float, node_round: bool) -> tuple[int, float]:
    """(bytes a rank sends, bytes it receives) in the header rounds of one call; for
    a node round, the bytes of shared records it writes and reads (with each
    record's round number)."""
    n = WORLD.Get_size()
    compact = getattr(header, "COMPACT_BYTES", None)
    if compact is None:  # every call gathers every rank's slot
        return header.SLOT_BYTES, header.SLOT_BYTES * n
    rows = rows_per_call * header.SLOT_BYTES
    if node_round:
        record = compact + 8
        return int(record + rows), record * n + rows * n
    return int(compact + rows), compact + rows * n


async def main(args: argparse.Namespace) -> None:
    async with asynclock.start() as coord:
        x = np.zeros(1, np.float32)
        raw = np.zeros(1, np.float32)
        systems: dict[str, Callable[[], Awaitable[Any]]] = {
            "mpi4py_allreduce": lambda: blocking(lambda: WORLD.Allreduce(MPI.IN_PLACE, raw)),
            "asynclock_allreduce": lambda: coord.allreduce_(x),
            "asynclock_barrier": coord.barrier,
        }
        stats = coord.lowlevel.small_path_statistics
        rows_before = getattr(stats(), "rows_rounds", None)
        calls_before = stats().calls
        samples: dict[str, list[float]] = {name: [] for name in systems}
        for _ in range(args.rounds):
            for name, fn in systems.items():
                samples[name].append(await per_call_async(fn, args.calls, WORLD.Barrier))
        calls = stats().calls - calls_before
        rows = None if rows_before is None else stats().rows_rounds - rows_before
        node_round = coord.lowlevel.user_lane.header_rounds.kind == "node"
        sent, received = header_bytes(0.0 if rows is None else rows / max(calls, 1), node_round)
        med = {name: median(s) for name, s in samples.items()}
        row = {"ranks": WORLD.Get_size(), "mpi": MPI.Get_library_version().split()[0],
               "compact": rows is not None, "round": "node" if node_round else "mpi",
               "rows_rounds": rows, "checked_calls": calls,
               "header_bytes_sent": sent, "header_bytes_received": received,
               **{f"{k}_us": round(v * 1e6, 2) for k, v in med.items()},
               "allreduce_ratio": round(med["asynclock_allreduce"] / med["mpi4py_allreduce"], 2)}
        if coord.rank == 0:
            print(json.dumps(row), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    anyio.run(main, parse())
