"""Intra-node gradient reduction through an MPI shared-memory window.

When every rank lives on one node (and the transport is MPI), the
gradient buffers themselves are allocated in an MPI-3 shared window
(`MPI_Win_allocate_shared`), so each rank can read every other rank's
buffer. A bucket is then reduced without any message: rank r sums chunk r
of the bucket over all ranks' buffers into its own, and copies the other
chunks back from their owners. Measured on the 2-core machine this project
runs on, a 42 MiB average takes ~7 ms of CPU this way against ~21 ms for
MPI_Allreduce (which copies through the transport and spins while waiting).

Synchronisation stays on the gradient channel and stays checked: per bucket,
an "arrived" and a "reduced" barrier (header-checked: the name carries the
bucket, its plan generation and its size, so ranks that disagree raise the
same MismatchError), and one "released" barrier per round. Buckets go one at
a time in the agreed order, so the barrier sequence is identical on every
rank. The arithmetic runs in one worker thread per reducer, never on the
event loop.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..collective_ops import BarrierOp
from ..header import Call
from ..operation import Lane
from ..ops import Kind
from ..progress import Engine
from .buckets import Bucket, Plan
from .run import StepRun

ALIGN = 64
Done = Callable[[BaseException | None], None]


def eligible(coord: Any) -> bool:
    """One node, MPI underneath, threads allowed to call MPI, not switched off."""
    backend = coord.backend
    return (os.environ.get("ASYNCLOCK_SHM", "1") != "0" and backend.name == "mpi"
            and coord.size > 1 and coord.local_size == coord.size
            and getattr(backend, "thread_level", 0) >= 3 and hasattr(backend, "world"))


class SharedArena:
    """One shared window per plan: every rank's gradient buffers, visible to all."""

    def __init__(self, world: Any, group_bytes: dict[str, int]) -> None:
        from mpi4py import MPI

        self.node = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
        self.rank, self.size = self.node.Get_rank(), self.node.Get_size()
        self.offsets: dict[str, int] = {}
        total = 0
        for group, n in sorted(group_bytes.items()):
            self.offsets[group] = total
            total += -(-n // ALIGN) * ALIGN
        self.win = MPI.Win.Allocate_shared(max(total, ALIGN), 1, comm=self.node)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.bases = [torch.frombuffer(self.win.Shared_query(q)[0], dtype=torch.uint8,
                                       count=max(total, ALIGN)) for q in range(self.size)]

    def buffers(self, group: str, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Group `group`'s flat buffer of every rank (index = node rank)."""
        start = self.offsets[group]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return [b[start: start + nbytes].view(dtype) for b in self.bases]

    def sync(self) -> None:
        """Memory barrier for the window (MPI_Win_sync) around cross-rank reads."""
        self.win.Sync()


def chunk(bucket: Bucket, r: int, n: int) -> tuple[int, int]:
    """Rank r's share [lo, hi) of the bucket, in group-buffer elements."""
    base, extra = divmod(bucket.numel, n)
    lo = bucket.offset + r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


class _Barrier(BarrierOp):
    """A checked barrier that calls back when it ends."""

    def __init__(self, lane: Lane, call: Call, on_done: Done) -> None:
        super().__init__(lane, call)
        self.on_done = on_done

    def complete(self, value: Any) -> None:
        super().complete(value)
        self.on_done(None)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.on_done(exc)


class _Worker:
    """One thread for the reduction arithmetic; results go back to the loop."""

    def __init__(self, call_soon: Callable[[Callable[[], object]], None]) -> None:
        self._call_soon = call_soon
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], Done] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="asynclock-shm", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], then: Done) -> None:
        self._queue.put((job, then))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            job, then = item
            error: BaseException | None = None
            try:
                job()
            except Exception as exc:  # surfaced as the bucket's error on the loop
                error = exc
            self._call_soon(partial(then, error))

    def stop(self) -> None:
        self._queue.put(None)


class _Round:
    """One round's pipeline: barrier j = "bucket j-1 reduced, bucket j packed"."""

    def __init__(self, run: StepRun, done: Callable[[int, BaseException | None], None]) -> None:
        self.run, self.done = run, done
        self.order = run.plan.launch
        self.launched = 0  # buckets handed over, in launch order
        self.next_barrier = 0
        self.reduced = 0  # buckets whose chunk this rank has reduced
        self.busy = False  # a barrier or a job of this round is in flight
        self.failed: BaseException | None = None


