"""The rank program of bench/cost_model.py (`cost_model.py probe`, under mpiexec or
mpirun): it times MPI's primitives, asynclock's allreduce and Horovod's on its job, and
rank 0 writes the rows as JSON for `cost_measure` to collect.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from cost_formulas import HVD_REQUEST_BYTES, HVD_RESPONSE_BYTES
from timing import batch_size, median, per_call, per_call_async

from asynclock._core.base.header import COMPACT_BYTES, SLOT_BYTES


def probe(args: argparse.Namespace) -> None:
    """Time MPI primitives and asynclock on this job; rank 0 writes JSON rows."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    hosts = world.allgather(platform.node())
    ppn = hosts.count(hosts[0])
    meta = {"mpi": MPI.Get_library_version().splitlines()[0].strip(), "n": world.size,
            "ppn": ppn, "nodes": len(set(hosts)), "link": args.link}
    rows: list[dict[str, Any]] = []
    timer = Timer(world, args.round_s, args.rounds)
    if args.horovod:
        rows += probe_horovod(world, timer)
    else:
        if world.size > 1 and args.p2p:
            rows += probe_p2p(world, hosts, timer)
        rows += probe_raw(world, timer, [int(s) for s in args.sizes.split(",")])
        rows += probe_asynclock(world, timer, [int(s) for s in args.sizes.split(",")])
    if world.rank == 0:
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


class Sample(NamedTuple):
    """Seconds per call: the median batch, and the best (the slowest rank's each)."""

    median: float
    best: float

    def row(self, kind: str, nbytes: int, scale: float = 1.0, **extra: Any) -> dict[str, Any]:
        return {"kind": kind, "bytes": nbytes, "seconds": self.median * scale,
                "min": self.best * scale, **extra}


class Timer:
    """Seconds per call over `rounds` synchronised batches of ~`round_s` each. Many
    short batches: on shared cores the best one is the machine without its other users."""

    def __init__(self, comm: Any, round_s: float, rounds: int) -> None:
        self.comm, self.round_s, self.rounds = comm, round_s, rounds

    def count(self, warm_s: float) -> int:
        """Calls per batch from a warm-up call's time, as rank 0 saw it."""
        return int(self.comm.bcast(batch_size(warm_s, self.round_s), root=0))

    def result(self, batches: list[float]) -> Sample:
        # the slowest rank's: a collective is done when its last rank is
        worst = _max_op()
        return Sample(float(self.comm.allreduce(median(batches), op=worst)),
                      float(self.comm.allreduce(min(batches), op=worst)))

    def time(self, fn: Callable[[], Any]) -> Sample:
        n = self.count(per_call(fn, 3))
        return self.result([per_call(fn, n, self.comm.Barrier) for _ in range(self.rounds)])

    async def time_async(self, fn: Callable[[], Any]) -> Sample:
        """`time` for an awaitable call."""
        n = self.count(await per_call_async(fn, 3))
        return self.result([await per_call_async(fn, n, self.comm.Barrier)
                            for _ in range(self.rounds)])


