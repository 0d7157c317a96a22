"""A cost model of a checked collective, to 4096 ranks: asynclock's check and data
path, Horovod's negotiation and raw MPI allreduce, as functions of the ranks
(nodes x ranks per node), the message size and measured parameters.

    python bench/cost_model.py                    # tables from bench/cost_params.json
    python bench/cost_model.py --measure local    # parameters and points on this machine
    python bench/cost_model.py --measure netrig   # the same across netrig hosts (root)
    python bench/cost_model.py probe ...          # the rank program the two above launch

The model is Hockney's, with each link's cost taken by message size from
measurements (a one-way message and an exchange) instead of one straight
line alpha + beta*m: reducing m bytes costs g(m), and each rank's call costs
a fixed CPU time in the engine. Links are per level: `shm` between ranks of
one node, `net` between nodes; ranks of a node that cross the network in the
same step share its link. Which algorithm an MPI runs is stated per function,
from its source; real MPIs switch by size and by communicator size. Formulas,
parameters and the validation: docs/design/cost_model.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from asynclock._core.base.header import COMPACT_BYTES, INLINE_BYTES, SLOT_BYTES
from asynclock._core.engine.policy import ProgressPolicy

ROOT = Path(__file__).resolve().parents[1]
PARAMS_JSON = ROOT / "bench" / "cost_params.json"

# What travels, from the code itself: the compact round's one element (160 B), one
# rank's slot in the rows round (272 B), the inline payload (128 B); and the size from
# which an allreduce runs blocking in the wait thread (1 MiB).
THREAD_MIN_BYTES = ProgressPolicy().thread_min_bytes

# Horovod 0.28.1 (horovod/common/operations.cc, controller.cc, mpi_controller.cc,
# torch/mpi_ops_v2.cc): the background thread runs one cycle per HOROVOD_CYCLE_TIME
# (1 ms by default); a synchronous caller polls its handle every 1 ms.
HVD_CYCLE_S = 1e-3
HVD_POLL_S = 1e-3
HVD_STATUS_BITS = 3  # shut down, uncached in queue, invalid in queue
HVD_REQUEST_BYTES = 64  # one serialized Request: name, type, dtype, shape, device
HVD_RESPONSE_BYTES = 64  # one serialized Response, plus 4 bytes per rank (its devices)

SIZES = (4, 64 << 10, 4 << 20, 64 << 20)
SCALES = ((64, 8), (512, 8))  # nodes x ranks per node for the predictions


# -- parameters --------------------------------------------------------------------------
class Curve(NamedTuple):
    """Measured (bytes, seconds) points: linear between them, the last slope beyond
    the largest, the smallest's time below it. Caches and MPI's protocols (eager,
    rendezvous) make one straight line a poor fit from 8 bytes to 64 MiB."""

    points: tuple[tuple[float, float], ...]

    def at(self, nbytes: float) -> float:
        pts = self.points
        if nbytes <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:], strict=False):
            if nbytes <= b1 or (b1, t1) == pts[-1]:
                return t0 + (t1 - t0) * (nbytes - b0) / (b1 - b0)
        return pts[-1][1]


class Link(NamedTuple):
    """One level's point-to-point costs by size: a one-way message (half a ping-pong's
    round trip) and an exchange (MPI_Sendrecv with the partner, both ways at once,
    as every step of recursive doubling, halving and a ring is). A transport that
    copies in at the sender and out at the receiver does both copies on each rank
    in an exchange; one that reads straight from the peer (CMA) does one."""

    one_way: Curve
    exchange: Curve

    @property
    def alpha(self) -> float:
        return self.one_way.points[0][1]

    def beta(self, nbytes: float) -> float:
        """Seconds per byte of a one-way message of this size, beyond the start-up."""
        return max(0.0, self.one_way.at(nbytes) - self.alpha) / max(nbytes, 1.0)

    def send(self, nbytes: float, sharing: int = 1) -> float:
        """One message; `sharing` ranks of a node send through this link at once, each
        getting 1/sharing of its bandwidth."""
        return _shared(self.one_way, nbytes, sharing)

    def swap(self, nbytes: float, sharing: int = 1) -> float:
        """One exchange of `nbytes` each way."""
        return _shared(self.exchange, nbytes, sharing)


def _shared(curve: Curve, nbytes: float, sharing: int) -> float:
    start = curve.points[0][1]
    return start + max(1, sharing) * max(0.0, curve.at(nbytes) - start)


class Rate(NamedTuple):
    """Seconds per byte of a memory operation on one core, by working-set size."""

    curve: Curve

    def time(self, nbytes: float) -> float:
        return nbytes * self.curve.at(nbytes)


@dataclass(frozen=True)
class Params:
    """Everything the model needs for one MPI."""

    mpi: str
    shm: Link  # ranks of one node (MPI's shared-memory transport)
    net: Link  # ranks on different nodes (netrig: TCP through 5 Gbit/s links)
    gamma: Rate  # reducing (float32 sum), one core
    copy: Rate  # memcpy, one core
    o_msg: float  # CPU per small message in a stream of sends (LogP's o)
    o_eng: float  # asynclock's CPU per checked call beyond MPI (1 rank, 4 B)
    o_stage: float  # extra for a data stage issued from the call (64 KiB, 1 rank)
    o_bulk: float  # extra for a bulk allreduce through the wait thread (4 MiB, 1 rank)
    fresh: float = 0.0  # seconds per byte of memory a process touches the first time
    # memcpy and sum while every core of the node does the same (the node window)
    copy_all: Rate | None = None
    gamma_all: Rate | None = None
    loop: Link | None = None  # netrig only: ranks of one emulated host (TCP over loopback)


class Cost(NamedTuple):
    """One collective on one rank: its latency, and the bytes it sends."""

    seconds: float
    sent: float

    def add(self, other: Cost) -> Cost:
        return Cost(self.seconds + other.seconds, self.sent + other.sent)

    def plus(self, seconds: float) -> Cost:
        return Cost(self.seconds + seconds, self.sent)


@dataclass(frozen=True)
class Layout:
    """Where the ranks are: `nodes` x `ppn` ranks, rank r on node r // ppn.
    `streams`: ranks of a node that use the network in the same step (0: all ppn)."""

    nodes: int
    ppn: int
    streams: int = 0

    @property
    def n(self) -> int:
        return self.nodes * self.ppn

    @property
    def sharing(self) -> int:
        return self.streams or self.ppn

    def label(self) -> str:
        return f"{self.n}" if self.nodes == 1 else f"{self.nodes}x{self.ppn}"


def log2up(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def steps_of(n: int) -> int:
    """Exchange steps of recursive doubling/halving: non-powers of two fold the extra
    ranks in before and out after (two more steps), as MPICH and Open MPI do."""
    if n <= 1:
        return 0
    return log2up(n) + (0 if n & (n - 1) == 0 else 2)


# -- raw MPI -----------------------------------------------------------------------------
def doubling(lay: Layout, nbytes: float, p: Params, reduce: bool = True) -> Cost:
    """Recursive doubling (the small-message allreduce of MPICH and Open MPI): each step
    exchanges the whole message with the partner at distance 1, 2, 4, ...; with block
    placement the first log2(ppn) steps stay in the node, the rest cross the network,
    every rank of a node at once."""
    g = p.gamma.time(nbytes) if reduce else 0.0
    intra, inter = steps_of(lay.ppn), steps_of(lay.nodes)
    t = intra * (p.shm.swap(nbytes) + g) + inter * (p.net.swap(nbytes, lay.sharing) + g)
    return Cost(t, (intra + inter) * nbytes)


def halving(lay: Layout, nbytes: float, p: Params) -> Cost:
    """Rabenseifner (MPICH's allreduce above 2 KiB: reduce-scatter by recursive halving,
    allgather by recursive doubling). The step at distance d = 1, 2, 4, ... moves
    m/2d bytes each way, so with block placement the large steps stay in the node and
    the network carries m/ppn x (1 - 1/nodes) per rank, m x (1 - 1/nodes) per node."""
    t, sent, chunk = 0.0, 0.0, nbytes
    for i in range(log2up(lay.n)):
        chunk /= 2
        near = (1 << i) < lay.ppn
        hop = p.shm.swap(chunk) if near else p.net.swap(chunk, lay.sharing)
        t += 2 * hop + p.gamma.time(chunk)
        sent += 2 * chunk
    extra = steps_of(lay.n) - log2up(lay.n)  # a non-power of two: the whole message in, out
    far = p.net if lay.nodes > 1 else p.shm
    return Cost(t + extra * (far.send(nbytes) + p.gamma.time(nbytes)), sent + extra * nbytes)


def ring(lay: Layout, nbytes: float, p: Params) -> Cost:
    """Ring allreduce (Open MPI 4.1's fixed rules pick a ring for large messages on many
    communicator sizes): 2(N-1) steps of m/N; each step waits for its network hop."""
    n = lay.n
    link = p.net if lay.nodes > 1 else p.shm
    chunk = nbytes / n
    return Cost(2 * (n - 1) * link.swap(chunk) + (n - 1) * p.gamma.time(chunk),
                2 * (n - 1) * chunk)


SHORT_MSG = 2048  # MPICH's MPIR_CVAR_ALLREDUCE_SHORT_MSG_SIZE: doubling below, halving above
MMAP_MAX = 32 << 20  # glibc's largest dynamic mmap threshold (DEFAULT_MMAP_THRESHOLD_MAX)


def temp_buffer(nbytes: float, p: Params) -> float:
    """MPI's allreduce takes a temporary buffer of the message's size on every call.
    Up to 32 MiB glibc serves it again from the heap; above, from a fresh mapping,
    whose every page faults in and is zeroed on first touch."""
    return p.fresh * nbytes if nbytes > MMAP_MAX else 0.0


def mpi_allreduce(lay: Layout, nbytes: float, p: Params) -> Cost:
    """Raw MPI_Allreduce as assumed here: doubling up to 2 KiB, Rabenseifner above, on a
    communicator that ignores nodes (flat, block placement)."""
    if nbytes <= SHORT_MSG:
        return doubling(lay, nbytes, p)
    return halving(lay, nbytes, p).plus(temp_buffer(nbytes, p) if lay.n > 1 else 0.0)


def mpi_allreduce_hier(lay: Layout, nbytes: float, p: Params) -> Cost:
    """A node-aware MPI_Allreduce (Open MPI's HAN, MPICH's SMP collectives): reduce to
    one leader per node (binomial over shm), allreduce among the leaders, broadcast
    back in the node. The leader carries the whole message over the network."""
    k = log2up(lay.ppn)
    local = Cost(2 * k * p.shm.send(nbytes) + k * p.gamma.time(nbytes)
                 + (temp_buffer(nbytes, p) if k else 0.0), 2 * k * nbytes)
    return local.add(mpi_allreduce(Layout(lay.nodes, 1), nbytes, p))


def mpi_allgather(lay: Layout, slot: float, p: Params) -> Cost:
    """Recursive-doubling allgather of `slot` bytes per rank: the step at distance d
    exchanges d slots; near steps in the node, far ones over the shared network."""
    t, sent = 0.0, 0.0
    for i in range(log2up(lay.n)):
        d = 1 << i
        nbytes = min(d, lay.n - d) * slot
        t += p.shm.swap(nbytes) if d < lay.ppn else p.net.swap(nbytes, lay.sharing)
        sent += nbytes
    return Cost(t, sent)


def ring_allgather(lay: Layout, slot: float, p: Params) -> Cost:
    """N - 1 steps, each passing one slot to the next rank; each step waits for the
    slowest hop in the ring (the network one, across nodes)."""
    link = p.net if lay.nodes > 1 else p.shm
    return Cost((lay.n - 1) * link.swap(slot), (lay.n - 1) * slot)


def linear_allgather(lay: Layout, slot: float, p: Params) -> Cost:
    """Every rank sends its slot to every other rank at once (Open MPI's libnbc
    Iallgather): 2 (N - 1) messages of CPU on each rank, and the node's link carries
    ppn x (N - ppn) slots out."""
    n = lay.n
    t = p.shm.alpha + 2 * (n - 1) * p.o_msg
    if lay.nodes > 1:
        t += p.net.send(slot * (n - lay.ppn), lay.ppn) - p.net.alpha
    return Cost(t, (n - 1) * slot)


def binomial(lay: Layout, nbytes: float, p: Params, reduce: bool = True) -> Cost:
    """Reduce up a binomial tree to rank 0, then broadcast down (Open MPI's libnbc
    Iallreduce for in-place calls, non-commutative ops and messages under 64 KiB):
    2 log2 N one-way steps of the whole message, the near ones inside the node; one
    rank per node crosses the network in a step."""
    near, far = log2up(lay.ppn), log2up(lay.nodes)
    g = p.gamma.time(nbytes) if reduce else 0.0
    t = 2 * (near * p.shm.send(nbytes) + far * p.net.send(nbytes)) + (near + far) * g
    return Cost(t, 2 * nbytes if lay.n > 1 else 0.0)


ALLGATHER_LONG = 512 << 10  # MPICH's MPIR_CVAR_ALLGATHER_LONG_MSG_SIZE: a ring from here


def rows_wire(lay: Layout, p: Params) -> Cost:
    """The rows round: MPI_Iallgather of one slot per rank. MPICH: recursive doubling
    for a power of two under 512 KiB in all, else (at 4096 ranks: 1.1 MB) a ring;
    Open MPI (libnbc): linear."""
    if p.mpi == "system":
        return linear_allgather(lay, SLOT_BYTES, p)
    if lay.n * SLOT_BYTES >= ALLGATHER_LONG:
        return ring_allgather(lay, SLOT_BYTES, p)
    return mpi_allgather(lay, SLOT_BYTES, p)


def compact_wire(lay: Layout, p: Params) -> Cost:
    """The compact round: MPI_Iallreduce of one 160-byte element under a non-commutative
    user op. MPICH runs user ops by recursive doubling in rank order; Open MPI's libnbc
    by a binomial reduce and broadcast."""
    if p.mpi == "system":
        return binomial(lay, COMPACT_BYTES, p, reduce=False)
    return doubling(lay, COMPACT_BYTES, p, reduce=False)


def data_iallreduce(lay: Layout, nbytes: float, p: Params) -> Cost:
    """The data stage below 1 MiB: MPI_Iallreduce in place. MPICH picks as for the
    blocking call; Open MPI's libnbc takes the binomial tree for every in-place call."""
    if p.mpi == "system":
        return binomial(lay, nbytes, p)
    return mpi_allreduce(lay, nbytes, p)


