"""Intra-node gradient reduction through a shared-memory window.

When every rank lives on one node, the gradient buffers themselves are
allocated in a shared window, so each rank can read every other rank's
buffer: an MPI-3 shared window (`MPI_Win_allocate_shared`) under MPI, or,
in a job with no MPI world (`horovodrun --gloo`, where Horovod would carry
buckets through gloo's sockets), one file of /dev/shm that every rank maps.
A bucket is then reduced without any message: rank r sums chunk r of the
bucket over all ranks' buffers and stores the sum in every rank's buffer,
where each rank's `.grad` views it. That takes a fraction of the CPU of an
MPI_Allreduce, which copies through the transport and spins while waiting
(figures on the benchmarks page).

Each round starts with one checked collective on the gradient channel,
whose name carries the plan's checksum, so ranks that disagree raise the
same MismatchError. Everything after it runs in one pipeline thread per
reducer (`shm_pipeline`), from progress counters every rank publishes in
the window and a futex to wake it: no MPI call and no event-loop wake-up
per bucket. While a rank has joined (`engine.join`) it cannot reduce its
chunks, so a round's first stage is refused on every rank and that round's
buckets go as plain allreduces on the lane, which joined ranks stand in for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..._core.base import settings
from ..._core.base.errors import JoinedError
from ..._core.base.tensors import as_buffer
from ..._core.engine.operation import Lane
from ..._core.engine.progress import Engine
from ..._core.runtime import failure
from ..._core.transports.shared_window import CTL_BYTES, FENCE_OK, SharedWindow
from .buckets import Plan
from .scheduler import BucketOp, RoundCheck, bucket_op, round_tag
from .shm_chunks import HandedGrads, chunk
from .shm_pipeline import RoundJob, ShmPipeline
from .step_run import StepRun

ALIGN = 64
SHARDED_JOIN = ("a rank joined (hvd.join()) while shard_optimizer=True: every rank updates "
                "its own pieces of the parameters, so a rank without data cannot stand in "
                "for the others; give every rank the same number of batches, or build the "
                "optimizer without shard_optimizer")
__all__ = ["SharedArena", "ShmTransport", "chunk", "eligible", "file_bytes", "mpi_window"]


def eligible(coord: Any, lane: Lane) -> bool:
    """One node, not switched off, and a window to be had: MPI's, where threads may
    call MPI, or else a mapped file (`horovodrun --gloo`), where `fence` is a barrier."""
    if not (settings.flag("ASYNCLOCK_NODE_WINDOW") and coord.size > 1
            and coord.local_size == coord.size):
        return False
    if coord.backend.name == "mpi":
        return mpi_window(coord, lane)
    # an elastic world re-forms around lost ranks, which a mapped file does not follow
    return FENCE_OK and coord.backend.name == "horovod" and failure.policy() != "reform"


def mpi_window(coord: Any, lane: Lane) -> bool:
    """MPI underneath, with threads allowed to call it: the window is MPI's own."""
    backend = coord.backend
    return (backend.name == "mpi" and getattr(backend, "thread_level", 0) >= 3
            and hasattr(lane.transport, "data"))


class SharedArena:
    """One shared window per plan (`transports.shared_window`): every rank's gradient
    buffers in its region, visible to all, behind its control block. The window is
    MPI's (`over_mpi`) or a mapped file's (`over_file`); `node` is the MPI node
    communicator where there is one (the sharded optimizer needs it)."""

    def __init__(self, window: SharedWindow, offsets: dict[str, int], node: Any = None) -> None:
        self.window, self.offsets, self.node = window, offsets, node
        self.rank, self.size = window.rank, window.size
        self.bases = [torch.from_numpy(r) for r in window.regions]

    @classmethod
    def over_mpi(cls, comm: Any, group_bytes: dict[str, int]) -> SharedArena:
        """Collective over `comm`: the window MPI allocates over its node."""
        from mpi4py import MPI

        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        offsets, total = layout(group_bytes)
        return cls(SharedWindow.allocate(node, total), offsets, node)

    @classmethod
    def over_file(cls, rank: int, size: int, mapping: Any,
                  group_bytes: dict[str, int]) -> SharedArena:
        """The window over a zero-filled file every rank mapped (`file_bytes` long)."""
        offsets, total = layout(group_bytes)
        return cls(SharedWindow.over_mapping(rank, size, mapping, total), offsets)

    def close(self) -> None:
        """Free the window and its node communicator (collective over the node, where
        MPI made them)."""
        self.window.free()
        if self.node is not None:
            self.node.Free()

    def buffers(self, group: str, dtype: torch.dtype, numel: int) -> list[torch.Tensor]:
        """Group `group`'s flat buffer of every rank (index = node rank)."""
        start = self.offsets[group]
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return [b[start: start + nbytes].view(dtype) for b in self.bases]


