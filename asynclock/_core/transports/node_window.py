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
fold. The window, its control blocks, the counters' memory ordering, the
bells and which rank owns which slice are `shared_window`'s (the gradient
engine's shared-memory rounds use the same); ranks move on counters ARRIVED,
REDUCED and LEFT. A rank writes its region for the next allreduce only after
every rank has copied the previous one out of it.

Whether an allreduce takes the window is decided from what the header round
agreed (size, dtype, op) and the agreed settings, never from local timing;
the layout (the same number of ranks on every node, more than one) is
learned by a collective at the channel's first such allreduce, and every
rank learns the same. The whole allreduce runs in the channel's wait thread
(`engine.wait_thread`), in the channel's agreed order; numpy's copies and
sums release the GIL, so the loop keeps running.

A mid-size allreduce that a caller awaits may instead run on the loop, as a
request the caller's poller tests (`on_loop`): each test takes the next step
whose peers are there and never waits, which saves the two hand-overs between
threads, each a wake-up of a sleeping thread. It does so only on one node, in
a window already made large enough, and with nothing of this window queued
for the wait thread. Where the engine handed the window C steps (`use_c_steps`:
`_fastpath.c`'s WindowSteps: the same steps on the same counters and bells)
and the dtype and op have a C fold, those run them, without the Python calls
around every counter and copy; otherwise `_Plan`'s do.

An allreduce takes its epoch when it starts, the loop's when it is issued
and the thread's when the thread reaches it, which is after every allreduce
issued before it started; each waits for every rank's LEFT of the epoch
before (its own rank's included) before it writes its region. So every rank
runs the window's allreduces in issue order whichever path each takes, and
ranks may take different paths (thread or loop, C or Python steps) for the
same allreduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..base.errors import BackendError
from ..base.header import NUMPY_FOLDS
from ..base.ops import ReduceOp
from ..base.reduce import ufunc
from .settle import settle
from .shared_window import (
    BELL_OFFSET,
    CTL_BYTES,
    PEER,
    SLEEPERS_OFFSET,
    SharedWindow,
    owned_slice,
)

Array = np.ndarray[Any, Any]

# What numpy reduces exactly as MPI does. 16-bit floats never arrive here as
# such: they are summed by the 16-bit ring (`ring`) or widened to float32 first.
WINDOW_DTYPES = frozenset(np.dtype(t) for t in (np.float32, np.float64, np.int8, np.uint8,
                                                np.int16, np.int32, np.int64))
ARRIVED, REDUCED, LEFT = 1, 2, 3  # counters after `shared_window.ABORTED` (`_fastpath.c` too)
GROW_STEP = 1 << 20  # regions grow in whole MiB, and by half at least
FAILED = "a shared-window allreduce; every later one on this channel fails too"
CLOSE_WAIT_S = 10.0  # how long closing waits for peers to finish the last allreduce
# what each step of a loop allreduce (copy in, fold the own slice, copy out) waits for:
# every rank's counter past the epoch before, then at this epoch
STEP_WAITS = (LEFT, ARRIVED, REDUCED)


class NodeWindow:
    """One channel's shared window; its allreduces run in the channel's wait thread."""

    def __init__(self, comm: Any, min_bytes: int, mpi_op: Callable[[ReduceOp], Any]) -> None:
        self.min_bytes = min_bytes
        self.calls = 0  # allreduces that went through the window
        self.loop_calls = 0  # of them, those the loop ran (`on_loop`)
        self.c_calls = 0  # of those, the ones the C steps ran (`use_c_steps`)
        self._comm, self._mpi_op = comm, mpi_op
        self._usable: bool | None = None  # learned at the first allreduce (collective)
        self._node: Any = None
        self._cross: Any = None  # the ranks of my local rank on every node
        self._win: SharedWindow | None = None
        self.rank = self.size = 0  # on the node
        self._capacity = 0  # bytes of every region
        self._epoch = 0  # allreduces through the current window
        self._busy = False  # an allreduce is under way (wait thread or loop)
        # allreduces handed to the wait thread, and those it ended: each written by one
        # thread only (the loop hands, the wait thread ends)
        self.handed = self.ended = 0
        self._c_steps: Callable[..., Any] | None = None  # `use_c_steps`
        self._c_window: Any = None  # the C steps over the current window
        self._c_for: SharedWindow | None = None  # ... which is this one

    def use_c_steps(self, make: Callable[..., Any] | None) -> None:
        """Run the loop's allreduces with C steps (`_fastpath.c`'s WindowSteps class,
        handed over by the engine, which loads the extension); None: with Python's.
        Each of the channel's lanes hands the same class: made once per window."""
        if make is not self._c_steps:
            self._c_steps, self._c_for = make, None

    def c_steps(self, win: SharedWindow) -> Any:
        """The C steps over `win`, made once per window; None without them."""
        if self._c_steps is None:
            return None
        if self._c_for is not win:
            bases = tuple(int(c.ctypes.data) for c in win.counters)
            layout = (CTL_BYTES, BELL_OFFSET, SLEEPERS_OFFSET)
            self._c_window = self._c_steps(bases, win.rank, layout, win.region_bytes,
                                           win.writer(PEER), win.rings(PEER), win)
            self._c_for = win
        return self._c_window

    def takes(self, recv: Array) -> bool:
        """This allreduce goes to the window: decided from agreed facts only (size and
        dtype; every reduce op has a numpy twin)."""
        return recv.nbytes >= self.min_bytes and recv.dtype in WINDOW_DTYPES

    def on_loop(self, send: Array | None, recv: Array, op: ReduceOp) -> LoopAllreduce | None:
        """This allreduce as a request the loop polls, or None where it must run in the
        wait thread (`loop_ready`)."""
        if not self.loop_ready(recv.nbytes):
            return None
        return LoopAllreduce(self, (recv if send is None else send).reshape(-1),
                             recv.reshape(-1), op)

    def loop_ready(self, nbytes: int) -> bool:
        """Whether `on_loop` takes an allreduce of `nbytes` now, from this rank's state
        alone: not where the window is not made yet, or too small, or spans nodes, or
        an allreduce of it is queued in the wait thread, or a rank failed in it."""
        win = self._win
        return not (win is None or not self._usable or self._cross.Get_size() > 1
                    or self.handed != self.ended or self._busy or nbytes > self._capacity
                    or win.aborted())

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
            self._win.free()
        self._win = None
        for comm in (self._cross, self._node):
            if comm is not None:
                comm.Free()
        self._cross = self._node = None

    def _finished_everywhere(self) -> bool:
        assert self._win is not None
        if self._busy or self._win.aborted():
            return False
        try:
            return self._win.wait(LEFT, self._epoch, FAILED, CLOSE_WAIT_S)
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
        if self._win is not None:
            self._win.wait(LEFT, self._epoch, FAILED)
            self._win.free()
            self._win = None
        wanted = max(nbytes, self._capacity + self._capacity // 2)
        capacity = -(-wanted // GROW_STEP) * GROW_STEP
        self._win = SharedWindow.allocate(self._node, capacity)
        self._capacity, self._epoch = capacity, 0

    # -- one allreduce -----------------------------------------------------------------
    def _step_through(self, src: Array, out: Array, op: ReduceOp) -> None:
        try:
            self._run(src, out, op)
        except BaseException:
            self._abort()
            raise

    def _run(self, src: Array, out: Array, op: ReduceOp) -> None:
        win = self._win
        assert win is not None
        epoch, plan = self._epoch, _Plan(win, self.rank, out)
        win.wait(LEFT, epoch - 1, FAILED)  # nobody still copies out of my region
        plan.copy_in(src)
        win.publish(ARRIVED, epoch)
        win.wait(ARRIVED, epoch, FAILED)
        lo, hi = plan.fold(src, op)
        if self._cross.Get_size() > 1:
            from mpi4py import MPI

            settle(self._cross.Ibarrier())  # a late node is waited for asleep
            self._cross.Allreduce(MPI.IN_PLACE, plan.mine[lo:hi], self._mpi_op(op))
        win.publish(REDUCED, epoch)
        win.wait(REDUCED, epoch, FAILED)
        plan.copy_out(out)
        win.publish(LEFT, epoch)

    def _abort(self) -> None:
        """This rank failed mid-allreduce: its peers fail instead of waiting for it,
        and so does every later allreduce through this window, on every rank."""
        if self._win is not None:
            self._win.abort()


class _Plan:
    """One allreduce's slices and views of the window: its three data steps."""

    def __init__(self, win: SharedWindow, me: int, out: Array) -> None:
        n = win.size
        self.me = me
        self.slices = [owned_slice(out.size, k, n) for k in range(n)]
        self.views = [r[: out.nbytes].view(out.dtype) for r in win.regions]
        self.mine = self.views[me]

    def copy_in(self, src: Array) -> None:
        """Every slice but my own into my region, for its owner to fold."""
        for k, (a, z) in enumerate(self.slices):
            if k != self.me:
                self.mine[a:z] = src[a:z]

    def fold(self, src: Array, op: ReduceOp) -> tuple[int, int]:
        """Fold my slice over every rank, in local rank order (the same order on every
        node), my own part read from `src`, into my region; returns the slice."""
        lo, hi = self.slices[self.me]
        parts = [src[lo:hi] if q == self.me else v[lo:hi] for q, v in enumerate(self.views)]
        fold, acc = ufunc(op), self.mine[lo:hi]
        fold(parts[0], parts[1], out=acc)
        for part in parts[2:]:
            fold(acc, part, out=acc)
        return lo, hi

    def copy_out(self, out: Array) -> None:
        """Every folded slice from its owner's region."""
        for k, (a, z) in enumerate(self.slices):
            out[a:z] = self.views[k][a:z]


class LoopAllreduce:
    """A window allreduce on one node that the loop polls (`NodeWindow.on_loop`): each
    `Test` takes the next steps whose peers are there, and never waits."""

    polled = True  # the engine polls it on the loop, never hands it to the wait thread

    def __init__(self, window: NodeWindow, src: Array, out: Array, op: ReduceOp) -> None:
        assert window._win is not None
        self._window, self._win = window, window._win
        self._src, self._out, self._op = src, out, op
        window._busy = True
        window._epoch += 1
        self._epoch, self._step, self._over = window._epoch, 0, False
        fold = NUMPY_FOLDS.get((out.dtype, ReduceOp.SUM if op is ReduceOp.AVERAGE else op))
        flat = src.flags.c_contiguous and out.flags.c_contiguous  # C takes plain memory
        steps = window.c_steps(self._win) if fold is not None and flat else None
        self._c = steps.start(src, out, fold, self._epoch) if steps is not None else None
        self._plan = _Plan(self._win, window.rank, out) if self._c is None else None

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        if self._over:
            return True
        try:
            if not self._advance():
                return False
        except BaseException:
            self._window._abort()
            self._end()
            raise
        self._window.calls += 1
        self._window.loop_calls += 1
        self._window.c_calls += self._c is not None
        self._end()
        return True

    def Wait(self) -> None:  # noqa: N802 - the engine polls it; kept for the protocol
        while not self.Test():
            self._win.wait(*self._awaits(), FAILED)

    def _advance(self) -> bool:
        """Take every step whose peers are there: True once all are taken; a failed
        peer raises, as the window's wait does."""
        if self._c is not None:
            got = self._c.advance()
            self._step = self._c.step
            if got < 0:
                raise BackendError(f"node rank {-got - 1} failed in {FAILED}")
            return bool(got)
        while self._step < len(STEP_WAITS):
            if not self._ready():
                return False
            self._take_step()
        return True

    def _awaits(self) -> tuple[int, int]:
        """The counter and value every rank must reach before my next step."""
        return STEP_WAITS[self._step], self._epoch - 1 if self._step == 0 else self._epoch

    def _ready(self) -> bool:
        """The peers reached what my next step reads: the window's wait, without
        waiting (it raises if one failed)."""
        return self._win.wait(*self._awaits(), FAILED, 0.0)

    def _take_step(self) -> None:
        win, epoch, plan = self._win, self._epoch, self._plan
        assert plan is not None  # the Python steps'
        if self._step == 0:
            plan.copy_in(self._src)
            win.publish(ARRIVED, epoch)
        elif self._step == 1:
            plan.fold(self._src, self._op)
            win.publish(REDUCED, epoch)
        else:
            plan.copy_out(self._out)
            win.publish(LEFT, epoch)
        self._step += 1

    def _end(self) -> None:
        self._over = True
        self._window._busy = False