def _max_op() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def idle_wait(comm: Any) -> None:
    """Ranks not in a point-to-point test wait here without spinning, so the two that
    are tested keep the cores."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


P2P_SIZES = (8, 256, 2 << 10, 16 << 10, 64 << 10, 512 << 10, 4 << 20, 64 << 20)


def probe_p2p(world: Any, hosts: list[str], timer: Timer) -> list[dict[str, Any]]:
    """Ping-pong (half the round trip), exchange, and a stream of small sends (CPU per
    message), rank 0 with its neighbour on the node and, across hosts, with the first
    rank of the next host."""
    import numpy as np
    import torch

    peers = {"intra": 1 if hosts.count(hosts[0]) > 1 else None,
             "inter": next((r for r, h in enumerate(hosts) if h != hosts[0]), None)}
    rows = []
    for where, peer in peers.items():
        if peer is None:
            continue
        for nbytes in P2P_SIZES:
            buf = torch.zeros(nbytes, dtype=torch.uint8).numpy()  # torch's memory: see probe_raw
            other = torch.zeros(nbytes, dtype=torch.uint8).numpy()
            rows.append(pair_time(world, peer, partial(_pingpong, world, buf, peer), timer)
                        .row("pingpong", nbytes, 0.5, where=where))
            rows.append(pair_time(world, peer, partial(_exchange, world, buf, other, peer), timer)
                        .row("exchange", nbytes, where=where))
        window = 256
        small = np.zeros(8, np.uint8)
        rows.append(pair_time(world, peer, partial(_stream, world, small, peer, window), timer)
                    .row("stream", 8, 1 / window, where=where, window=window))
    return rows


def pair_time(world: Any, peer: int, fn: Callable[[], None], timer: Timer) -> Sample:
    """`fn` timed on rank 0 and `peer` while the others wait idle."""
    active = world.rank in (0, peer)
    pair = world.Split(0 if active else 1, world.rank)
    got = Sample(0.0, 0.0)
    if active:
        got = Timer(pair, timer.round_s, timer.rounds).time(fn)
    pair.Free()
    idle_wait(world)
    return Sample(*world.bcast(tuple(got), root=0))


def _pingpong(world: Any, buf: Any, peer: int) -> None:
    if world.rank == 0:
        world.Send(buf, peer, 11)
        world.Recv(buf, peer, 11)
    else:
        world.Recv(buf, 0, 11)
        world.Send(buf, 0, 11)


def _exchange(world: Any, send: Any, recv: Any, peer: int) -> None:
    other = peer if world.rank == 0 else 0
    world.Sendrecv(send, other, 14, recv, other, 14)


def _stream(world: Any, buf: Any, peer: int, window: int) -> None:
    from mpi4py import MPI

    if world.rank == 0:
        MPI.Request.Waitall([world.Isend(buf, peer, 12) for _ in range(window)])
        world.Recv(buf, peer, 13)
    else:
        MPI.Request.Waitall([world.Irecv(buf, 0, 12) for _ in range(window)])
        world.Send(buf, 0, 13)


def probe_raw(world: Any, timer: Timer, sizes: list[int]) -> list[dict[str, Any]]:
    """The MPI calls each system's model is made of."""
    import numpy as np
    import torch
    from mpi4py import MPI

    rows = []
    for nbytes in sizes:
        # torch's memory, as asynclock's calls get: numpy asks for huge pages on big
        # arrays and torch does not, which alone moves a large allreduce by ~15%
        arr = torch.zeros(max(1, nbytes // 4)).numpy()
        rows.append(timer.time(partial(world.Allreduce, MPI.IN_PLACE, arr, MPI.SUM))
                    .row("mpi_allreduce", nbytes))
    # the two header rounds' MPI calls as asynclock issues them, non-blocking; a builtin
    # op in place of the compact round's user op (each MPI picks the same algorithm for
    # both at this size), waited for at once
    words = np.zeros(COMPACT_BYTES // 8, np.int64)
    reduced = np.zeros(COMPACT_BYTES // 8, np.int64)
    rows.append(timer.time(lambda: world.Iallreduce(words, reduced, MPI.BOR).Wait())
                .row("mpi_iallreduce_compact", COMPACT_BYTES))
    slot = np.zeros(SLOT_BYTES, np.uint8)
    slots = np.zeros(SLOT_BYTES * world.size, np.uint8)
    rows.append(timer.time(lambda: world.Iallgather(slot, slots).Wait())
                .row("mpi_iallgather_rows", SLOT_BYTES))
    bits = np.zeros(1, np.int64)
    rows.append(timer.time(lambda: world.Allreduce(MPI.IN_PLACE, bits, MPI.BAND))
                .row("mpi_allreduce_band", 8))
    rows.append(timer.time(lambda: _miss_cycle(world, bits)).row("hvd_miss_mpi",
                                                                  HVD_REQUEST_BYTES))
    return rows


def _miss_cycle(world: Any, bits: Any) -> None:
    """Horovod's MPI controller on a cache miss, with its message sizes: the bit vector,
    then the lengths and requests gathered at rank 0, the responses broadcast."""
    import numpy as np
    from mpi4py import MPI

    world.Allreduce(MPI.IN_PLACE, bits, MPI.BAND)
    n = world.size
    length = np.array([HVD_REQUEST_BYTES], np.int32)
    lengths = np.zeros(n, np.int32)
    world.Gather(length, lengths, root=0)
    req = np.zeros(HVD_REQUEST_BYTES, np.uint8)
    got = np.zeros(HVD_REQUEST_BYTES * n, np.uint8)
    world.Gatherv(req, [got, [HVD_REQUEST_BYTES] * n] if world.rank == 0 else None, root=0)
    resp = np.zeros(HVD_RESPONSE_BYTES + 4 * n, np.uint8)
    world.Bcast(length, root=0)
    world.Bcast(resp, root=0)


def probe_asynclock(world: Any, timer: Timer, sizes: list[int]) -> list[dict[str, Any]]:
    import anyio
    import torch

    import asynclock

    torch.set_num_threads(1)
    rows: list[dict[str, Any]] = []

    async def main() -> None:
        async with asynclock.start() as coord:
            for nbytes in sizes:
                t = torch.zeros(max(1, nbytes // 4))
                got = await timer.time_async(partial(coord.allreduce_, t))
                rows.append(got.row("asynclock_allreduce", nbytes))

    anyio.run(main)
    return rows


def probe_horovod(world: Any, timer: Timer) -> list[dict[str, Any]]:
    """Horovod's synchronous allreduce, 4 B and 64 KiB; Horovod up only for this."""
    import horovod.torch as hvd
    import torch

    hvd.init(comm=world)
    rows = []
    try:
        for nbytes in (4, 64 << 10):
            t = torch.zeros(max(1, nbytes // 4))
            rows.append(timer.time(partial(hvd.allreduce_, t, op=hvd.Sum))
                        .row("horovod_allreduce", nbytes))
    finally:
        hvd.shutdown()
    return rows
