"""The state machine every checked collective runs through.

HEADER: the header round is in flight (issued in the caller's order). On a
channel with a compact round (`base.header`) that is first the constant-size
reduction; when its verdict asks for every rank's slot, the rows round
follows on the channel's rows communicator, issued in header order: an op
waits for that turn until every earlier op on the lane has its compact
verdict, so every rank issues the rows rounds in the same order.
READY: headers agreed; the next data stage waits for its turn in the
channel's FIFO, so data-stage order is the header order on every rank.
DATA: a data-stage request is in flight. DONE: result or error is set.

An operation belongs to the engine once started: cancelling the task that
awaits it only detaches the waiter, and the operation still runs every
stage the other ranks expect. That is what keeps ranks in step.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import numpy as np

from ..base.errors import AsynclockError, BackendError
from ..base.header import (
    COMPACT_HEAD,
    COMPACT_WORDS,
    FOLD_NONE,
    HEADER_BYTES,
    NEED_ROWS,
    SLOT_WORDS,
    WORDS,
    Call,
    agree,
    check,
    compact_agreed,
    compact_words,
    joining,
    pack,
)
from ..transports.base import Channel, DataTransport, Request
from . import fastpath, header_round
from .policy import ProgressPolicy

Stage = Callable[[DataTransport], Request]  # called with the transport to use


class State(enum.Enum):
    HEADER = 1
    READY = 2
    DATA = 3
    DONE = 4


# Where an op in HEADER is: its compact round in flight; waiting for its turn to
# issue the rows round; the rows round in flight (or done, waiting to be matched).
COMPACT, AWAITING_ROWS, ROWS = 1, 2, 3


class MatchTable(Protocol):
    """A lane's table of calls waiting to be matched by name (`matching.Matcher`)."""

    def settle(self) -> None: ...

    def filler_due(self) -> bool: ...

    def stuck(self) -> bool: ...

    def close(self) -> None: ...

    def missing_for(self, op: Operation) -> tuple[int, ...] | None: ...


class LaneHost(Protocol):
    """The engine serving a lane: its filler rounds and its matching table."""

    @property
    def policy(self) -> ProgressPolicy: ...

    def want_filler(self, lane: Lane, delay: float) -> None: ...

    def matcher_for(self, lane: Lane) -> MatchTable: ...