# -- asynclock ---------------------------------------------------------------------------
def check_after(lay: Layout, p: Params) -> Cost:
    """The compact round, whatever N is: one 160-byte element."""
    return compact_wire(lay, p).plus(p.o_eng)


def check_before(lay: Layout, p: Params) -> Cost:
    """Every call's rows round, as before the compact round: an allgather of one
    272-byte slot per rank (then a compare of N headers, nanoseconds each)."""
    return rows_wire(lay, p).plus(p.o_eng)


def check_rows(lay: Layout, p: Params) -> Cost:
    """A call whose ranks differ, or that needs every rank's dims: both rounds."""
    return check_after(lay, p).add(rows_wire(lay, p))


def data_extra(nbytes: float, p: Params) -> float:
    """The engine's CPU for the data stage beyond the check."""
    if nbytes <= INLINE_BYTES:
        return 0.0
    return p.o_stage if nbytes < THREAD_MIN_BYTES else p.o_bulk


def asynclock_allreduce(lay: Layout, nbytes: float, p: Params, before: bool = False) -> Cost:
    """A checked allreduce on MPI: the check, then (above 128 B) MPI_Iallreduce on the
    data communicator issued from the call, or from 1 MiB a blocking MPI_Allreduce in
    the channel's wait thread."""
    check = check_before(lay, p) if before else check_after(lay, p)
    if nbytes <= INLINE_BYTES:
        return check
    data = data_iallreduce(lay, nbytes, p) if nbytes < THREAD_MIN_BYTES else mpi_allreduce(
        lay, nbytes, p)
    return check.add(data).plus(data_extra(nbytes, p))


