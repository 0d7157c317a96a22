"""Loop side: launch buckets in the agreed order, within a credit window.

Hooks report a complete bucket from whatever thread runs backward; the
report reaches this scheduler on the rank's event loop. Bucket k of a round
is launched only after buckets before it in the agreed launch order were
launched, even when k became ready first on this rank: the order of
collectives on the gradient channel is then the same on every rank, which is
what MPI requires (invariant 1). Rounds are launched strictly one after the
other. A credit window bounds the bytes in flight, so an urgent bucket is
not stuck behind a long queue of transfers that all share the link.

Each round is checked once (`RoundCheck`): before its first bucket, the
ranks compare the plan (generation and a checksum of layout and launch
order) in one small header-checked allreduce, so a rank on another plan
makes every rank raise the same `MismatchError`. The buckets then go as bare
data stages in the agreed order, without a header round each: that is one
round trip per step instead of one per bucket, which across hosts costs a
network round trip and a few loop wake-ups per bucket. A rank that joined
(`engine.join`) refuses the check on every rank; that round's buckets
then go as header-checked allreduces the joined rank stands in for.
Completion is a callback from the progress engine: no task per bucket, no
scheduling delay between completion and next launch. Shared-memory rounds
(`shm.ShmTransport`) do not pass through here: hooks hand their buckets to
the pipeline directly (and check their rounds with the same `RoundCheck`).
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ..._core.base.errors import BackendError, JoinedError
from ..._core.base.header import EVERY_RANK, Call
from ..._core.base.ops import DTYPE_CODES, Kind, ReduceOp
from ..._core.base.tensors import Buffer, as_buffer
from ..._core.engine import staging
from ..._core.engine.collective_ops import AllreduceOp
from ..._core.engine.device_pg import device_buffer, group_of, make_pg_bucket
from ..._core.engine.operation import Lane, Stage, State
from ..._core.engine.progress import Engine
from ..._core.transports.base import Request
from . import grouped
from .buckets import Plan
from .step_run import StepRun


def bucket_op(lane: Lane, buf: Buffer, name: str, on_done: Callable[[BucketOp], None],
              checked: bool = False) -> BucketOp:
    """An in-place sum of `buf` on `lane`, next in the lane's order (not yet submitted);
    `checked`: its round passed its `RoundCheck`, so it skips the header round."""
    return (CheckedBucketOp if checked else BucketOp)(lane, bucket_call(lane, buf, name), buf,
                                                      on_done)


def bucket_call(lane: Lane, buf: Buffer, name: str) -> Call:
    """The next call on `lane`: an in-place sum of `buf`."""
    return Call(Kind.ALLREDUCE, lane.next_seq(), op=int(ReduceOp.SUM), dtype=buf.code,
                shape=buf.shape, nbytes=buf.array.nbytes, name=name)


class BucketOp(AllreduceOp):
    """An in-place sum of one bucket that reports its end to the scheduler."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer,
                 on_done: Callable[[BucketOp], None]) -> None:
        super().__init__(lane, call, buf, buf.array, ReduceOp.SUM)
        self.on_done = on_done
        self.label = call.name  # what a transport that names its stages calls its stage

    def complete(self, value: Any) -> None:
        super().complete(value)
        self.on_done(self)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.on_done(self)

    def issue_next(self, transport: Any) -> Request | None:
        """A transport that names its stages (Horovod, whose response cache keys on
        names) names a bucket's after the bucket, the same every round. Not in a round
        a joined rank stands in for: its stand-in carries no bucket name."""
        named = getattr(transport, "named_stages", None)
        if named is None or self.joined:
            return super().issue_next(transport)
        with named(self.label):
            return super().issue_next(transport)


class CheckedBucketOp(BucketOp):
    """A bucket of a round that passed its check: straight to its data stage.

    Every rank issues the same buckets in the same order after the same
    check, and no rank can have joined within the round (the check would
    have failed), so the header round would only repeat what was agreed."""

    def start(self) -> None:
        self.stages.extend(self.data_stages())
        self.state = State.READY
        self.lane.queue.append(self)