class Lane:
    """A channel plus its sequence counter and data-stage FIFO.

    A positional lane pairs the n-th call of every rank, and any disagreement
    is that call's error. A lane `by_name` (the user's collectives, process
    sets) pairs the same way while the ranks agree, and once they do not,
    matches named calls by name and unnamed calls by their count of unnamed
    calls (`engine.matching`), as Horovod does: a call only some ranks
    issued waits for the others instead of shifting every later call.
    """

    def __init__(self, transport: Channel, by_name: bool = False) -> None:
        self.transport = transport
        self.rank = transport.rank
        self.size = transport.size
        self.by_name = by_name
        self.seq = 0  # W_SEQ: every call here, or the unnamed calls on a lane by name
        self.rounds = 0  # header rounds issued on this rank: a round's index is its slot
        self.matcher: MatchTable | None = None  # set while a call waits to be matched
        self.host: LaneHost | None = None  # the engine serving the lane
        self.names: dict[str, Operation] = {}  # named calls in flight
        self.uncollected: Operation | None = None  # the last named call finished, not taken
        self.queue: deque[Operation] = deque()
        self.recent: deque[float] = deque(maxlen=8)  # seconds its recent small ops took
        self.noted = 0  # small ops timed into `recent`, ever
        self.synchronous = 0  # small calls finished inside the call (`engine.small_calls`)
        self.spin_s: float | None = None  # set by the engine from `recent` (None: default)
        # Its header-round variant (collective: compact rounds through node memory
        # are agreed); `header_rounds.start` is None where it has only the rows round.
        self.header_rounds = header_round.rounds_for(transport)
        # Mid-size allreduces' data through the same node's memory (collective, after the
        # node round; the channel keeps it and picks it per call from agreed facts).
        self.node_data = header_round.node_data(transport, self.header_rounds.node)
        fastpath.arm_window(transport)  # local: either path's steps interoperate
        self.awaiting_rows = 0  # ops whose rows round waits for its turn
        self.rows_rounds = 0  # rows rounds issued here (all of them without a compact round)

    def note_latency(self, seconds: float) -> float | None:
        """Record a small op's issue-to-done time; every 4th call returns the median
        of the recent ones (else None), so the caller re-derives its spin rarely."""
        self.recent.append(seconds)
        self.noted += 1
        return sorted(self.recent)[len(self.recent) // 2] if self.noted % 4 == 0 else None

    def next_seq(self, name: str = "") -> int:
        """The W_SEQ of the next call. A named call on a lane by name carries the
        next count without taking it: only unnamed calls advance it there."""
        if name and self.by_name:
            return self.seq + 1
        self.seq += 1
        return self.seq

    def claim(self, name: str) -> None:
        """Refuse a name that a call of this rank still holds, before anything is
        sent: in flight, or finished but neither collected nor followed by another
        round (whether it finished would otherwise be a race)."""
        held = self.names.get(name)
        if held is None:
            held = self.uncollected
            if held is None or held.call.name != name or held.collected \
                    or held.slot != self.rounds:
                return
        raise ValueError(f"a collective named {name!r} is already in flight on "
                         f"{self.transport.name}: {held.describe()}")

    def issue_rows(self) -> None:
        """Start the rows rounds whose turn came: in header order, each once every
        earlier op on the lane has its compact verdict (the order every rank has)."""
        if not self.awaiting_rows:
            return
        for op in self.queue:
            if op.state is not State.HEADER:
                continue
            if op.phase == COMPACT:
                return
            if op.phase == AWAITING_ROWS:
                op.start_rows()
        self.awaiting_rows = 0  # also forgets ops that failed while they waited

    def pump(self, issue: Callable[[Operation], None]) -> None:
        """Issue data stages strictly in header order; stop at the first not ready."""
        q = self.queue
        while q:
            op = q[0]
            if op.state is State.READY:
                issue(op)
            if op.state is State.DONE or (op.state is State.DATA and not op.stages):
                q.popleft()
                continue
            return


class Operation:
    """Base of all collectives; subclasses supply payload, plan and result."""

    threaded_min_bytes = 0  # set by the engine's policy
    # Nobody waits on it with a free core to burn: no spin, no tight polling (the
    # shared-memory round's check, issued while backward still computes).
    patient = False
    # Its data stages are waited for in the lane's wait thread whatever their size: a
    # stage only another thread can finish (Horovod's), which the loop could only poll.
    wait_in_thread = False
    __slots__ = ("lane", "call", "state", "request", "stages", "stage_bytes", "threaded",
                 "thread_done", "result", "error", "waiter", "issued_at", "detached", "joined",
                 "awaiting_hint", "slot", "arrived", "collected", "_recv", "_send", "_words",
                 "phase", "fold", "reduced")

    def __init__(self, lane: Lane, call: Call) -> None:
        self.lane = lane
        self.call = call
        self.state = State.HEADER
        self.request: Request | None = None
        self.stages: deque[Stage] = deque()
        self.stage_bytes = 0
        self.threaded = False
        self.thread_done = False
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiter: anyio.Event | None = None
        self.issued_at = 0.0
        self.detached = False
        self.joined: tuple[int, ...] = ()  # ranks that stand in (engine.join)
        # True while only a sign from outside MPI (`Engine.hint`) says the peers have
        # issued it: the poller then sleeps long instead of testing every millisecond.
        self.awaiting_hint = False
        self.slot = 0  # the lane's round index of this op's header round
        self.arrived = False  # header round complete, waiting for the matcher
        self.collected = False  # someone took the outcome (frees the name)
        self._send: np.ndarray[Any, Any] | None = None  # this rank's slot, once packed
        self._words: np.ndarray[Any, Any] | None = None  # its compact words (MPI reads them)
        self.phase = ROWS
        self.fold = FOLD_NONE
        # The compact round's reduced inline payload, once every rank agreed on it.
        self.reduced: np.ndarray[Any, Any] | None = None

    def loop_banded(self) -> bool:
        """Whether the channel's loop band (`Channel.loop_band`) may keep this op's
        data stage on the loop: allreduces only."""
        return False

    # -- lifecycle -----------------------------------------------------------
    def start(self) -> None:
        """Issue the header round; must run in the caller's order."""
        lane = self.lane
        if lane.header_rounds.start is None:
            self.start_rows()
        else:
            fold = self.compact_fold()
            rows = fold is None or self.call.fault or lane.matcher is not None
            self.fold = FOLD_NONE if fold is None else fold
            self._words = np.empty(COMPACT_WORDS, np.int64)
            compact_words(self.slot_words(), self.fold, NEED_ROWS if rows else 0, self._words)
            self._recv = np.empty(COMPACT_WORDS, np.int64)
            self.phase = COMPACT
            self.request = lane.header_rounds.start(self._words, self._recv)
        self._enter(lane)

    def slot_words(self) -> np.ndarray[Any, Any]:
        """This rank's packed slot: header words, then the inline payload."""
        if self._send is None:
            send = np.zeros(SLOT_WORDS, np.int64)
            pack(self.call, send)
            self.fill_inline(send.view(np.uint8)[HEADER_BYTES:])
            self._send = send
        return self._send

    def start_rows(self) -> None:
        """Issue the rows round (`Lane.issue_rows` decides when)."""
        lane = self.lane
        self._recv = np.empty(lane.size * SLOT_WORDS, np.int64)
        self.phase = ROWS
        lane.rows_rounds += 1
        self.request = lane.transport.iallgather_slots(self.slot_words(), self._recv)

    def _enter(self, lane: Lane) -> None:
        """This op's round is the lane's newest: take its slot and FIFO place."""
        lane.rounds += 1
        self.slot = lane.rounds
        if self.call.name and lane.by_name:
            lane.names[self.call.name] = self
        lane.queue.append(self)

    def resume_header(self, request: Request, send: np.ndarray[Any, Any],
                      recv: np.ndarray[Any, Any]) -> None:
        """Own a header round that `engine.small_calls` started (and counted) from its
        own buffers; MPI may read `send` until the round completes, so the op holds it."""
        self.request, self._recv = request, recv
        lane = self.lane
        if lane.header_rounds.start is None:
            self._send = send
        else:
            self._words = send
            fold = self.compact_fold()
            self.fold = FOLD_NONE if fold is None else fold
            self.phase = COMPACT
        lane.rounds -= 1  # `_enter` counts it again
        self._enter(lane)

    def resume_data(self, request: Request) -> None:
        """Own a data stage that `engine.small_calls` issued after the headers agreed
        (nothing earlier on the lane was waiting, so it is not queued)."""
        self.request, self.state = request, State.DATA

    def poll(self) -> bool:
        """Test the outstanding request; advance and return True if it finished."""
        req = self.request
        if req is None:
            return False
        if self.threaded:
            if not self.thread_done:
                return False
            if self.error is not None:  # the wait thread's transport error: fail the op
                error, self.error = self.error, None  # (its subclass hears of it)
                self.request, self.threaded = None, False
                self.stages.clear()
                self.fail(BackendError(f"{self.describe()}: {error}"))
                return True
        elif not req.Test():
            return False
        self.request = None
        self.threaded = self.thread_done = False
        self._advance()
        return True

    def _advance(self) -> None:
        if self.state is State.HEADER:
            if self.phase == COMPACT:
                self._on_compact()
            else:
                self._on_header()
        elif self.stages:
            self.state = State.READY
        else:
            self._finish(self.finish)

    def _on_compact(self) -> None:
        """The compact verdict: every rank agreed (go on as from agreed rows: every
        row is this rank's slot, the inline payload already reduced), or every
        rank runs the rows round in its turn."""
        lane = self.lane
        if compact_agreed(self._recv, self.fold):
            self.reduced = self._recv.view(np.uint8)[COMPACT_HEAD * 8:]
            rows = np.empty((lane.size, SLOT_WORDS), np.int64)
            rows[:] = self.slot_words()  # my slot as every rank's row
            self._recv = rows.reshape(-1)
            self.phase = ROWS
            lane.issue_rows()
            self._on_header()
        else:
            self.phase = AWAITING_ROWS
            lane.awaiting_rows += 1
            lane.issue_rows()

    def _on_header(self) -> None:
        lane = self.lane
        rows = self._recv.reshape(lane.size, SLOT_WORDS)
        if lane.matcher is not None or not agree(self._recv, lane.size):
            if lane.by_name and (lane.matcher is not None or not joining(rows)):
                self.arrived = True
                if lane.host is None:
                    raise RuntimeError(f"lane {lane.transport.name} matches by name but "
                                       "has no engine")
                lane.host.matcher_for(lane).settle()
                return
            try:
                self.joined = check(rows[:, :WORDS], self.call.kind)
            except AsynclockError as exc:
                self.fail(exc)
                return
        self.on_rows(rows)

    def on_rows(self, rows: np.ndarray[Any, Any]) -> None:
        """Every rank's slot for this op agreed: plan its data stages, or finish."""
        payload = rows.view(np.uint8)[:, HEADER_BYTES:]
        try:
            stages = self.plan(rows, payload)
        except Exception as exc:  # local arithmetic failed: this op's error
            self.fail(exc)
            return
        if stages:
            self.stages.extend(stages)
            self.state = State.READY
        else:
            self._finish(self.finish)

    def issue_next(self, transport: DataTransport) -> Request | None:
        """Start the next data stage (called by the lane pump in FIFO order)."""
        stage = self.stages.popleft()
        self.state = State.DATA
        try:
            self.request = stage(transport)
        except Exception as exc:  # a transport refusing to start is fatal for the op
            self.stages.clear()
            self.fail(BackendError(f"{self.describe()}: {exc}"))
        return self.request

    def _finish(self, fn: Callable[[], Any]) -> None:
        try:
            value = fn()
        except Exception as exc:
            self.fail(exc)
        else:
            self.complete(value)

    def complete(self, value: Any) -> None:
        self.result = value
        self._done()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self._done()

    def _done(self) -> None:
        self.state = State.DONE
        name = self.call.name
        if name and self.lane.names.get(name) is self:
            del self.lane.names[name]
            if not self.collected:
                self.lane.uncollected = self
        if self.waiter is not None:
            self.waiter.set()

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    def outcome(self) -> Any:
        """The result, or raise the op's error (a fresh raise on every call)."""
        self.collected = True
        if self.error is not None:
            raise self.error
        return self.result

    def describe(self) -> str:
        c = self.call
        return f"{c.kind.name.lower()} #{c.seq} on {self.lane.transport.name}" + (
            f" name={c.name!r}" if c.name else "")

    # -- subclass hooks ------------------------------------------------------
    def compact_fold(self) -> int | None:
        """How the compact round folds this call's inline payload (`header.FOLDS`,
        `FOLD_BOR`, `FOLD_NONE` when nothing rides inline), or None: the call
        needs every rank's slot (default: the rows round)."""
        return None

    def fill_inline(self, slot: np.ndarray[Any, Any]) -> None:
        """Copy a small payload into the header slot (default: none)."""

    def plan(self, rows: np.ndarray[Any, Any], payload: np.ndarray[Any, Any]) -> list[Stage]:
        """Headers agreed: finish from inline payloads, or return data stages."""
        return []

    def finish(self) -> Any:
        """Produce the result once every stage completed."""
        return None
