"""The progress engine: turns transport requests into awaitables.

MPI has no file descriptor to wait on, so one poller task per loop tests
every in-flight request. Policy (`bench/collectives.py` measures it):

* a bounded spin right after a call is issued (`spin_s`), because small
  collectives usually finish within microseconds and a round trip through
  the scheduler costs more than the operation;
* then tight polling with `sleep(0)` for `busy_s` after the last progress;
* then sleeps that grow with the time already waited (5% of it, 1 ms to
  20 ms), so an idle rank awaiting a late peer uses almost no CPU and the
  extra latency stays under ~5% of the wait;
* data stages of at least `thread_min_bytes` are waited for in a worker
  thread (`wait_thread`) with MPI's blocking calls (GIL released), which gives
  libraries that only progress inside MPI calls (Open MPI's libnbc) the
  progress they need for bandwidth; a late peer is waited for asleep first
  (`transports.settle`); the thread wakes the poller when done. An allreduce
  that a caller awaits stays on the loop in its channel's loop band
  (`Channel.loop_band`: mid sizes under MPICH on one node), where the
  non-blocking call, polled, beats the two hand-overs between threads; on
  one node a mid-size one through the node window may run there too, step
  by step (`node_window.LoopAllreduce`).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from ..base.backoff import Backoff
from ..base.errors import BackendError
from ..base.from_thread import loop_caller
from ..base.header import Call
from ..base.ops import DTYPE_NAMES, Kind, ReduceOp
from ..base.wakeup import Wakeup
from . import header_round
from .matching import Matcher, filler_call
from .operation import Lane, MatchTable, Operation, State
from .policy import ProgressPolicy
from .wait_thread import WaitThread

__all__ = ["Engine", "EngineSnapshot", "EngineStatistics", "InflightOp", "ProgressPolicy"]


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """Exact engine state, for tests and the stall inspector (`coord.statistics()`).

    Attributes:
        in_flight: operations issued and not yet complete.
        issued: operations issued since start.
        completed: operations completed since start.
        detached: operations whose awaiting task was cancelled or went away (they run
            on to completion).
        thread_waits: data stages handed to a lane's wait thread.
        poller_running: whether the poller task runs on the event loop.
    """

    in_flight: int
    issued: int
    completed: int
    detached: int
    thread_waits: int
    poller_running: bool


@dataclass(frozen=True, slots=True)
class InflightOp:
    """One in-flight operation as the stall inspector reports it."""

    description: str
    age_s: float
    lane: int  # index into `Engine.lanes`; -1 for raw requests (no sequence)
    seq: int
    ident: int  # stable while in flight, so a stall is reported once per op
    waits_by_design: bool = False  # a joined rank's round (engine.join): report, never abort
    # Waiting in its lane's matching table: the ranks that have not proposed it
    # (their header rounds may be past it, so `seq` cannot tell). None: not waiting there.
    unmatched_by: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the watchdog thread publishes: oldest ops first, issued seq per lane."""

    ops: tuple[InflightOp, ...]
    in_flight: int
    lane_seqs: tuple[int, ...]
    lane_names: tuple[str, ...]