def shm_reduce_scatter(nbytes: float, ppn: int, p: Params) -> float:
    """The node window (docs/design/node-window.md): a rank copies in the slices its
    peers fold and folds its own 1/ppn slice over every rank's input, at one core's
    speed (ppn cores sharing the node's memory bandwidth is not modelled)."""
    if ppn <= 1:
        return 0.0
    chunk = nbytes / ppn
    copy, gamma = p.copy_all or p.copy, p.gamma_all or p.gamma
    return p.shm.alpha + copy.time((ppn - 1) * chunk) + (ppn - 1) * gamma.time(chunk)


def shm_allgather(nbytes: float, ppn: int, p: Params) -> float:
    """Each rank copies every folded slice out of its owner's region, its own too."""
    if ppn <= 1:
        return 0.0
    return p.shm.alpha + (p.copy_all or p.copy).time(nbytes)


def asynclock_allreduce_hier(lay: Layout, nbytes: float, p: Params) -> Cost:
    """The node window, asynclock's bulk path from 1 MiB where every node holds the same
    number of ranks, more than one: reduce-scatter in shared memory, every local rank
    allreduces its 1/ppn slice with its peers on the other nodes (ppn streams through
    the node's link at once), every rank copies the slices out. Below 1 MiB, and with
    one rank per node, the flat path."""
    if nbytes < THREAD_MIN_BYTES or lay.ppn < 2:
        return asynclock_allreduce(lay, nbytes, p)
    net = mpi_allreduce(Layout(lay.nodes, 1, streams=lay.ppn), nbytes / lay.ppn, p)
    local = shm_reduce_scatter(nbytes, lay.ppn, p) + shm_allgather(nbytes, lay.ppn, p)
    return check_after(lay, p).add(net).plus(local + data_extra(nbytes, p))


