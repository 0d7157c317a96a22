"""Large allreduces through the node's shared-memory window.

Ranks on one node can read each other's memory, so a large allreduce need
not travel between them as messages: MPI's shared-memory transport copies
every byte through its own buffers, more than once, and takes about three
times as long as a copy of the data (figures on the benchmarks page). A
channel therefore keeps an MPI-3 shared window (`MPI_Win_allocate_shared`
on the node's ranks), made by its first large allreduce and grown when a
larger one needs it: one region per local rank, each behind a small
control block (progress counters and a futex bell). One allreduce over L
ranks per node:

1. each rank copies its input into its region, all but the slice it owns
   (slice k of every region belongs to local rank k);
2. rank k reduces slice k over the local ranks in local rank order, its own
   part read straight from its input, into its region;
3. across nodes (L ranks on every node), rank k allreduces its slice with
   the ranks of local rank k on the other nodes (MPI, on a communicator of
   their own, once an Ibarrier waited for without spinning shows all are there:
   `settle`), so the data leaves every node striped over all its ranks;
4. every rank copies every slice out of its owner's region.

Each slice is reduced by one rank and copied by all, so every rank of a
node ends with the same bits, and on one node they are numpy's rank-order
fold. Ranks move on counters that each publishes in its control block and
sleep on its bell. A counter is stored between two `MPI_Win_sync` (a memory
barrier: large copies are non-temporal stores, which a plain store does not
order) and read between two, so the data it vouches for is visible to
whoever sees it. A rank writes its region for the next allreduce only after
every rank has copied the previous one out of it.

Whether an allreduce takes the window is decided from what the header round
agreed (size, dtype, op) and the agreed settings, never from local timing;
the layout (the same number of ranks on every node, more than one) is
learned by a collective at the channel's first such allreduce, and every
rank learns the same. The whole allreduce runs in the channel's wait thread
(`engine.wait_thread`), in the channel's agreed order; numpy's copies and
sums release the GIL, so the loop keeps running.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base import futex
from ..base.errors import BackendError
from ..base.ops import ReduceOp
from ..base.reduce import ufunc
from .settle import settle

Array = np.ndarray[Any, Any]

# What numpy reduces exactly as MPI does. 16-bit floats never arrive here as
# such: they are summed by the 16-bit ring (`ring`) or widened to float32 first.
WINDOW_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8,
                                                np.int16, np.int32, np.int64))
ARRIVED, REDUCED, LEFT, ABORTED = range(4)  # int64 counters at the start of a control block
BELL_OFFSET = 128  # the futex word peers ring, on its own cache line
CTL_BYTES = 4096  # a control block; the region after it starts on a page
GROW_STEP = 1 << 20  # regions grow in whole MiB, and by half at least
# Ranks of one node usually reach a step within this of each other: a short spin
# answers sooner than a futex round trip, and sleeping after it keeps an
# oversubscribed node's cores for the ranks that work.
SPIN_S = 50e-6
CHECK_S = 0.1  # a sleeping rank looks at its peers' abort flags this often
CLOSE_WAIT_S = 10.0  # how long closing waits for peers to finish the last allreduce


class NodeWindow:
    """One channel's shared window; its allreduces run in the channel's wait thread."""

    def __init__(self, comm: Any, min_bytes: int, mpi_op: Callable[[ReduceOp], Any]) -> None:
        self.min_bytes = min_bytes
        self.calls = 0  # allreduces that went through the window
        self._comm, self._mpi_op = comm, mpi_op
        self._usable: bool | None = None  # learned at the first allreduce (collective)
        self._node: Any = None
        self._cross: Any = None  # the ranks of my local rank on every node
        self._win: Any = None
        self.rank = self.size = 0  # on the node
        self._capacity = 0  # bytes of every region
        self._epoch = 0  # allreduces through the current window
        self._regions: list[Array] = []
        self._counters: list[Array] = []
        self._bells: list[Array] = []
        self._bell_addresses: list[int] = []
        self._rings = itertools.count(1)
        self._busy = False  # an allreduce is under way in the wait thread

    def takes(self, recv: Array) -> bool:
        """This allreduce goes to the window: decided from agreed facts only (size and
        dtype; every reduce op has a numpy twin)."""
        return recv.nbytes >= self.min_bytes and recv.dtype in WINDOW_DTYPES

    def allreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> bool:
        """Reduce `send` (None: `recv` itself) into `recv` over the communicator.
        False: its layout has no use for a window (every rank learns the same), and
        the caller sends the data over MPI. Average sums; the caller divides."""
        if self._usable is None:
            self._usable = self._learn_layout()
        if not self._usable:
            return False
        self._busy = True
        try:
            self._reserve(recv.nbytes)
            self._epoch += 1
            self._step_through((recv if send is None else send).reshape(-1),
                               recv.reshape(-1), op)
        finally:
            self._busy = False
        self.calls += 1
        return True

    def close(self) -> None:
        """Free the window and its communicators: collective over the node, like the
        channel's close, which comes once nothing is in flight on any rank. A window
        still in use here, that an allreduce failed in, or that a peer has not
        finished with after `CLOSE_WAIT_S` stays mapped until MPI ends: its peers
        may never come to free it, and freeing waits for all of them."""
        if self._win is not None and self._finished_everywhere():
            self._win.Unlock_all()
            self._win.Free()
        self._win = None
        for comm in (self._cross, self._node):
            if comm is not None:
                comm.Free()
        self._cross = self._node = None

    def _finished_everywhere(self) -> bool:
        if self._busy or self._aborted():
            return False
        try:
            return self._wait_all(LEFT, self._epoch, CLOSE_WAIT_S)
        except BackendError:  # a peer failed meanwhile
            return False

    # -- set-up (collective, in the channel's order) ---------------------------------
    def _learn_layout(self) -> bool:
        """Split the communicator by node; usable when every node holds the same
        number of its ranks, more than one."""
        from mpi4py import MPI

        comm = self._comm
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        local = node.Get_size()
        extremes = np.array([local, -local], np.int64)
        comm.Allreduce(MPI.IN_PLACE, extremes, MPI.MAX)
        if int(extremes[0]) != -int(extremes[1]) or local < 2:
            node.Free()
            return False
        self._node, self.rank, self.size = node, node.Get_rank(), local
        self._cross = comm.Split(self.rank, comm.Get_rank())
        return True

    def _reserve(self, nbytes: int) -> None:
        """Make every region hold `nbytes`: a new window, once every rank has copied
        the last allreduce out of the old one (the size is agreed, so every rank
        grows at the same call)."""
        if nbytes <= self._capacity:
            return
        from mpi4py import MPI

        if self._win is not None:
            self._wait_all(LEFT, self._epoch)
            self._win.Unlock_all()
            self._win.Free()
            self._win = None
        wanted = max(nbytes, self._capacity + self._capacity // 2)
        capacity = -(-wanted // GROW_STEP) * GROW_STEP
        win = MPI.Win.Allocate_shared(CTL_BYTES + capacity, 1, comm=self._node)
        win.Lock_all(MPI.MODE_NOCHECK)
        memory: list[Any] = [win.Shared_query(q)[0] for q in range(self.size)]
        self._counters = [np.frombuffer(m, np.int64, count=4) for m in memory]
        self._bells = [np.frombuffer(m, np.uint32, count=1, offset=BELL_OFFSET) for m in memory]
        self._bell_addresses = [b.ctypes.data for b in self._bells]
        self._regions = [np.frombuffer(m, np.uint8, count=capacity, offset=CTL_BYTES)
                         for m in memory]
        self._counters[self.rank][:] = 0  # MPI does not promise zeroed memory
        win.Sync()
        self._node.Barrier()  # nobody reads a control block before its owner cleared it
        self._win, self._capacity, self._epoch = win, capacity, 0

    # -- one allreduce -----------------------------------------------------------------
    def _step_through(self, src: Array, out: Array, op: ReduceOp) -> None:
        try:
            self._run(src, out, op)
        except BaseException:
            self._abort()
            raise

    def _run(self, src: Array, out: Array, op: ReduceOp) -> None:
        n, me, epoch = self.size, self.rank, self._epoch
        bounds = [out.size * k // n for k in range(n + 1)]
        views = [r[: out.nbytes].view(out.dtype) for r in self._regions]
        mine = views[me]
        self._wait_all(LEFT, epoch - 1)  # nobody still copies out of my region
        for k in range(n):
            if k != me:
                mine[bounds[k]: bounds[k + 1]] = src[bounds[k]: bounds[k + 1]]
        self._publish(ARRIVED, epoch)
        lo, hi = bounds[me], bounds[me + 1]
        self._wait_all(ARRIVED, epoch)
        self._reduce_slice([src[lo:hi] if q == me else views[q][lo:hi] for q in range(n)],
                           mine[lo:hi], op)
        if self._cross.Get_size() > 1:
            from mpi4py import MPI

            settle(self._cross.Ibarrier())  # a late node is waited for asleep
            self._cross.Allreduce(MPI.IN_PLACE, mine[lo:hi], self._mpi_op(op))
        self._publish(REDUCED, epoch)
        self._wait_all(REDUCED, epoch)
        for k in range(n):
            out[bounds[k]: bounds[k + 1]] = views[k][bounds[k]: bounds[k + 1]]
        self._publish(LEFT, epoch)

    @staticmethod
    def _reduce_slice(parts: list[Array], acc: Array, op: ReduceOp) -> None:
        """Fold `parts` (local rank order) into `acc`: the same order on every node."""
        fold = ufunc(op)
        fold(parts[0], parts[1], out=acc)
        for part in parts[2:]:
            fold(acc, part, out=acc)

    # -- counters and bells ------------------------------------------------------------
    def _publish(self, counter: int, value: int) -> None:
        """Say how far I am, after everything I wrote before it, and ring the peers."""
        self._win.Sync()
        self._counters[self.rank][counter] = value
        self._win.Sync()
        count = next(self._rings)
        for q in range(self.size):
            if q != self.rank:
                futex.ring(self._bells[q], self._bell_addresses[q], self.rank + 1, count)

    def _wait_all(self, counter: int, value: int, limit_s: float | None = None) -> bool:
        """Until every rank's `counter` reached `value` (True), or `limit_s` passed
        (False); a peer's abort raises here."""
        start = time.perf_counter()
        while True:
            bell = int(self._bells[self.rank][0])  # read first: a ring after it wakes us
            self._win.Sync()
            least = min(int(c[counter]) for c in self._counters)
            self._win.Sync()  # the data the counters vouch for is read after them
            if least >= value:
                return True
            failed = self._aborted()
            if failed:
                raise BackendError(f"node rank {failed[0]} failed in a shared-window allreduce; "
                                   "every later one on this channel fails too")
            waited = time.perf_counter() - start
            if limit_s is not None and waited >= limit_s:
                return False
            if waited >= SPIN_S:
                futex.wait(self._bell_addresses[self.rank], bell, CHECK_S)

    def _aborted(self) -> list[int]:
        return [q for q, c in enumerate(self._counters) if int(c[ABORTED])]

    def _abort(self) -> None:
        """This rank failed mid-allreduce: its peers fail instead of waiting for it,
        and so does every later allreduce through this window, on every rank."""
        if self._counters and not int(self._counters[self.rank][ABORTED]):
            self._publish(ABORTED, 1)