class Engine:
    """Owns every started operation until it completes on this rank."""

    def __init__(self, policy: ProgressPolicy | None = None) -> None:
        self.policy = policy or ProgressPolicy.from_env()
        self.inflight: list[Operation] = []
        self.lanes: list[Lane] = []
        self._wakeup = Wakeup()  # the poller's sleep, ended early by new work
        p = self.policy
        # The poller's sleeps: tight for `busy_s` after the last progress, then growing.
        self._backoff = Backoff(p.min_sleep_s, p.max_sleep_s, share=p.sleep_fraction,
                                busy_s=p.busy_s)
        self._issued = self._completed = self._detached = self._thread_waits = 0
        # One wait thread per lane: a lane's bulk stages run there, in its
        # agreed order; lanes are ordered independently of each other, so two
        # lanes sharing a thread could block each other crosswise across ranks.
        self._waiters: dict[Lane, WaitThread] | None = None
        self._call_soon: Callable[[Callable[[], object]], None] | None = None
        self.running = False
        self.eager_until = 0.0  # poll tightly until then (a blocked synchronous caller)
        self.blocked_callers = 0  # synchronous callers waiting on the loop (loop thread only)
        self.failure: BaseException | None = None  # set by fail_all: the job is over
        # Observer hook (asynclock.timeline.attach): ("issue" | "data" | "done", op,
        # time.perf_counter()). Each call site tests for None, so off costs nothing.
        self.on_event: Callable[[str, Operation, float], None] | None = None
        # Waits outside the engine (the shared-memory gradient pipeline) report here,
        # so the stall inspector sees them like in-flight ops.
        self.watched: list[Callable[[], InflightOp | None]] = []
        self._fillers: dict[Lane, float] = {}  # lane -> when its filler round is due
        self._retiring: set[Lane] = set()  # retired once idle and not held
        self._held: Counter[Lane] = Counter()  # lanes a join serves (`holding`)
        self.no_spin = False  # set around submissions nobody waits inside (`staging.LaneGate`)

    def add_lane(self, lane: Lane) -> Lane:
        """Serve `lane` (a lane by name gets its filler rounds from here)."""
        if lane.spin_s is None:
            lane.spin_s = self.policy.spin_s  # read directly by `engine.small_calls`
        self.lanes.append(lane)
        lane.host = self
        return lane

    # -- filler rounds (engine.matching) ------------------------------------
    def matcher_for(self, lane: Lane) -> MatchTable:
        """The lane's matching table, made on its first disagreement."""
        if lane.matcher is None:
            lane.matcher = Matcher(lane, self)
        return lane.matcher

    def want_filler(self, lane: Lane, delay: float) -> None:
        due = time.perf_counter() + delay
        self._fillers[lane] = min(due, self._fillers.get(lane, due))
        self._wakeup.wake()

    def _issue_fillers(self) -> float | None:
        """Issue the filler rounds that are due; seconds until the next one."""
        now, soonest = time.perf_counter(), None
        for lane, due in list(self._fillers.items()):
            if due > now:
                soonest = due - now if soonest is None else min(soonest, due - now)
                continue
            del self._fillers[lane]
            matcher = lane.matcher
            if matcher is None or not matcher.filler_due() or self.failure is not None:
                continue
            op = Operation(lane, filler_call(lane, matcher.stuck()))
            self._begin(op)
            op.start()
            self._adopt(op, False)
        return soonest

    def close_matching(self) -> None:
        """Shutting down: lanes with calls waiting to be matched turn until every
        rank's waiting calls expire (`engine.matching`)."""
        for lane in self.lanes:
            if lane.matcher is not None:
                lane.matcher.close()

    # -- submission ------------------------------------------------------------
    def submit(self, op: Operation) -> Operation:
        """Start `op` now (caller's order), spin briefly, else hand it to the poller."""
        self._begin(op)
        op.start()
        if op.state is State.READY:  # no header round (an agreed gradient round's bucket)
            op.lane.pump(self._issue)
        return self._adopt(op, self._spin(op))

    def track(self, request: Any, what: str = "request") -> Operation:
        """Adopt a raw transport request (e.g. point-to-point) for `await wait(op)`.

        The engine keeps testing it until it completes, even if every waiter
        is cancelled, so a request is never leaked or left unprogressed.
        """
        op = RawRequest(request, what)
        self._begin(op)
        return self._adopt(op, op.poll())

    def count_synchronous(self, issued_at: float, lane: Lane | None = None) -> None:
        """Sample a small op that issued and finished inside one call
        (`engine.small_calls`), which counts it in `lane.synchronous` itself (every
        call: the statistics add them up) and calls this every 8th time: it keeps
        the poller's backoff fresh and teaches the lane's spin (`lane`; None for a
        staged allreduce, whose time is reported after its data). The median
        moves slowly, and timing every call is a measurable share of a small
        collective."""
        self._backoff.reset(issued_at)
        if lane is not None:
            self.note_latency(lane, time.perf_counter() - issued_at)

    def adopt_issued(self, op: Operation, issued_at: float) -> None:
        """Take over an op whose first round was started outside `submit` (`engine.small_calls`)."""
        op.issued_at = issued_at
        self._backoff.reset(issued_at)
        self._issued += 1
        self._adopt(op, False)

    def _begin(self, op: Operation) -> None:
        """Refuse after a fatal failure; stamp and count the op."""
        if self.failure is not None:
            raise _fresh(self.failure)
        op.issued_at = time.perf_counter()
        self._backoff.reset(op.issued_at)
        self._issued += 1
        if self.on_event is not None:
            self.on_event("issue", op, op.issued_at)

    def _adopt(self, op: Operation, finished: bool) -> Operation:
        """Count an op that already finished, or hand it to the poller."""
        if finished:
            self._completed += 1
            now = time.perf_counter()
            self._note_done(op, now)
            if self.on_event is not None:
                self.on_event("done", op, now)
            return op
        self.inflight.append(op)
        self._wakeup.wake()
        return op

    def _spin(self, op: Operation) -> bool:
        """Bounded busy test: cheaper than a scheduler round trip for small ops."""
        deadline = op.issued_at + (0.0 if op.patient or self.no_spin else self.spin_for(op.lane))
        while True:
            if op.poll():
                op.lane.pump(self._issue)
                if op.done:
                    return True
            if op.threaded or time.perf_counter() >= deadline:
                return False  # the wait thread has it: spinning would only hold the GIL
            header_round.idle()

    def spin_for(self, lane: Lane) -> float:
        """How long to spin for an op on `lane` (kept cheap: `engine.small_calls` asks
        once per call)."""
        return self.policy.spin_s if lane.spin_s is None else lane.spin_s

    def note_latency(self, lane: Lane, seconds: float) -> None:
        """Adapt the lane's spin: twice its typical small op when that fits under
        `max_spin_s` (a spin that usually succeeds), else the default `spin_s`."""
        typical = lane.note_latency(seconds)
        if typical is not None:
            p = self.policy
            lane.spin_s = p.spin_s if typical > p.max_spin_s else min(
                p.max_spin_s, max(p.spin_s, 2 * typical))

    def _note_done(self, op: Operation, now: float) -> None:
        """Small ops someone waited for eagerly feed their lane's spin."""
        if not (op.threaded or op.patient or op.lane is _NO_LANE):
            self.note_latency(op.lane, now - op.issued_at)

    def _issue(self, op: Operation) -> None:
        """Issue op's next data stage; big ones are waited for in a thread."""
        transport = op.lane.transport
        bulk = self._waiters is not None and (op.wait_in_thread or self.policy.waits_in_thread(
            op.stage_bytes, _loop_band(op, transport.loop_band)))
        req = op.issue_next(_bulk_view(op, transport) if bulk else transport)
        if self.on_event is not None:
            self.on_event("data", op, time.perf_counter())
        if req is None or op.state is State.DONE:
            return
        if bulk and self._waiters is not None and not getattr(req, "polled", False):
            op.threaded = True
            self._thread_waits += 1
            self._waiter_for(op.lane).put(op, req)

    def retire_when_idle(self, lane: Lane) -> None:
        """Stop serving `lane` once nothing of it is in flight and no join holds it
        (now, or from `poll_all` or the end of `holding`)."""
        if lane in self.lanes:
            self._retiring.add(lane)
            self._retire_idle()

    def _retire_idle(self) -> None:
        for lane in [lane for lane in self._retiring if not lane.queue and not self._held[lane]]:
            self.retire_lane(lane)

    @contextmanager
    def holding(self, lanes: list[Lane]) -> Iterator[None]:
        """While a join serves `lanes`: none is retired, also between its rounds, when
        a lane is idle for a moment but the join's next round on it is still to come."""
        self._held.update(lanes)
        try:
            yield
        finally:
            self._held.subtract(lanes)
            self._held += Counter()  # drop the zero counts
            self._retire_idle()

    def retire_lane(self, lane: Lane) -> None:
        """Stop serving `lane` (nothing in flight on it): its wait thread ends too."""
        self._retiring.discard(lane)
        self.lanes.remove(lane)
        self._issued += lane.synchronous  # the statistics keep its small calls
        self._completed += lane.synchronous
        self._fillers.pop(lane, None)
        waiter = self._waiters.pop(lane, None) if self._waiters is not None else None
        if waiter is not None:
            waiter.stop()

    def _waiter_for(self, lane: Lane) -> WaitThread:
        assert self._waiters is not None
        waiter = self._waiters.get(lane)
        if waiter is None:
            waiter = self._waiters[lane] = WaitThread(self._poke)
        return waiter

    # -- awaiting --------------------------------------------------------------
    async def wait(self, op: Operation) -> Any:
        """Await op's outcome; cancellation detaches us, the op runs on."""
        if not op.done:
            if not self.running:
                self._require_poller(op)
            if op.waiter is None:
                op.waiter = anyio.Event()
            try:
                await op.waiter.wait()
            except BaseException:
                if not op.done:
                    op.detached = True
                    self._detached += 1
                raise
        return op.outcome()

    def _require_poller(self, op: Operation) -> None:
        from ..base.errors import NotInitializedError

        raise NotInitializedError(
            f"{op.describe()} is in flight but no progress engine runs on this loop; "
            "use `async with asynclock.start()` or `async with coord:`")

    # -- the poller --------------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Poll until cancelled; the task group of `start()` owns this task."""
        self._call_soon = loop_caller()
        self._waiters = {}
        if self.on_event is None:  # e.g. the timeline, which ASYNCLOCK_TIMELINE switches on
            for hook in _START_HOOKS:
                hook(self)
        self.running = True
        task_status.started()
        try:
            await self._loop()
        finally:
            self.running = False
            self._call_soon = None
            waiters, self._waiters = self._waiters or {}, None
            for waiter in waiters.values():
                waiter.stop()

    async def _loop(self) -> None:
        while True:
            cap = self._issue_fillers() if self._fillers else None
            if not self.inflight:
                await self._sleep_until_woken(cap)
                continue
            if self.poll_all():
                self._backoff.reset()
            if all(op.threaded or op.awaiting_hint for op in self.inflight):
                # Only the wait thread can finish these, or a peer's sign must come
                # first, and either wakes us: polling would just take the core (and
                # the GIL the thread needs to return).
                await self._sleep_until_woken(_sooner(self.policy.max_sleep_s, cap))
                continue
            pause = self.next_pause(time.perf_counter())
            if pause <= 0.0:
                header_round.idle()
                await anyio.sleep(0)
            else:
                await self._sleep_until_woken(_sooner(pause, cap))

    def next_pause(self, now: float) -> float:
        """The poller's next sleep while ops are in flight (0.0: a bare checkpoint).

        Patient ops (and thread-waited ones) skip the tight phase; a synchronous
        caller that has just blocked (`eager_until`) is served tightly, and one
        still blocked after that never waits more than `blocked_max_sleep_s`."""
        if now < self.eager_until:
            return 0.0
        patient = all(op.patient or op.threaded for op in self.inflight)
        cap = self.policy.blocked_max_sleep_s if self.blocked_callers else None
        return self._backoff.next_sleep(now, tight=not patient, max_s=cap)

    async def _sleep_until_woken(self, timeout: float | None) -> None:
        await self._wakeup.sleep(timeout)

    def hint(self, op: Operation) -> None:
        """Every rank has issued `op`, as a sign outside MPI shows (loop thread):
        test it at the usual cadence from now on."""
        op.awaiting_hint = False
        self._wake_now()

    def _poke(self, op: Operation) -> None:
        """From the wait thread, once `op`'s stage there ended: finish it on the loop."""
        if self._call_soon is not None:
            self._call_soon(lambda: self._thread_finished(op))

    def _thread_finished(self, op: Operation) -> None:
        """On the loop: `op`'s last stage ended in the wait thread. Finishing it here
        wakes its caller at once, not a loop turn later from the poller; the poller,
        woken too, reaps it and issues what waits behind it. An op with stages left
        is the poller's: only it issues data stages, in the lane's order."""
        if op.threaded and op.thread_done and not op.stages and not op.done:
            op.poll()  # a threaded stage's end: no MPI call; its errors fail the op
        self._wake_now()

    def _wake_now(self) -> None:
        self._backoff.reset()
        self._wakeup.wake()

    def poll_all(self) -> bool:
        """Test every in-flight op once; pump lanes; drop finished ops."""
        progressed = False
        for op in self.inflight:
            try:
                # done already: the matcher finished it from another op's round
                if op.poll() or op.done:
                    progressed = True
            except Exception as exc:  # a transport error (e.g. a dead peer) ends this op only
                op.fail(BackendError(f"{op.describe()}: {exc}"))
                progressed = True
        if not progressed:
            return False
        for lane in self.lanes:
            lane.pump(self._issue)
        if self._retiring:
            self._retire_idle()
        still = [op for op in self.inflight if not op.done]
        if len(still) < len(self.inflight):
            now = time.perf_counter()
            for op in self.inflight:
                if op.done:
                    self._note_done(op, now)
        if self.on_event is not None:
            self._report_done()
        self._completed += len(self.inflight) - len(still)
        self.inflight = still
        return True

    def _report_done(self) -> None:
        """Tell the observer which in-flight ops finished in this poll."""
        now, hook = time.perf_counter(), self.on_event
        for op in self.inflight:
            if op.done and hook is not None:
                hook("done", op, now)

    def statistics(self) -> EngineStatistics:
        # ops done and not yet reaped by the poller count as completed already, so
        # issued == completed + in_flight at every moment
        reaped_next = sum(op.done for op in self.inflight)
        synchronous = sum(lane.synchronous for lane in self.lanes)
        return EngineStatistics(len(self.inflight) - reaped_next, self._issued + synchronous,
                                self._completed + reaped_next + synchronous,
                                self._detached, self._thread_waits, self.running)

    # -- for the watchdog (any thread) -------------------------------------------
    def snapshot(self, limit: int = 8) -> EngineSnapshot:
        """The `limit` oldest in-flight ops, from any thread: the loop only appends
        to `inflight` or replaces it whole, so a copy is consistent (issue order)."""
        now, ops, lanes = time.perf_counter(), list(self.inflight), list(self.lanes)
        index = {id(lane): i for i, lane in enumerate(lanes)}
        views = tuple(InflightOp(describe_op(op), now - op.issued_at, index.get(id(op.lane), -1),
                                 _position(op), id(op), op.call.kind is Kind.JOIN,
                                 _unmatched_by(op))
                      for op in ops[:limit])
        outside = [v for v in (watch() for watch in list(self.watched)) if v is not None]
        if outside:
            views = tuple(sorted(views + tuple(outside), key=lambda v: -v.age_s))[:limit]
        return EngineSnapshot(views, len(ops) + len(outside),
                              tuple(_issued(lane) for lane in lanes),
                              tuple(str(lane.transport.name) for lane in lanes))

    def call_soon_threadsafe(self, fn: Callable[[], object]) -> bool:
        """Run `fn()` on the engine's loop; False when no loop runs the engine."""
        call = self._call_soon
        if call is None:
            return False
        call(fn)
        return True

    def fail_all(self, error: BaseException) -> int:
        """On the loop thread, when the job is stopping (a rank died, a stall abort):
        the requests can never complete, so every waiter and every later
        submission gets `error` instead of hanging."""
        self.failure = error
        ops, self.inflight = self.inflight, []
        self._fillers.clear()
        for lane in self.lanes:
            lane.queue.clear()
            lane.matcher = None
        for op in ops:
            if not op.done:
                op.fail(_fresh(error))
        self._completed += len(ops)
        return len(ops)

    def fail_all_soon(self, error: BaseException) -> None:
        """From any thread: `fail_all` on the loop, or here when no loop runs."""
        if not self.call_soon_threadsafe(lambda: self.fail_all(error)):
            self.fail_all(error)