class GroupedBucketOp(CheckedBucketOp):
    """A checked bucket whose data stage hands Horovod the gradients themselves
    (`grouped`): one tensor in and one slice of the bucket out per segment.

    Waited for in the lane's wait thread whatever its size: only Horovod's thread
    finishes it, and the wait thread's sleep-poll of its handle costs a fraction of
    the event loop waking to poll it, CPU that ranks sharing cores take from backward."""

    wait_in_thread = True

    def __init__(self, lane: Lane, call: Call, buf: Buffer, on_done: Callable[[BucketOp], None],
                 inputs: list[Any], outputs: list[Any], prescale: float) -> None:
        super().__init__(lane, call, buf, on_done)
        self.inputs, self.outputs, self.prescale = inputs, outputs, prescale

    def data_stages(self) -> list[Stage]:
        self.stage_bytes = self.buf.array.nbytes
        return [lambda t: t.iallreduce_grouped(self.inputs, self.outputs, self.prescale)]


class RoundCheck(AllreduceOp):
    """A round's one checked stage: MIN over ranks of a count, with a callback.

    Its name carries the plan's generation and checksum, so ranks on different
    plans raise the same MismatchError; `EVERY_RANK` makes a joined rank
    refuse it on every rank (JoinedError). Patient: it is issued while
    backward still computes, and spinning for the peers would take the core
    from this rank's own backward."""

    patient = True

    def __init__(self, lane: Lane, name: str, value: int,
                 on_done: Callable[[int, BaseException | None], None]) -> None:
        box = np.array([value], np.int64)
        call = Call(Kind.ALLREDUCE, lane.next_seq(), op=int(ReduceOp.MIN),
                    dtype=DTYPE_CODES["int64"], shape=(1,), nbytes=8, name=name,
                    root=EVERY_RANK)
        super().__init__(lane, call, as_buffer(box, writable=True), box, ReduceOp.MIN)
        self.box, self.on_done = box, on_done

    def complete(self, value: Any) -> None:
        super().complete(value)
        self.on_done(int(self.box[0]), None)

    def fail(self, exc: BaseException) -> None:
        super().fail(exc)
        self.on_done(0, exc)


def round_tag(plan: Plan, generation: int) -> str:
    """What a round's check compares: plan generation and layout checksum."""
    return f"g{generation}.{plan.crc:08x}"


class Check(enum.Enum):
    """Where a round stands with its `RoundCheck` (loop side)."""

    DUE = "due"  # not issued: waits until the round is first in line with a bucket packed
    PENDING = "pending"
    PASSED = "passed"  # buckets go without headers
    HEADERS = "headers"  # a rank joined: header-checked buckets, stood in for
    FAILED = "failed"  # every bucket got the check's error; none launched


@dataclass(frozen=True, slots=True)
class SchedulerStatistics:
    """Exact counts, for tests and stall reports."""

    launched: int
    completed: int
    in_flight: int
    in_flight_bytes: int
    window_bytes: int
    queued_rounds: int
    checks: int  # round checks issued
    header_buckets: int  # buckets launched with a header round of their own
    grouped_buckets: int  # buckets Horovod summed from handed gradients (`grouped`)


