"""The cost model of bench/cost_model.py: its parameters and one small function per
collective and algorithm, for raw MPI, asynclock and Horovod (formulas and the reasons
for each: docs/design/cost_model.md).

The model is Hockney's, with each link's cost taken by message size from
measurements (a one-way message and an exchange) instead of one straight
line alpha + beta*m: reducing m bytes costs g(m), and each rank's call costs
a fixed CPU time in the engine. Links are per level: `shm` between ranks of
one node, `net` between nodes; ranks of a node that cross the network in the
same step share its link. Which algorithm an MPI runs is stated per function,
from its source; real MPIs switch by size and by communicator size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from asynclock._core.base.header import COMPACT_BYTES, INLINE_BYTES, SLOT_BYTES
from asynclock._core.engine.policy import ProgressPolicy

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

SIZES = (4, 64 << 10, 4 << 20, 64 << 20)  # the message sizes the tables show


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