# -- Horovod -----------------------------------------------------------------------------
def hvd_bitvector_bytes(cached: int) -> int:
    """The response cache's bit vector: one bit per cached response plus 3 status bits,
    in 64-bit words."""
    return 8 * math.ceil((cached + HVD_STATUS_BITS) / 64)


def hvd_negotiation(lay: Layout, p: Params, cached: int = 1) -> Cost:
    """One cycle with every request a cache hit (the steady state): a blocking
    MPI_Allreduce (BAND) of the bit vector on every rank, work or not."""
    return doubling(lay, hvd_bitvector_bytes(cached), p, reduce=False)


def hvd_negotiation_miss(lay: Layout, p: Params, tensors: int = 1) -> Cost:
    """A cycle with an uncached request: the bit vector, then rank 0 gathers every
    rank's length (MPI_Gather, binomial) and requests (MPI_Gatherv, one message per
    rank into rank 0), and broadcasts the length and the responses (binomial)."""
    n = lay.n
    req = HVD_REQUEST_BYTES * tensors
    resp = (HVD_RESPONSE_BYTES + 4 * n) * tensors
    link = p.net if lay.nodes > 1 else p.shm
    steps = log2up(n)
    gather = steps * link.alpha + link.send(4 * (n - 1)) - link.alpha
    gatherv = link.alpha + (n - 1) * (p.o_msg + link.send(req) - link.alpha)
    bcasts = steps * (link.send(4) + link.send(resp))
    return hvd_negotiation(lay, p).add(Cost(gather + gatherv + bcasts, 4 + req))


def hvd_allreduce_sync(lay: Layout, nbytes: float, p: Params) -> Cost:
    """`hvd.allreduce` back to back: the request waits for the next cycle and the caller
    for its next 1 ms poll, then one negotiation and one MPI_Allreduce of the tensor."""
    wait = max(HVD_CYCLE_S, HVD_POLL_S)
    return hvd_negotiation(lay, p).add(mpi_allreduce(lay, nbytes, p)).plus(wait)


# -- the rank program (under mpiexec / mpirun) -------------------------------------------
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
        """Calls per batch from 3 warm-up calls' time, as rank 0 saw it."""
        n = max(3, min(20000, int(self.round_s / max(warm_s / 3, 1e-7))))
        return int(self.comm.bcast(n, root=0))

    def result(self, batches: list[float]) -> Sample:
        # the slowest rank's: a collective is done when its last rank is
        worst = _max_op()
        return Sample(float(self.comm.allreduce(statistics.median(batches), op=worst)),
                      float(self.comm.allreduce(min(batches), op=worst)))

    def time(self, fn: Callable[[], Any]) -> Sample:
        t0 = time.perf_counter()
        for _ in range(3):
            fn()
        n = self.count(time.perf_counter() - t0)
        batches = []
        for _ in range(self.rounds):
            self.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            batches.append((time.perf_counter() - t0) / n)
        return self.result(batches)

    async def time_async(self, fn: Callable[[], Any]) -> Sample:
        """`time` for an awaitable call."""
        t0 = time.perf_counter()
        for _ in range(3):
            await fn()
        n = self.count(time.perf_counter() - t0)
        batches = []
        for _ in range(self.rounds):
            self.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                await fn()
            batches.append((time.perf_counter() - t0) / n)
        return self.result(batches)


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


# -- running the probes ------------------------------------------------------------------
@dataclass
class Job:
    """One probe launch: an MPI, N ranks at `ppn` per host, a label."""

    mpi: str  # embedded (MPICH) or system (Open MPI)
    n: int
    ppn: int
    where: str  # local or netrig
    horovod: bool = False
    sizes: tuple[int, ...] = SIZES[:3]
    p2p: bool = False
    repeat: int = 0  # runs of this job (0: --repeat)
    env: dict[str, str] = field(default_factory=dict)


def probe_argv(job: Job, out: Path, args: argparse.Namespace, link: str) -> list[str]:
    argv = [sys.executable, str(Path(__file__).resolve()), "probe", "--json", str(out),
            "--sizes", ",".join(map(str, job.sizes)), "--link", link,
            "--rounds", str(args.rounds), "--round-s", str(args.round_s)]
    return argv + (["--horovod"] if job.horovod else []) + (["--p2p"] if job.p2p else [])


# asynclock's bulk allreduces on MPI only (no gloo probe), and no heartbeat thread
PROBE_ENV = {"ASYNCLOCK_BULK": "mpi", "ASYNCLOCK_BENCH_HOROVOD": "0", "OMP_NUM_THREADS": "1"}


def cpu_idle(seconds: float = 1.0) -> float:
    """The fraction of the machine's CPU time left idle over `seconds` (/proc/stat)."""
    def snap() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, all

    idle0, all0 = snap()
    time.sleep(seconds)
    idle1, all1 = snap()
    return (idle1 - idle0) / max(1, all1 - all0)


def wait_quiet(max_s: float, want: float = 0.85) -> float:
    """Start a job once other work on the machine has (mostly) stopped, or after
    `max_s`: the cores are shared, and a job beside a busy process measures it."""
    deadline = time.monotonic() + max_s
    while True:
        idle = cpu_idle()
        if idle >= want or time.monotonic() > deadline:
            return idle
        time.sleep(2.0)


def run_local(job: Job, args: argparse.Namespace) -> dict[str, Any] | None:
    sys.path.insert(0, str(ROOT / "mpi"))
    import mpi_select

    with tempfile.TemporaryDirectory(prefix="cost-model-") as tmp:
        out = Path(tmp) / "out.json"
        env = {**mpi_select.environ_for(job.mpi), **PROBE_ENV, **job.env}
        argv = mpi_select.launcher(job.mpi, job.n) + probe_argv(job, out, args, "local")
        idle = wait_quiet(args.quiet_s)
        t0 = time.monotonic()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True,
                              timeout=args.job_timeout, check=False)
        print(f"#   {time.monotonic() - t0:.0f} s, {idle:.0%} idle before", flush=True)
        return _finish(proc, out, job, idle)