def layout(group_bytes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Each dtype group's byte offset in a region, and the region's size."""
    offsets: dict[str, int] = {}
    total = 0
    for group, n in sorted(group_bytes.items()):
        offsets[group] = total
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


def file_bytes(size: int, group_bytes: dict[str, int]) -> int:
    """The length of the file `SharedArena.over_file` maps for `size` ranks."""
    return size * (CTL_BYTES + layout(group_bytes)[1])


class _Round:
    """One round's state, shared by the hook thread and the loop (under `lock`)."""

    def __init__(self, run: StepRun) -> None:
        self.run = run
        self.order = run.plan.launch
        self.lock = threading.Lock()
        self.ready = [False] * len(self.order)  # by bucket index
        self.launched = 0  # launch-order prefix packed on this rank
        self.job: RoundJob | None = None  # handed to the pipeline once checked
        self.failed: BaseException | None = None
        self.started = 0  # this rank's count of checked stages, this round's included
        self.over_mpi: int | None = None  # a rank joined: buckets issued as plain allreduces
        self.landed = 0  # ... and completed


class ShmTransport:
    """One checked MPI stage per round; every bucket goes straight to the pipeline.

    Hooks report packed buckets from the backward thread (`packed`), which
    hands the launch-order prefix to `ShmPipeline` with no event-loop hop;
    the pipeline marks buckets done itself. The loop only issues each
    round's stage: an allreduce whose name carries a checksum of the plan
    (ranks on different plans raise the same MismatchError) and which a
    joined rank refuses on every rank (that round's buckets then go as plain
    MPI allreduces that joined ranks stand in for).
    """

    def __init__(self, engine: Engine, lane: Lane, arena: SharedArena | None, plan: Plan,
                 peers: dict[str, list[torch.Tensor]], post: float,
                 call_soon: Callable[[Callable[[], object]], None],
                 handed: HandedGrads | None = None) -> None:
        self.engine, self.lane, self.arena, self.plan = engine, lane, arena, plan
        self.peers, self.post, self._call_soon = peers, post, call_soon
        self.handed = handed
        self.pipeline = None if arena is None else ShmPipeline(
            arena.window, plan, peers, post, call_soon, lambda: engine.failure, handed)
        if self.pipeline is not None:
            engine.watched.append(self.pipeline.stalled)
        self._rounds: dict[int, _Round] = {}
        self._lock = threading.Lock()  # guards _rounds and the counts
        self._index = 0  # shared-memory rounds handed to the pipeline so far (loop only)
        self._started = 0  # rounds whose checked stage was asked for (under _lock)
        self._all_started = 0  # ... and that every rank has asked for, as far as told (loop)
        self._agreeing: dict[int, RoundCheck] = {}  # checked stages in flight, by start count
        self.launched = self.completed = 0

    # -- hook thread ---------------------------------------------------------------
    def packed(self, run: StepRun, k: int) -> None:
        """Bucket k is packed on this rank (any thread): pass the new prefix on."""
        rnd = self._round(run)
        with rnd.lock:
            if rnd.failed:
                return
            rnd.ready[k] = True
            before = rnd.launched
            while rnd.launched < len(rnd.order) and rnd.ready[rnd.order[rnd.launched]]:
                rnd.launched += 1
            launched = rnd.launched
            if rnd.job is not None and self.pipeline is not None:
                self.pipeline.packed(rnd.job, launched)  # under the lock: counts never regress
            start = not rnd.started and launched > 0 and rnd.job is None
            if start:
                rnd.started = self._announce()
            loop_needed = start or (rnd.over_mpi is not None and launched > before)
        self._count(launched - before, 0)
        if loop_needed:
            self._call_soon(partial(self._advance, rnd))

    def _announce(self) -> int:
        """Count this round's checked stage and tell the peers' pipelines (see
        `ShmPipeline.announce`), so they know when to test it."""
        with self._lock:
            self._started = started = self._started + 1
        if self.pipeline is not None:
            self.pipeline.announce(started, self._all_have_started)
        return started

    def _round(self, run: StepRun) -> _Round:
        with self._lock:
            rnd = self._rounds.get(run.number)
            if rnd is None:
                rnd = self._rounds[run.number] = _Round(run)
            return rnd

    def _count(self, launched: int, completed: int) -> None:
        with self._lock:
            self.launched += launched
            self.completed += completed

    def describe(self) -> str:
        """Stall text from the pipeline's view of every rank's counters."""
        return self.pipeline.describe() if self.pipeline is not None else ""

    # -- loop --------------------------------------------------------------------
    def _advance(self, rnd: _Round) -> None:
        with rnd.lock:
            if rnd.failed or rnd.job is not None:
                return None
            if rnd.over_mpi is not None:
                ops = self._over_mpi_ops(rnd)
            else:
                ops, value = [], rnd.launched
        if rnd.over_mpi is not None:  # submitted with the lock let go: one may end inline
            for op in ops:
                self.engine.submit(op)
            return None
        agree = RoundCheck(self.lane, f"{self._tag(rnd)}.s1", value, partial(self._checked, rnd))
        if self.pipeline is not None and rnd.started > self._all_started:
            agree.awaiting_hint = True  # the pipeline says when every rank issued it
            self._agreeing[rnd.started] = agree
        self.engine.submit(agree)
        return None

    def _all_have_started(self, started: int) -> None:
        """Every rank has issued checked stage number `started` (loop thread)."""
        self._all_started = max(self._all_started, started)
        agree = self._agreeing.pop(started, None)
        if agree is not None and agree.awaiting_hint:
            self.engine.hint(agree)

    def _tag(self, rnd: _Round) -> str:
        return round_tag(self.plan, rnd.run.generation)

    def _checked(self, rnd: _Round, _least: int, err: BaseException | None) -> None:
        """The round's stage passed on every rank: the pipeline takes it from here."""
        self._agreeing.pop(rnd.started, None)
        sharded = self.pipeline is not None and self.pipeline.shard is not None
        if isinstance(err, JoinedError) and sharded:
            return self._fail(rnd, JoinedError(SHARDED_JOIN))  # nobody updates its pieces
        if isinstance(err, JoinedError):  # no data moved yet this round
            with rnd.lock:
                rnd.over_mpi = 0
            return self._advance(rnd)
        if err is not None:
            return self._fail(rnd, err)
        assert self.pipeline is not None
        with rnd.lock:  # from here on the hook thread feeds the job directly
            rnd.job = job = RoundJob(self._index, tuple(rnd.order), rnd.launched,
                                     partial(self._gathered, rnd), partial(self._fail, rnd),
                                     rnd.run.release, run_number=rnd.run.number)
        self._index += 1
        self.pipeline.submit(job)
        return None

    # -- pipeline thread -----------------------------------------------------------
    def _gathered(self, rnd: _Round, positions: range) -> None:
        with rnd.lock:
            if rnd.failed:
                return
            for p in positions:
                rnd.run.finish(rnd.order[p], None)
        self._count(0, len(positions))
        if positions.stop == len(rnd.order):
            with self._lock:
                del self._rounds[rnd.run.number]  # the pipeline releases the buffers

    # -- joined ranks (loop) ---------------------------------------------------------
    def _over_mpi_ops(self, rnd: _Round) -> list[BucketOp]:
        """A rank has joined (`engine.join`): shared memory needs every rank's own
        data, so this round's buckets go, in launch order, as plain allreduces that
        joined ranks stand in for. Every active rank saw the same refusal of stage 1.
        Called with `rnd.lock` held; the caller submits them."""
        assert rnd.over_mpi is not None
        ops = []
        me = self.arena.rank if self.arena is not None else 0
        while rnd.over_mpi < rnd.launched:
            k = rnd.order[rnd.over_mpi]
            b = self.plan.buckets[k]
            if self.handed is not None:
                self.handed.flush(b, self.peers[b.group][me])
            view = self.peers[b.group][me][b.offset: b.offset + b.numel]
            done = partial(self._reduced_over_mpi, rnd, k, view)
            ops.append(bucket_op(self.lane, as_buffer(view, writable=True),
                                 f"{self._tag(rnd)}.m{rnd.over_mpi}", done))
            rnd.over_mpi += 1
        return ops

    def _reduced_over_mpi(self, rnd: _Round, k: int, view: torch.Tensor, op: BucketOp) -> None:
        if rnd.failed:
            return
        if op.error is not None:
            return self._fail(rnd, op.error)
        post = self.post

        def scale() -> None:
            if post != 1.0:
                view.mul_(post)

        assert self.pipeline is not None
        self.pipeline.run_soon(scale, partial(self._landed, rnd, k))
        return None

    def _landed(self, rnd: _Round, k: int, err: BaseException | None) -> None:
        if rnd.failed:
            return
        if err is not None:
            return self._fail(rnd, err)
        rnd.run.finish(k, None)
        self._count(0, 1)
        rnd.landed += 1
        if rnd.landed == rnd.run.size:  # MPI read our buffers inside each op: no barrier
            with self._lock:
                del self._rounds[rnd.run.number]
            rnd.run.release(None)
        return None

    def _fail(self, rnd: _Round, err: BaseException) -> None:
        """Fail every bucket of the round not yet done, and release its buffers (any
        thread). The round stays registered, failed: a bucket packed later (ranks
        pack at their own pace) must not start a fresh round whose stage op only
        this rank would issue (seen as a desync at shutdown)."""
        with rnd.lock:
            if rnd.failed:
                return
            rnd.failed = err
            for k in rnd.order:
                if not rnd.run.done[k].is_set():
                    rnd.run.finish(k, err)
        rnd.run.release(err)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
            if self.pipeline.stalled in self.engine.watched:
                self.engine.watched.remove(self.pipeline.stalled)