class ShmTransport:
    """Loop side: the barrier pipeline of each round; arithmetic in the worker.

    Barrier j (for j in 0..n) says "I reduced my chunk of bucket j-1 and packed
    bucket j"; after it, one worker job gathers bucket j-1 (which is then
    done) and reduces bucket j. A last barrier releases the round's buffers.
    So a round of n buckets costs n + 2 checked barriers, issued in the same
    order on every rank.
    """

    windowed = False  # bucket j completes only after j+1 is launched: no credit window

    def __init__(self, engine: Engine, lane: Lane, arena: SharedArena, plan: Plan,
                 peers: dict[str, list[torch.Tensor]], post: float,
                 call_soon: Callable[[Callable[[], object]], None]) -> None:
        self.engine, self.lane, self.arena, self.plan = engine, lane, arena, plan
        self.peers, self.post = peers, post
        self.worker = _Worker(call_soon)
        self._rounds: dict[int, _Round] = {}

    def launch(self, run: StepRun, k: int, done: Callable[[int, BaseException | None], None]
               ) -> None:
        """Bucket k (next in launch order) is packed on this rank."""
        rnd = self._rounds.get(run.number)
        if rnd is None:
            rnd = self._rounds[run.number] = _Round(run, done)
        rnd.launched += 1
        self._advance(rnd)

    def _advance(self, rnd: _Round) -> None:
        n = rnd.run.size
        j = rnd.next_barrier
        if rnd.busy or rnd.failed or j > n or rnd.reduced < j or (j < n and rnd.launched <= j):
            return
        rnd.busy, rnd.next_barrier = True, j + 1
        tag = f"g{rnd.run.generation}.{j}/{n}"
        if j < n:
            b = self.plan.buckets[rnd.order[j]]
            tag += f".b{b.index}.{b.numel}{b.group}"
        self._barrier(tag, partial(self._passed, rnd, j))

    def _passed(self, rnd: _Round, j: int, err: BaseException | None) -> None:
        if err is not None:
            return self._fail(rnd, err)
        n, order = rnd.run.size, rnd.order
        gather = self.plan.buckets[order[j - 1]] if j > 0 else None
        reduce = self.plan.buckets[order[j]] if j < n else None
        self.worker.submit(partial(self._job, gather, reduce), partial(self._worked, rnd, j))
        return None

    def _worked(self, rnd: _Round, j: int, err: BaseException | None) -> None:
        if err is not None:
            return self._fail(rnd, err)
        rnd.busy = False
        n = rnd.run.size
        if j < n:
            rnd.reduced = j + 1
        if j > 0:
            rnd.done(rnd.order[j - 1], None)
        if j == n:
            del self._rounds[rnd.run.number]
            self._barrier(f"g{rnd.run.generation}.released", rnd.run.release)
        else:
            self._advance(rnd)
        return None

    def _fail(self, rnd: _Round, err: BaseException) -> None:
        """Errors are collective: every rank stops this round at the same barrier."""
        rnd.failed = err
        self._rounds.pop(rnd.run.number, None)
        for k in rnd.order:
            if not rnd.run.done[k].is_set():
                rnd.done(k, err)
        rnd.run.release(err)

    def _barrier(self, name: str, then: Done) -> None:
        call = Call(Kind.BARRIER, self.lane.next_seq(), name=name)
        self.engine.submit(_Barrier(self.lane, call, then))

    def _job(self, gather: Bucket | None, reduce: Bucket | None) -> None:
        self.arena.sync()
        if gather is not None:
            self._gather(gather)
        if reduce is not None:
            self._reduce(reduce)
        self.arena.sync()

    def _reduce(self, b: Bucket) -> None:
        me, n = self.arena.rank, self.arena.size
        lo, hi = chunk(b, me, n)
        bufs = self.peers[b.group]
        acc = bufs[me][lo:hi]
        for q in range(n):
            if q != me:
                acc.add_(bufs[q][lo:hi])
        if self.post != 1.0:
            acc.mul_(self.post)

    def _gather(self, b: Bucket) -> None:
        me, n = self.arena.rank, self.arena.size
        bufs = self.peers[b.group]
        for q in range(n):
            if q != me:
                lo, hi = chunk(b, q, n)
                bufs[me][lo:hi].copy_(bufs[q][lo:hi])

    def close(self) -> None:
        self.worker.stop()