def _finish(proc: subprocess.CompletedProcess[str], out: Path, job: Job,
            idle: float) -> dict[str, Any] | None:
    label = f"{job.where} {job.mpi} n={job.n} ppn={job.ppn}{' horovod' if job.horovod else ''}"
    print(f"# {label}: exit {proc.returncode}", flush=True)
    if proc.returncode != 0 or not out.exists():
        print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr)
        return None
    data: dict[str, Any] = json.loads(out.read_text())
    data["meta"].update(kind=job.mpi, where=job.where, horovod=job.horovod, idle=[idle])
    return data


def local_jobs(args: argparse.Namespace) -> Iterator[Job]:
    for mpi in args.mpis.split(","):
        for n in (1, 2, 4, 8):
            sizes = SIZES if n <= 2 else SIZES[:3]
            # the points the parameters come from get more runs
            yield Job(mpi, n, n, "local", sizes=sizes, p2p=n == 2, repeat=5 if n <= 2 else 0)
        if mpi == "system" and not args.skip_horovod:
            for n in (2, 4):
                yield Job(mpi, n, n, "local", horovod=True)


def netrig_jobs(args: argparse.Namespace) -> Iterator[Job]:
    for mpi in args.mpis.split(","):
        yield Job(mpi, 2, 1, "netrig", sizes=SIZES, p2p=True, repeat=5)
        yield Job(mpi, 4, 2, "netrig", p2p=True)
        if mpi == "system" and not args.skip_horovod:
            yield Job(mpi, 2, 1, "netrig", horovod=True)


def measure_netrig(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "tests" / "programs"))
    import netrig_rig

    reason = netrig_rig.unavailable()
    if reason is not None:
        raise SystemExit(f"netrig: {reason}")
    found = []
    with netrig_rig.Rig() as rig:
        rig.up(2)
        rig.rate(args.link)
        for job in netrig_jobs(args):
            data = repeated(partial(run_rig, rig=rig, args=args), job, args.repeat)
            if data is not None:
                found.append(data)
    return found


def run_rig(job: Job, rig: Any, args: argparse.Namespace) -> dict[str, Any] | None:
    with tempfile.TemporaryDirectory(prefix="cost-model-") as tmp:
        out = Path(tmp) / "out.json"
        idle = wait_quiet(args.quiet_s)
        live = rig.start(job.mpi, job.n, probe_argv(job, out, args, args.link),
                         {**PROBE_ENV, **job.env}, per_host=job.ppn)
        code = live.finish(args.job_timeout)
        data = _finish(subprocess.CompletedProcess([], code, live.output, ""), out, job, idle)
    rig.reap()
    return data


MEM_SIZES = (64 << 10, 512 << 10, 4 << 20, 64 << 20)


