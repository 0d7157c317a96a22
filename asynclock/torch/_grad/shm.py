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

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..._core.base import settings
from ..._core.base.errors import JoinedError
from ..._core.engine.operation import Lane
from ..._core.engine.progress import Engine
from ..._core.runtime import failure
from ..._core.transports.shared_window import CTL_BYTES, FENCE_OK, SharedWindow
from .buckets import Plan
from .rounds import CheckedRounds, Round
from .scheduler import RoundCheck
from .shm_chunks import HandedGrads, chunk
from .shm_pipeline import RoundJob, ShmPipeline

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


class ShmTransport(CheckedRounds):
    """One checked MPI stage per round; every bucket goes straight to the pipeline.

    Hooks report packed buckets from the backward thread (`packed`), which
    hands the launch-order prefix to `ShmPipeline` with no event-loop hop;
    the pipeline marks buckets done itself. The loop only issues each
    round's checked stage (`CheckedRounds`).
    """

    what = "shared memory"

    def __init__(self, engine: Engine, lane: Lane, arena: SharedArena | None, plan: Plan,
                 peers: dict[str, list[torch.Tensor]], post: float,
                 call_soon: Callable[[Callable[[], object]], None],
                 handed: HandedGrads | None = None) -> None:
        super().__init__(engine, lane, plan, post, call_soon)
        self.arena, self.peers, self.handed = arena, peers, handed
        self.pipeline = None if arena is None else ShmPipeline(
            arena.window, plan, peers, post, call_soon, lambda: engine.failure, handed)
        if self.pipeline is not None:
            engine.watched.append(self.pipeline.stalled)
        self._index = 0  # shared-memory rounds handed to the pipeline so far (loop only)
        self._all_started = 0  # rounds every rank has asked to check, as far as told (loop)
        self._agreeing: dict[int, RoundCheck] = {}  # checked stages in flight, by start count

    # -- hook thread ---------------------------------------------------------------
    def _prefix_grew(self, rnd: Round, before: int) -> None:
        if rnd.job is not None and self.pipeline is not None:
            self.pipeline.packed(rnd.job, rnd.launched)  # under the lock: counts never regress

    def _announce(self) -> int:
        """Count this round's checked stage and tell the peers' pipelines (see
        `ShmPipeline.announce`), so they know when to test it."""
        started = super()._announce()
        if self.pipeline is not None:
            self.pipeline.announce(started, self._all_have_started)
        return started

    def describe(self) -> str:
        """Stall text from the pipeline's view of every rank's counters."""
        return self.pipeline.describe() if self.pipeline is not None else ""

    # -- loop --------------------------------------------------------------------
    def _check_made(self, rnd: Round, check: RoundCheck) -> None:
        if self.pipeline is not None and rnd.started > self._all_started:
            check.awaiting_hint = True  # the pipeline says when every rank issued it
            self._agreeing[rnd.started] = check

    def _all_have_started(self, started: int) -> None:
        """Every rank has issued checked stage number `started` (loop thread)."""
        self._all_started = max(self._all_started, started)
        agree = self._agreeing.pop(started, None)
        if agree is not None and agree.awaiting_hint:
            self.engine.hint(agree)

    def _checked(self, rnd: Round, least: int, err: BaseException | None) -> None:
        self._agreeing.pop(rnd.started, None)
        sharded = self.pipeline is not None and self.pipeline.shard is not None
        if isinstance(err, JoinedError) and sharded:
            return self._fail(rnd, JoinedError(SHARDED_JOIN))  # nobody updates its pieces
        return super()._checked(rnd, least, err)

    def _take_over(self, rnd: Round) -> None:
        """The round's stage passed on every rank: the pipeline takes it from here."""
        assert self.pipeline is not None
        with rnd.lock:  # from here on the hook thread feeds the job directly
            rnd.job = job = RoundJob(self._index, tuple(rnd.order), rnd.launched,
                                     partial(self._gathered, rnd), partial(self._fail, rnd),
                                     rnd.run.release, run_number=rnd.run.number)
        self._index += 1
        self.pipeline.submit(job)

    # -- pipeline thread -----------------------------------------------------------
    def _gathered(self, rnd: Round, positions: range) -> None:
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
    def _mpi_view(self, rnd: Round, k: int) -> torch.Tensor:
        me = self.arena.rank if self.arena is not None else 0
        b = self.plan.buckets[k]
        if self.handed is not None:
            self.handed.flush(b, self.peers[b.group][me])
        return self.peers[b.group][me][b.offset: b.offset + b.numel]

    def _scale(self, view: torch.Tensor, then: Callable[[BaseException | None], None]) -> None:
        """In the pipeline's thread: the loop does no arithmetic on buckets."""
        post = self.post

        def scale() -> None:
            if post != 1.0:
                view.mul_(post)

        assert self.pipeline is not None
        self.pipeline.run_soon(scale, then)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.stop()
            if self.pipeline.stalled in self.engine.watched:
                self.engine.watched.remove(self.pipeline.stalled)
