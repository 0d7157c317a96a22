"""Intra-node gradient reduction through an MPI shared-memory window.

When every rank lives on one node (and the transport is MPI), the
gradient buffers themselves are allocated in an MPI-3 shared window
(`MPI_Win_allocate_shared`), so each rank can read every other rank's
buffer. A bucket is then reduced without any message: rank r sums chunk r
of the bucket over all ranks' buffers into its own, and copies the other
chunks back from their owners. Measured on the 2-core machine this project
runs on, a 42 MiB average takes ~7 ms of CPU this way against ~21 ms for
MPI_Allreduce (which copies through the transport and spins while waiting).

Synchronisation stays on the gradient channel and stays checked: a round
is a few agreed stages (see `ShmTransport`), each a header-checked
collective whose name carries the plan's checksum, so ranks that disagree
raise the same MismatchError; and one "released" barrier ends the round.
The arithmetic runs in one worker thread per reducer, never on the event
loop. While a rank has joined (`asynclock.join`) it cannot reduce its
chunks, so a round's first stage is refused on every rank and that round's
buckets go as plain MPI allreduces, which joined ranks stand in for.
"""

from __future__ import annotations

import os
import queue
import threading
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from ..collective_ops import AllreduceOp, BarrierOp
from ..errors import JoinedError
from ..header import EVERY_RANK, Call
from ..operation import Lane
from ..ops import DTYPE_CODES, Kind, ReduceOp
from ..progress import Engine
from ..tensors import as_buffer
from ..threadsafe import name_os_thread
from .buckets import Bucket, Plan
from .run import StepRun
from .scheduler import BucketOp, bucket_op

ALIGN = 64
Done = Callable[[BaseException | None], None]


def eligible(coord: Any, lane: Lane) -> bool:
    """One node, MPI underneath, threads allowed to call MPI, not switched off."""
    backend = coord.backend
    return (os.environ.get("ASYNCLOCK_SHM", "1") != "0" and backend.name == "mpi"
            and coord.size > 1 and coord.local_size == coord.size
            and getattr(backend, "thread_level", 0) >= 3 and hasattr(lane.transport, "data"))


class SharedArena:
    """One shared window per plan: every rank's gradient buffers, visible to all."""

    def __init__(self, comm: Any, group_bytes: dict[str, int]) -> None:
        from mpi4py import MPI

        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
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
        name_os_thread("asynclock-shm")
        while (item := self._queue.get()) is not None:
            self._do(*item)
            del item  # hold no tensor while idle (see progress._WaitThread)

    def _do(self, job: Callable[[], None], then: Done) -> None:
        error: BaseException | None = None
        try:
            job()
        except Exception as exc:  # surfaced as the bucket's error on the loop
            error = exc
        self._call_soon(partial(then, error))

    def stop(self) -> None:
        """Finish queued jobs, then end the thread (no torch op runs at exit)."""
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=10)


class _Round:
    """One round's pipeline state (loop side)."""

    def __init__(self, run: StepRun, done: Callable[[int, BaseException | None], None]) -> None:
        self.run, self.done = run, done
        self.order = run.plan.launch
        self.launched = 0  # buckets packed on this rank, counted in launch order
        self.agreed = 0  # buckets every rank has packed (agreed by the last stage)
        self.pending: range = range(0)  # positions reduced but not yet gathered
        self.stage = 0
        self.finishing = False
        self.busy = False  # a stage op or a job of this round is in flight
        self.failed: BaseException | None = None
        self.over_mpi: int | None = None  # a rank joined: buckets issued as plain allreduces
        self.landed = 0  # ... and completed


class _Agree(AllreduceOp):
    """The stage op: min over ranks of "buckets packed here", with a callback."""

    def __init__(self, lane: Lane, call: Call, value: np.ndarray[Any, Any],
                 on_done: Callable[[int, BaseException | None], None]) -> None:
        super().__init__(lane, call, as_buffer(value, writable=True), value, ReduceOp.MIN)
        self.value, self.on_done = value, on_done

    def complete(self, value: Any) -> None:
        super().complete(value)
        self.on_done(int(self.value[0]), None)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.on_done(0, exc)