# Observers from layers above (the timeline), called as an engine starts polling.
_START_HOOKS: list[Callable[[Engine], None]] = []


def on_engine_start(hook: Callable[[Engine], None]) -> None:
    """Call `hook(engine)` as each engine starts polling, if nothing observes it yet."""
    if hook not in _START_HOOKS:
        _START_HOOKS.append(hook)


def _issued(lane: Lane) -> int:
    """How far this rank got on `lane`, as peers compare it with their ops'
    `_position`: header rounds on a lane by name (named calls take no W_SEQ)."""
    return lane.rounds if lane.by_name else lane.seq


def _position(op: Operation) -> int:
    return op.slot if op.lane.by_name else op.call.seq


def _unmatched_by(op: Operation) -> tuple[int, ...] | None:
    """The ranks that have not proposed `op`, while it waits to be matched (read from
    the watchdog thread: the table may change under it, and a report can wait a tick)."""
    matcher = op.lane.matcher
    if matcher is None:
        return None
    try:
        return matcher.missing_for(op)
    except (IndexError, RuntimeError, ValueError):
        return None


def _sooner(timeout: float, cap: float | None) -> float:
    return timeout if cap is None else min(timeout, cap)


def _bulk_view(op: Operation, transport: Any) -> Any:
    """Where a bulk stage is issued: the channel's bulk view, whose allreduce a caller
    awaits with a core to poll may come back as a request the loop polls
    (`iallreduce_polled`: the node window's steps, on one node)."""
    view = transport.bulk_view() or transport
    if op.loop_banded() and not op.patient and not op.wait_in_thread and hasattr(
            view, "iallreduce_polled"):
        return _PolledView(view)
    return view