def machine_rows() -> list[dict[str, Any]]:
    """One core's memcpy and float32 sum by working-set size, best of 5 batches; and
    what memory the process has not touched yet costs (page faults, zeroing)."""
    import numpy as np
    import torch

    big = 64 << 20
    warm = torch.empty(big // 4)
    fresh = min(_once(lambda: torch.empty(big // 4).fill_(1.0), 1) for _ in range(5))
    refill = min(_once(lambda: warm.fill_(1.0), 1) for _ in range(5))
    rows = [{"kind": "fresh_memory", "bytes": big, "seconds": fresh - refill}]
    # one core's copy and sum, the best of 5 batches: the machine, not its other users
    for nbytes in MEM_SIZES:
        a = np.ones(nbytes // 4, np.float32)
        b = np.ones(nbytes // 4, np.float32)
        reps = max(1, (64 << 20) // nbytes)
        for kind, fn in (("memcpy", partial(np.copyto, b, a)),
                         ("sum_f32", partial(np.add, a, b, out=b))):
            fn()
            per = min(_once(fn, reps) for _ in range(5))
            rows.append({"kind": kind, "bytes": nbytes, "seconds": per})
    return rows + concurrent_rows()


def concurrent_rows() -> list[dict[str, Any]]:
    """The same copy and sum on every core at once (numpy releases the GIL): what each
    of a node's ranks gets while they all copy, as in the node window."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    cores = os.cpu_count() or 1
    rows = []
    for nbytes in MEM_SIZES:
        pairs = [(np.ones(nbytes // 4, np.float32), np.ones(nbytes // 4, np.float32))
                 for _ in range(cores)]
        reps = max(1, (64 << 20) // nbytes)
        for kind, op in (("memcpy_all_cores", np.copyto), ("sum_f32_all_cores", _add_into)):
            with ThreadPoolExecutor(cores) as pool:
                batch = partial(_on_every_core, pool, op, pairs, reps)
                batch()
                per = min(_once(batch, 1) for _ in range(5)) / reps
            rows.append({"kind": kind, "bytes": nbytes, "seconds": per, "cores": cores})
    return rows


def _add_into(dst: Any, src: Any) -> None:
    """np.copyto's signature, summing instead."""
    import numpy as np

    np.add(src, dst, out=dst)


def _on_every_core(pool: Any, op: Callable[[Any, Any], Any], pairs: list[tuple[Any, Any]],
                   reps: int) -> None:
    list(pool.map(partial(_repeat, op, reps=reps), pairs))


def _repeat(op: Callable[[Any, Any], Any], ab: tuple[Any, Any], reps: int) -> None:
    dst, src = ab
    for _ in range(reps):
        op(dst, src)


def _once(fn: Callable[[], Any], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def repeated(run: Callable[[Job], dict[str, Any] | None], job: Job,
             times: int) -> dict[str, Any] | None:
    """The job `times` times; each figure the median of the runs (a short run on a
    shared machine meets another process now and then)."""
    runs = [d for d in (run(job) for _ in range(job.repeat or times)) if d is not None]
    if not runs:
        return None
    merged: dict[tuple[Any, ...], list[float]] = {}
    for d in runs:
        for r in d["rows"]:
            merged.setdefault((r["kind"], r.get("where"), r["bytes"]), []).append(r["seconds"])
    best: dict[tuple[Any, ...], float] = {}
    for d in runs:
        for r in d["rows"]:
            key = (r["kind"], r.get("where"), r["bytes"])
            best[key] = min(best.get(key, math.inf), r.get("min", r["seconds"]))
    rows = [{"kind": k, "where": w, "bytes": b, "seconds": statistics.median(v),
             "best": best[(k, w, b)], "runs": v} for (k, w, b), v in merged.items()]
    idle = [i for d in runs for i in d["meta"]["idle"]]
    return {"meta": {**runs[0]["meta"], "runs": len(runs), "idle": idle}, "rows": rows}


def measure(args: argparse.Namespace) -> None:
    stored = load(args.params)
    jobs = stored.get("jobs", [])
    found: list[dict[str, Any]] = []
    if args.measure in ("local", "machine"):
        stored["machine"] = {"rows": machine_rows(), "host": platform.node(),
                             "cpus": os.cpu_count(), "python": platform.python_version()}
    if args.measure == "local":
        found = [d for d in (repeated(partial(run_local, args=args), j, args.repeat)
                             for j in local_jobs(args)) if d is not None]
    elif args.measure == "netrig":
        found = measure_netrig(args)
    replaced = {_job_key(d["meta"]) for d in found}
    jobs = [d for d in jobs if _job_key(d["meta"]) not in replaced] + found
    stamp = time.strftime("%Y-%m-%d %H:%M", time.localtime())
    stored.update(jobs=jobs, measured={**stored.get("measured", {}), args.measure: stamp})
    Path(args.params).write_text(json.dumps(stored, indent=1) + "\n")
    print(f"# wrote {args.params}: {len(found)} jobs ({args.measure}, {stamp})")


def _job_key(meta: dict[str, Any]) -> tuple[Any, ...]:
    return (meta["where"], meta["kind"], meta["n"], meta["ppn"], meta.get("horovod", False))


def load(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else {}


# -- fitting the parameters --------------------------------------------------------------
class Points:
    """The measured rows of every job, looked up by job and kind."""

    def __init__(self, stored: dict[str, Any]) -> None:
        self.jobs: list[dict[str, Any]] = stored.get("jobs", [])
        self.machine: list[dict[str, Any]] = stored.get("machine", {}).get("rows", [])

    def job(self, kind: str, where: str, n: int, ppn: int,
            horovod: bool = False) -> dict[str, Any] | None:
        return next((j for j in self.jobs if _job_key(j["meta"]) == (where, kind, n, ppn, horovod)),
                    None)

    def get(self, job: dict[str, Any] | None, kind: str, nbytes: int | None = None,
            where: str | None = None) -> float | None:
        """A parameter's figure: the best of the job's runs (another process on the
        shared cores only ever adds time; the parameters describe the machine)."""
        if job is None:
            return None
        for r in job["rows"]:
            if r["kind"] == kind and (nbytes is None or r["bytes"] == nbytes) and (
                    where is None or r.get("where") == where):
                return float(r.get("best", r["seconds"]))
        return None


def fit_link(pts: Points, job: dict[str, Any] | None, where: str) -> Link | None:
    """Half the ping-pong's round trip, and the exchange, at each measured size."""
    curves = []
    for kind in ("pingpong", "exchange"):
        found = [(float(b), pts.get(job, kind, b, where)) for b in P2P_SIZES]
        points = tuple((b, t) for b, t in found if t is not None)
        if len(points) < 2:
            return None
        curves.append(Curve(points))
    return Link(*curves)


def fit_rate(pts: Points, kind: str) -> Rate | None:
    points = tuple((float(r["bytes"]), r["seconds"] / r["bytes"])
                   for r in pts.machine if r["kind"] == kind)
    return Rate(Curve(tuple(sorted(points)))) if points else None


def fit(pts: Points, mpi: str) -> Params | None:
    """One MPI's parameters: links from ping-pongs (2 ranks on this machine, 2 netrig
    hosts), the engine's costs from 1-rank jobs, memory from one core."""
    one = pts.job(mpi, "local", 1, 1)
    two = pts.job(mpi, "local", 2, 2)
    shm = fit_link(pts, two, "intra")
    net = fit_link(pts, pts.job(mpi, "netrig", 2, 1), "inter")
    loop = fit_link(pts, pts.job(mpi, "netrig", 4, 2), "intra")
    copy, gamma = fit_rate(pts, "memcpy"), fit_rate(pts, "sum_f32")
    if one is None or shm is None or copy is None or gamma is None:
        return None

    def at_one(kind: str, nbytes: int) -> float:
        return pts.get(one, kind, nbytes) or 0.0

    a4 = at_one("asynclock_allreduce", 4)
    stage = at_one("asynclock_allreduce", 64 << 10) - a4 - at_one("mpi_allreduce", 64 << 10)
    bulk = at_one("asynclock_allreduce", 4 << 20) - a4 - at_one("mpi_allreduce", 4 << 20)
    fresh = next((r["seconds"] / r["bytes"] for r in pts.machine
                  if r["kind"] == "fresh_memory"), 0.0)
    return Params(mpi=mpi, shm=shm, net=net or shm, gamma=gamma, copy=copy, fresh=fresh,
                  copy_all=fit_rate(pts, "memcpy_all_cores"),
                  gamma_all=fit_rate(pts, "sum_f32_all_cores"),
                  o_msg=pts.get(two, "stream", 8, "intra") or 0.0,
                  o_eng=max(0.0, a4 - at_one("mpi_iallreduce_compact", COMPACT_BYTES)),
                  o_stage=max(0.0, stage), o_bulk=max(0.0, bulk), loop=loop)


# -- validation and predictions ----------------------------------------------------------
MPI_NAMES = {"embedded": "MPICH", "system": "Open MPI"}
VALIDATE: tuple[tuple[str, int, int, int], ...] = (  # where, n, ppn, nodes
    ("local", 2, 2, 1), ("local", 4, 4, 1), ("local", 8, 8, 1),
    ("netrig", 2, 1, 2), ("netrig", 4, 2, 2))
Model = Callable[[Layout, Params], Cost]


def models_for(nbytes: int) -> dict[str, Model]:
    """Measured kind -> the model of it, for one size where a size applies."""
    return {
        "mpi_allreduce": lambda lay, p: mpi_allreduce(lay, nbytes, p),
        # asynclock's default path: the node window where it applies
        "asynclock_allreduce": lambda lay, p: asynclock_allreduce_hier(lay, nbytes, p),
    }


FIXED: dict[tuple[str, int], Model] = {
    ("mpi_iallreduce_compact", COMPACT_BYTES): compact_wire,
    ("mpi_iallgather_rows", SLOT_BYTES): rows_wire,
    ("mpi_allreduce_band", 8): lambda lay, p: hvd_negotiation(lay, p),
    ("hvd_miss_mpi", HVD_REQUEST_BYTES): lambda lay, p: hvd_negotiation_miss(lay, p),
}
def hvd_model(nbytes: int) -> Model:
    return lambda lay, p: hvd_allreduce_sync(lay, nbytes, p)


def model_of(kind: str, nbytes: int) -> Model | None:
    if (kind, nbytes) in FIXED:
        return FIXED[(kind, nbytes)]
    if kind == "horovod_allreduce":
        return hvd_model(nbytes)
    return models_for(nbytes).get(kind)


def rig_params(p: Params, where: str) -> Params:
    """On netrig both MPIs are told to use TCP only: ranks of one emulated host talk
    over TCP on loopback, not shared memory."""
    if where == "netrig" and p.loop is not None:
        return replace(p, shm=p.loop)
    return p


def validation(stored: dict[str, Any]) -> list[dict[str, Any]]:
    pts = Points(stored)
    out = []
    for mpi in ("embedded", "system"):
        p = fit(pts, mpi)
        if p is None:
            continue
        for where, n, ppn, nodes in VALIDATE:
            lay = Layout(nodes, ppn)
            for horovod in (False, True):
                job = pts.job(mpi, where, n, ppn, horovod)
                if job is None:
                    continue
                for r in job["rows"]:
                    model = model_of(r["kind"], r["bytes"])
                    if model is None:
                        continue
                    pred = model(lay, rig_params(p, where)).seconds
                    best = r.get("best", r["seconds"])
                    out.append({"mpi": mpi, "where": where, "layout": lay.label(), "ranks": n,
                                "kind": r["kind"], "bytes": r["bytes"],
                                "measured": r["seconds"], "best": best, "predicted": pred,
                                "error": (pred - r["seconds"]) / r["seconds"],
                                "error_best": (pred - best) / best})
    return out


def fmt_s(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


def fmt_b(b: float) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"


KIND_TEXT = {
    "mpi_allreduce": "MPI_Allreduce", "asynclock_allreduce": "asynclock allreduce_",
    "mpi_iallreduce_compact": "compact round's MPI call (Iallreduce 160 B)",
    "mpi_iallgather_rows": "rows round's MPI call (Iallgather 272 B/rank)",
    "mpi_allreduce_band": "Horovod negotiation (Allreduce 8 B BAND)",
    "hvd_miss_mpi": "Horovod miss cycle (MPI calls)", "horovod_allreduce": "hvd.allreduce_",
}


def render_validation(rows: list[dict[str, Any]]) -> str:
    lines = ["| MPI | ranks | what | size | measured: median (best) | model | error: median "
             "(best) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        where = r["layout"] + (" (netrig)" if r["where"] == "netrig" else "")
        size = fmt_b(r["bytes"]) if r["kind"] in ("mpi_allreduce", "asynclock_allreduce",
                                                  "horovod_allreduce") else ""
        lines.append(f"| {MPI_NAMES[r['mpi']]} | {where} | {KIND_TEXT[r['kind']]} | {size} | "
                     f"{fmt_s(r['measured'])} ({fmt_s(r['best'])}) | {fmt_s(r['predicted'])} | "
                     f"{r['error'] * 100:+.0f}% ({r['error_best'] * 100:+.0f}%) |")
    return "\n".join(lines)


def render_params(ps: list[Params]) -> str:
    lines = ["| parameter | " + " | ".join(MPI_NAMES[p.mpi] for p in ps) + " |"]
    lines.append("| --- |" + " --- |" * len(ps))

    def row(name: str, get: Callable[[Params], str]) -> None:
        lines.append(f"| {name} | " + " | ".join(get(p) for p in ps) + " |")

    row("alpha shm: half round trip, 8 B, one node", lambda p: fmt_s(p.shm.alpha))
    for size in (64 << 10, 4 << 20, 64 << 20):
        row(f"shm bandwidth at {fmt_b(size)}", partial(_link_bw, "shm", size))
    row("alpha net: 8 B between netrig hosts", lambda p: fmt_s(p.net.alpha))
    for size in (64 << 10, 4 << 20, 64 << 20):
        row(f"net bandwidth at {fmt_b(size)}", partial(_link_bw, "net", size))
    row("alpha loop: 8 B, one netrig host (TCP)", lambda p: fmt_s(p.loop.alpha) if p.loop else "-")
    row("o: CPU per small message (stream)", lambda p: fmt_s(p.o_msg))
    row("o_eng: asynclock per checked call", lambda p: fmt_s(p.o_eng))
    row("o_stage: data stage from the call", lambda p: fmt_s(p.o_stage))
    row("o_bulk: wait-thread hand-off", lambda p: fmt_s(p.o_bulk))
    row("fresh memory: first touch per 4 KiB page", lambda p: fmt_s(p.fresh * 4096))
    for size in (64 << 10, 64 << 20):
        row(f"gamma: float32 sum at {fmt_b(size)}", partial(_rate_bw, "gamma", size))
        row(f"memcpy at {fmt_b(size)}", partial(_rate_bw, "copy", size))
    for size in (4 << 20, 64 << 20):
        row(f"sum, every core at once, at {fmt_b(size)}", partial(_rate_bw, "gamma_all", size))
        row(f"memcpy, every core at once, at {fmt_b(size)}", partial(_rate_bw, "copy_all", size))
    return "\n".join(lines)


def _link_bw(level: str, nbytes: int, p: Params) -> str:
    link: Link = getattr(p, level)
    return _bw(link.beta(nbytes))


def _rate_bw(what: str, nbytes: int, p: Params) -> str:
    rate: Rate | None = getattr(p, what)
    return _bw(rate.curve.at(nbytes)) if rate is not None else "-"


def _bw(beta: float) -> str:
    if beta <= 0:
        return "inf"
    gbs = 1 / beta / 1e9
    return f"{gbs:.2f} GB/s ({gbs * 8:.1f} Gbit/s)"


Sized = Callable[[Layout, int, Params], Cost]


def unsized(fn: Callable[[Layout, Params], Cost]) -> Sized:
    """A cost that does not depend on the message, as a row of the predictions."""
    return lambda lay, m, p: fn(lay, p)


# The predictions' rows; False: the cost does not depend on the message (one row).
SCALE_ROWS: tuple[tuple[str, Sized, bool], ...] = (
    ("asynclock check, after (compact)", unsized(check_after), False),
    ("asynclock check, before (rows every call)", unsized(check_before), False),
    ("asynclock check, ranks differ (compact + rows)", unsized(check_rows), False),
    ("asynclock allreduce, flat (ASYNCLOCK_WINDOW=0)", asynclock_allreduce, True),
    ("asynclock allreduce, node window from 1 MiB (default)", asynclock_allreduce_hier, True),
    ("MPI_Allreduce, flat", mpi_allreduce, True),
    ("MPI_Allreduce, node leaders", mpi_allreduce_hier, True),
    ("MPI_Allreduce, ring (latency bound at scale)", ring, True),
    ("Horovod negotiation, cache hit (per cycle)", unsized(hvd_negotiation), False),
    ("Horovod negotiation, miss (per cycle)", unsized(hvd_negotiation_miss), False),
    ("hvd.allreduce, synchronous", hvd_allreduce_sync, True),
)


def render_predictions(p: Params, layouts: Iterable[Layout]) -> str:
    lays = list(layouts)
    head = "| what | size | " + " | ".join(f"{lay.label()} ({lay.n})" for lay in lays) + " |"
    lines = [head, "| --- | --- |" + " --- |" * len(lays)]
    for name, fn, sized in SCALE_ROWS:
        for m in (SIZES if sized else (0,)):
            cells = [fn(lay, m, p) for lay in lays]
            lines.append(f"| {name} | {fmt_b(m) if m else '-'} | " + " | ".join(
                f"{fmt_s(c.seconds)}, {fmt_b(c.sent)}" for c in cells) + " |")
    return "\n".join(lines)


def assumed_net(spec: str) -> Link:
    """A network given as "ALPHA_US,GBIT" (a straight line, full duplex), for what-ifs."""
    alpha_us, gbit = (float(x) for x in spec.split(","))
    alpha, big = alpha_us * 1e-6, float(64 << 20)
    line = Curve(((8.0, alpha), (big, alpha + big * 8 / (gbit * 1e9))))
    return Link(line, line)


def report(stored: dict[str, Any], net: str | None = None) -> str:
    pts = Points(stored)
    ps = [p for p in (fit(pts, m) for m in ("embedded", "system")) if p is not None]
    if not ps:
        return "no parameters yet: run --measure local (and --measure netrig as root)"
    machine = stored.get("machine", {})
    out = [f"measured: {stored.get('measured', {})}, machine: {machine.get('host')} "
           f"({machine.get('cpus')} CPUs)",
           "\n## Parameters\n", render_params(ps),
           "\n## Validation: model vs measured (slowest rank's median per call)\n"]
    checked = validation(stored)
    cpus = int(machine.get("cpus") or 0)
    fits = [r for r in checked if r["ranks"] <= cpus]
    out += [f"\nOne rank per core or fewer ({cpus} cores):\n", render_validation(fits),
            f"\nMore ranks than the {cpus} cores (netrig's hosts share them too):\n",
            render_validation([r for r in checked if r["ranks"] > cpus])]
    where = "netrig's 5 Gbit/s TCP between nodes"
    if net is not None:
        ps = [replace(p, net=assumed_net(net)) for p in ps]
        where = f"an assumed network: {net.split(',')[0]} us, {net.split(',')[1]} Gbit/s"
    for p in ps:
        out += [f"\n## Predictions, {MPI_NAMES[p.mpi]} parameters ({where}): latency, "
                "bytes sent per rank\n",
                render_predictions(p, [Layout(8, 8)] + [Layout(*s) for s in SCALES])]
    return "\n".join(out)


# -- command line ------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("report", "probe"), default="report")
    p.add_argument("--measure", choices=("local", "netrig", "machine"),
                   help="machine: one core's memory figures only")
    p.add_argument("--net", metavar="ALPHA_US,GBIT",
                   help="predict for this network between nodes instead of netrig's")
    p.add_argument("--params", default=str(PARAMS_JSON))
    p.add_argument("--mpis", default="embedded,system")
    p.add_argument("--link", default="5gbit", help="netrig link rate")
    p.add_argument("--rounds", type=int, default=15, help="timed batches per figure and job")
    p.add_argument("--repeat", type=int, default=3, help="jobs per configuration (median)")
    p.add_argument("--round-s", type=float, default=0.03)
    p.add_argument("--job-timeout", type=float, default=240.0)
    p.add_argument("--skip-horovod", action="store_true")
    p.add_argument("--quiet-s", type=float, default=60.0,
                   help="wait up to this long for an idle machine before each job")
    # probe only
    p.add_argument("--json", default="cost_probe.json")
    p.add_argument("--sizes", default=",".join(map(str, SIZES[:3])))
    p.add_argument("--horovod", action="store_true")
    p.add_argument("--p2p", action="store_true", help="ping-pong and message stream too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.mode == "probe":
        probe(args)
        return 0
    if args.measure:
        measure(args)
    print(report(load(args.params), args.net))
    return 0


if __name__ == "__main__":
    sys.exit(main())