class ShmTransport:
    """Loop side: each round as a few agreed stages; arithmetic in the worker.

    Stage j is a checked allreduce(min) of how many buckets (in launch order)
    each rank has packed: its result says which buckets every rank has
    packed, so however the ranks' backward passes drift, they agree on
    which buckets the stage covers. After it one worker job gathers the
    previous stage's buckets (they are then done) and reduces this stage's
    chunks. During backward a stage covers a bucket or two; everything
    ready when backward ends goes in one stage. A barrier then finishes the
    last stage and another releases the round's buffers. The stage count and
    names follow from agreed values only, so every rank issues the same
    sequence; names carry a checksum of the plan, so ranks on different
    plans raise the same MismatchError.
    """

    windowed = False  # a stage waits for buckets, not for credits

    def __init__(self, engine: Engine, lane: Lane, arena: SharedArena, plan: Plan,
                 peers: dict[str, list[torch.Tensor]], post: float,
                 call_soon: Callable[[Callable[[], object]], None]) -> None:
        self.engine, self.lane, self.arena, self.plan = engine, lane, arena, plan
        self.peers, self.post = peers, post
        self.worker = _Worker(call_soon)
        self._rounds: dict[int, _Round] = {}
        self.crc = zlib.crc32(repr([(b.group, b.numel) for b in plan.buckets]
                                   + list(plan.launch)).encode())

    def launch(self, run: StepRun, k: int, done: Callable[[int, BaseException | None], None]
               ) -> None:
        """Bucket k (next in launch order) is packed on this rank."""
        rnd = self._rounds.get(run.number)
        if rnd is None:
            rnd = self._rounds[run.number] = _Round(run, done)
        rnd.launched += 1
        self._advance(rnd)

    def _advance(self, rnd: _Round) -> None:
        if rnd.busy or rnd.failed:
            return
        if rnd.over_mpi is not None:
            return self._issue_over_mpi(rnd)
        tag = f"g{rnd.run.generation}.{self.crc:08x}"
        if rnd.agreed < rnd.run.size and rnd.launched > rnd.agreed:
            rnd.busy, rnd.stage = True, rnd.stage + 1
            call = Call(Kind.ALLREDUCE, self.lane.next_seq(), op=int(ReduceOp.MIN),
                        dtype=DTYPE_CODES["int64"], shape=(1,), nbytes=8,
                        name=f"{tag}.s{rnd.stage}", root=EVERY_RANK)
            value = np.array([rnd.launched], np.int64)
            self.engine.submit(_Agree(self.lane, call, value, partial(self._staged, rnd)))
        elif rnd.agreed == rnd.run.size and not rnd.finishing:
            rnd.busy = rnd.finishing = True
            self._barrier(f"{tag}.last", partial(self._staged, rnd, rnd.agreed))

    def _staged(self, rnd: _Round, upto: int, err: BaseException | None) -> None:
        """Every rank packed buckets [0, upto): gather the last stage, reduce this one."""
        if isinstance(err, JoinedError) and rnd.stage == 1:  # no data moved yet this round
            rnd.busy, rnd.over_mpi = False, 0
            return self._advance(rnd)
        if err is not None:
            return self._fail(rnd, err)
        gather = [self.plan.buckets[rnd.order[p]] for p in rnd.pending]
        fresh = range(rnd.agreed, upto)
        reduce = [self.plan.buckets[rnd.order[p]] for p in fresh]
        self.worker.submit(partial(self._job, gather, reduce),
                           partial(self._worked, rnd, rnd.pending, fresh))
        return None

    def _worked(self, rnd: _Round, gathered: range, fresh: range,
                err: BaseException | None) -> None:
        if err is not None:
            return self._fail(rnd, err)
        for p in gathered:
            rnd.done(rnd.order[p], None)
        rnd.pending, rnd.agreed, rnd.busy = fresh, max(rnd.agreed, fresh.stop), False
        if rnd.finishing:
            del self._rounds[rnd.run.number]
            self._barrier(f"g{rnd.run.generation}.{self.crc:08x}.released", rnd.run.release)
        else:
            self._advance(rnd)
        return None

    def _issue_over_mpi(self, rnd: _Round) -> None:
        """A rank has joined (`asynclock.join`): shared memory needs every rank's own
        data, so this round's buckets go, in launch order, as plain allreduces that
        joined ranks stand in for. Every active rank saw the same refusal of stage 1."""
        assert rnd.over_mpi is not None
        tag = f"g{rnd.run.generation}.{self.crc:08x}"
        while rnd.over_mpi < rnd.launched:
            k = rnd.order[rnd.over_mpi]
            b = self.plan.buckets[k]
            view = self.peers[b.group][self.arena.rank][b.offset: b.offset + b.numel]
            done = partial(self._reduced_over_mpi, rnd, k, view)
            op = bucket_op(self.lane, as_buffer(view, writable=True), f"{tag}.m{rnd.over_mpi}",
                           done)
            rnd.over_mpi += 1
            self.engine.submit(op)

    def _reduced_over_mpi(self, rnd: _Round, k: int, view: torch.Tensor, op: BucketOp) -> None:
        if rnd.failed:
            return
        if op.error is not None:
            return self._fail(rnd, op.error)
        post = self.post

        def scale() -> None:
            if post != 1.0:
                view.mul_(post)

        self.worker.submit(scale, partial(self._landed, rnd, k))
        return None

    def _landed(self, rnd: _Round, k: int, err: BaseException | None) -> None:
        if rnd.failed:
            return
        if err is not None:
            return self._fail(rnd, err)
        rnd.done(k, None)
        rnd.landed += 1
        if rnd.landed == rnd.run.size:  # MPI read our buffers inside each op: no barrier
            del self._rounds[rnd.run.number]
            rnd.run.release(None)
        return None

    def _fail(self, rnd: _Round, err: BaseException) -> None:
        """Errors are collective: every rank stops this round at the same stage.

        The round stays registered, failed: a bucket packed later (ranks pack
        at their own pace) must not start a fresh round whose stage op only
        this rank would issue (seen as a desync at shutdown).
        """
        rnd.failed = err
        for k in rnd.order:
            if not rnd.run.done[k].is_set():
                rnd.done(k, err)
        rnd.run.release(err)

    def _barrier(self, name: str, then: Done) -> None:
        call = Call(Kind.BARRIER, self.lane.next_seq(), name=name, root=EVERY_RANK)
        self.engine.submit(_Barrier(self.lane, call, then))

    def _job(self, gather: list[Bucket], reduce: list[Bucket]) -> None:
        self.arena.sync()
        for b in gather:
            self._gather(b)
        for b in reduce:
            self._reduce(b)
        self.arena.sync()

    def _reduce(self, b: Bucket) -> None:
        """Sum my chunk over ranks, in rank order whoever owns the chunk, so the
        bits do not depend on the layout (IEEE addition commutes, it does not
        associate)."""
        me, n = self.arena.rank, self.arena.size
        lo, hi = chunk(b, me, n)
        parts = [buf[lo:hi] for buf in self.peers[b.group]]
        acc = parts[me]
        if me < 2:
            acc.add_(parts[1 - me])  # x0 + x1, the same bits as x1 + x0
        else:
            head = parts[0] + parts[1]
            for q in range(2, me):
                head.add_(parts[q])
            torch.add(head, acc, out=acc)
        for q in range(max(2, me + 1), n):
            acc.add_(parts[q])
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