class _PolledView:
    """A bulk view whose allreduces go through `iallreduce_polled`."""

    __slots__ = ("_view",)

    def __init__(self, view: Any) -> None:
        self._view = view

    def iallreduce(self, send: Any, recv: Any, op: Any) -> Any:
        return self._view.iallreduce_polled(send, recv, op)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)


def _loop_band(op: Operation, band: tuple[int, int]) -> tuple[int, int]:
    """The channel's loop band for an allreduce a caller awaits with a core to poll it;
    none for the rest (patient ops, a gradient bucket's, go to the wait thread: their
    poller sleeps)."""
    return band if op.loop_banded() and not op.patient else (0, 0)


def _fresh(error: BaseException) -> BaseException:
    """One exception object per raise: tasks must not share a traceback."""
    try:
        return type(error)(*error.args)
    except Exception:
        return error


def describe_op(op: Operation) -> str:
    """Kind, op, dtype, shape, seq, lane and name: what a stall report needs."""
    if isinstance(op, RawRequest):
        return op.what
    c = op.call
    text = c.kind.name.lower()
    if c.kind in (Kind.ALLREDUCE, Kind.REDUCE_SCATTER) and c.op:
        text += f"({ReduceOp(c.op).name.lower()})"
    if c.dtype:
        text += f" {DTYPE_NAMES[c.dtype]}{list(c.shape)}"
    text += f" #{c.seq} on lane {op.lane.transport.name}"
    return text + (f" name={c.name!r}" if c.name else "")


class RawRequest(Operation):
    """A transport request with no header round: completes when it tests true."""

    def __init__(self, request: Any, what: str) -> None:
        super().__init__(_NO_LANE, Call(Kind.BARRIER, 0, name=what[:16]))
        self.request = request
        self.state = State.DATA
        self.what = what

    def describe(self) -> str:
        return self.what


class _NoLane:
    """Placeholder lane for raw requests (they never enter a FIFO)."""

    rank = 0
    size = 1
    transport = None
    names: dict[str, Operation] = {}  # never written: raw requests are not named calls
    by_name = False
    seq = 0
    matcher = None  # raw requests never wait to be matched


_NO_LANE: Any = _NoLane()