class Scheduler:
    """Runs on the rank's event loop only."""

    def __init__(self, engine: Engine, lane: Lane, window_bytes: int) -> None:
        self.engine, self.lane = engine, lane
        self.window_bytes = window_bytes
        self._rounds: deque[StepRun] = deque()
        self._in_flight_bytes = 0
        self._in_flight = 0
        self._launched = self._completed = self._checks = self._header_buckets = 0
        self._grouped = 0  # buckets that went as Horovod groups of handed gradients
        self._pumping = False
        self._check: dict[int, Check] = {}  # by round number, for rounds not yet launched

    def ready(self, run: StepRun, k: int) -> None:
        """Bucket k of `run` is packed on this rank (called on the loop)."""
        if run.next == run.size:  # a failed round: its buckets already have their error
            return
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
            self._check.pop(run.number, None)
            return True
        check = self._check.get(run.number, Check.DUE)
        if check is Check.DUE:
            return self._issue_check(run)
        if check is Check.PENDING:
            return False
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

    # -- the round's check -------------------------------------------------------
    def _issue_check(self, run: StepRun) -> bool:
        """First in line with a bucket packed: issue the round's check. Its place
        on the lane (after every op of the round before) is the same on every
        rank; only when it is issued depends on local timing. True if it
        already finished (the pump goes on)."""
        if not any(run.ready):
            return False
        self._check[run.number] = Check.PENDING
        self._checks += 1
        name = f"grad.{round_tag(run.plan, run.generation)}.r"
        try:
            self.engine.submit(RoundCheck(self.lane, name, 1, partial(self._checked, run)))
        except Exception as exc:  # refused to start (the job is failing): fail the round
            self._checked(run, 0, BackendError(f"gradient round {run.number}: {exc}"))
        return self._check[run.number] is not Check.PENDING

    def _checked(self, run: StepRun, _least: int, error: BaseException | None) -> None:
        """The check's verdict, the same on every rank. The round is first in line
        (its check was issued there), so a failed one ends here and the pump moves on."""
        if isinstance(error, JoinedError):
            self._check[run.number] = Check.HEADERS
        elif error is not None:
            self._check[run.number] = Check.FAILED
            self._fail_round(run, error)
        else:
            self._check[run.number] = Check.PASSED
        self._pump()

    def _fail_round(self, run: StepRun, error: BaseException) -> None:
        """The check failed on every rank: every bucket of the round gets its error
        and none is launched."""
        for n in range(run.next, run.size):
            run.finish(run.plan.launch[n], error)
        run.next = run.size

    # -- buckets ---------------------------------------------------------------------
    def _launch(self, run: StepRun, k: int, nbytes: int) -> None:
        def done(op: BucketOp) -> None:
            run.done_events[k] = getattr(op, "done_event", None)  # a CUDA bucket's
            self._finished(run, k, nbytes, op.error)

        run.launched_at[k] = time.perf_counter()
        self._launched += 1
        checked = self._check.get(run.number) is Check.PASSED
        self._header_buckets += not checked
        try:
            op = self._bucket_op(run, k, done, checked)
            ready = run.ready_events[k]
            if ready is None:
                self.engine.submit(op)
            else:  # a CUDA bucket: issued once the hooks' copies into it are done
                staging.submit_after(self.engine, self.lane, op, ready)
        except Exception as exc:  # the transport refused: this bucket fails, ranks stay in step
            self._finished(run, k, nbytes, BackendError(f"gradient bucket {k}: {exc}"))

    def _bucket_op(self, run: StepRun, k: int, done: Callable[[BucketOp], None],
                   checked: bool) -> BucketOp:
        """Bucket k's allreduce, labelled after what the bucket holds (`Bucket.label`), so
        a transport that names its stages names it the same on both sides of a re-plan
        that kept it."""
        op = self._bucket_op_of(run, k, done, checked)
        op.label = f"grad.{run.plan.buckets[k].label}"
        return op

    def _bucket_op_of(self, run: StepRun, k: int, done: Callable[[BucketOp], None],
                      checked: bool) -> BucketOp:
        """Bucket k's allreduce; a Horovod group of handed gradients where it can be."""
        tensor = run.storage.comm[k]
        name = f"grad.g{run.generation}.b{k}"
        if tensor.is_cuda or (staging.cpu_twin() and group_of(self.lane) is not None):
            # over NCCL (on CPU tensors, gloo: the twin), on the device's own stream
            buf = device_buffer(tensor) if tensor.is_cuda else run.storage.buffer(k)
            op = bucket_op(self.lane, buf, name, done, checked)
            make_pg_bucket(op)
            return op
        buf = run.storage.buffer(k)
        if run.handed is None or not run.storage.grouped_bucket(k):
            return bucket_op(self.lane, buf, name, done, checked)
        b = run.plan.buckets[k]
        flat = run.storage.flat[b.group]
        if not checked:  # a joined rank stands in: a plain bucket, like its own
            grouped.settle(run.handed, b, flat)
            return bucket_op(self.lane, buf, name, done)
        self._grouped += 1
        inputs, outputs = grouped.entries(run.handed, b, flat)
        run.handed.drop(k)  # the group holds the tensors now
        return GroupedBucketOp(self.lane, bucket_call(self.lane, buf, name), buf, done, inputs,
                               outputs, run.handed.scale)

    def _finished(self, run: StepRun, k: int, nbytes: int, error: BaseException | None) -> None:
        self._in_flight_bytes -= nbytes
        self._in_flight -= 1
        self._completed += 1
        run.finish(k, error)
        self._pump()

    def checking(self, run: StepRun) -> bool:
        """The round's check is in flight (stall reports: no bucket can go yet)."""
        return self._check.get(run.number) is Check.PENDING

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(self._launched, self._completed, self._in_flight,
                                   self._in_flight_bytes, self.window_bytes, len(self._rounds),
                                   self._checks, self._header_buckets, self._grouped)
