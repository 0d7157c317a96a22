"""Loop side: launch buckets in the agreed order, within a credit window.

Hooks report a complete bucket from whatever thread runs backward; the
report reaches this scheduler on the rank's event loop. Bucket k of a round
is launched only after buckets before it in the agreed launch order were
launched, even when k became ready first on this rank: the order of
collectives on the gradient channel is then the same on every rank, which is
what MPI requires (invariant 1). Rounds are launched strictly one after the
other. A credit window bounds the bytes in flight, so an urgent bucket is
not stuck behind a long queue of transfers that all share the link.

Each bucket is a header-checked allreduce (`AllreduceOp`), so a rank whose
bucket differs (size, dtype, plan generation) makes every rank raise the
same `MismatchError`. Completion is a callback from the progress engine: no
task per bucket, no scheduling delay between completion and next launch.
Shared-memory rounds (`shm.ShmTransport`) do not pass through here: hooks
hand their buckets to the pipeline directly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..collective_ops import AllreduceOp
from ..errors import BackendError
from ..header import Call
from ..operation import Lane
from ..ops import Kind, ReduceOp
from ..progress import Engine
from ..tensors import Buffer, as_buffer
from .run import StepRun


def bucket_op(lane: Lane, buf: Buffer, name: str, on_done: Callable[[BucketOp], None]
              ) -> BucketOp:
    """An in-place sum of `buf` on `lane`, next in the lane's order (not yet submitted)."""
    call = Call(Kind.ALLREDUCE, lane.next_seq(), op=int(ReduceOp.SUM), dtype=buf.code,
                shape=buf.shape, nbytes=buf.array.nbytes, name=name)
    return BucketOp(lane, call, buf, on_done)


class BucketOp(AllreduceOp):
    """An in-place sum of one bucket that reports its end to the scheduler."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer,
                 on_done: Callable[[BucketOp], None]) -> None:
        super().__init__(lane, call, buf, buf.array, ReduceOp.SUM)
        self.on_done = on_done

    def complete(self, value: Any) -> None:
        super().complete(value)
        self.on_done(self)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.on_done(self)


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """Exact counts, for tests and stall reports."""

    launched: int
    completed: int
    in_flight: int
    in_flight_bytes: int
    window_bytes: int
    queued_rounds: int


class Scheduler:
    """Runs on the rank's event loop only."""

    def __init__(self, engine: Engine, lane: Lane, window_bytes: int) -> None:
        self.engine, self.lane = engine, lane
        self.window_bytes = window_bytes
        self._rounds: deque[StepRun] = deque()
        self._in_flight_bytes = 0
        self._in_flight = 0
        self._launched = self._completed = 0
        self._pumping = False

    def ready(self, run: StepRun, k: int) -> None:
        """Bucket k of `run` is packed on this rank (called on the loop)."""
        if not self._rounds or self._rounds[-1] is not run:
            self._rounds.append(run)
        run.ready[k] = True
        self._pump()

    def _pump(self) -> None:
        """Launch every bucket that is next in order and fits the window."""
        if self._pumping:  # a launch completed inline and called back
            return
        self._pumping = True
        try:
            while self._rounds and self._launch_next(self._rounds[0]):
                pass
        finally:
            self._pumping = False

    def _launch_next(self, run: StepRun) -> bool:
        if run.next == run.size:
            self._rounds.popleft()
            return True
        k = run.plan.launch[run.next]
        nbytes = run.plan.buckets[k].nbytes
        if not run.ready[k] or (self._in_flight and
                                self._in_flight_bytes + nbytes > self.window_bytes):
            return False
        run.next += 1
        self._in_flight_bytes += nbytes
        self._in_flight += 1
        self._launch(run, k, nbytes)
        return True

    def _launch(self, run: StepRun, k: int, nbytes: int) -> None:
        def done(op: BucketOp) -> None:
            self._finished(run, k, nbytes, op.error)

        run.launched_at[k] = time.perf_counter()
        self._launched += 1
        try:
            buf = as_buffer(run.storage.comm[k], writable=True)
            self.engine.submit(bucket_op(self.lane, buf, f"grad.g{run.generation}.b{k}", done))
        except Exception as exc:  # the transport refused: this bucket fails, ranks stay in step
            self._finished(run, k, nbytes, BackendError(f"gradient bucket {k}: {exc}"))

    def _finished(self, run: StepRun, k: int, nbytes: int, error: BaseException | None) -> None:
        self._in_flight_bytes -= nbytes
        self._in_flight -= 1
        self._completed += 1
        run.finish(k, error)
        self._pump()

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(self._launched, self._completed, self._in_flight,
                                   self._in_flight_bytes, self.window_bytes, len(self._rounds))
