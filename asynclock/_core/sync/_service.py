"""One message pump per coordinator: the home of every sync primitive's traffic.

A single task per rank receives every point-to-point message on the sync
lane's communicator and routes it: requests go to the manager of the named
primitive (created on first contact, so a rank serves primitives it never
touched itself), replies go to the waiting ticket. It runs for the whole
life of `coord.running()` on every rank, so any rank can be a primitive's
home and always answers liveness pings.

Receiving uses Iprobe + Recv from this task only, so nothing is left posted
(no receive request to cancel at shutdown, nothing in the engine's
`inflight` list to hold up `drain()`). Polling follows the engine's policy:
tight (`sleep(0)`) while messages flow or replies are awaited, then sleeps
that grow with idle time up to `max_sleep_s`.

Messages to this rank itself (a primitive homed here) never touch MPI: they
go through an in-process queue drained iteratively, so a manager that grants
to a local task, whose cancellation releases again, never recurses.

Here too: the service's policy, the ticket each outstanding request of this
rank waits on, and the task identity a lock's owner is recorded by.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import sniffio

from ..base import settings
from ..base.backoff import Backoff, poll_until
from ..base.wakeup import Wakeup
from ..engine.operation import Lane
from ..engine.progress import Engine, ProgressPolicy
from ..transports.base import Channel, Request
from ._manager import EventManager, PermitManager
from ._wire import HEAD, MAX_WORDS, M

_KINDS = {int(k): k for k in M}  # int -> M without enum's slow __call__

Msg = Sequence[int]
Orphan = Callable[[M, Msg], None]


@dataclass(frozen=True, slots=True)
class SyncPolicy:
    """Stall handling (env: ASYNCLOCK_SYNC_STALL_S, ASYNCLOCK_SYNC_PROBE_S).

    A wait without a deadline probes the ranks it depends on every
    `stall_s`; a rank that does not answer within `probe_s` is reported
    dead (RankFailedError) instead of leaving the waiter hung forever.
    """

    stall_s: float = 30.0
    probe_s: float = 10.0
    lease: bool = True  # ASYNCLOCK_SYNC_LEASE=0: no lock caching (see _manager)

    @classmethod
    def from_env(cls) -> SyncPolicy:
        return cls(stall_s=settings.number("ASYNCLOCK_SYNC_STALL_S"),
                   probe_s=settings.number("ASYNCLOCK_SYNC_PROBE_S"),
                   lease=settings.flag("ASYNCLOCK_SYNC_LEASE"))


def any_task() -> object:
    return anyio.get_current_task().id


def task_getter() -> Callable[[], object]:
    """The running task object, cheaply: anyio.get_current_task builds a TaskInfo
    (costly on a lock's fast path), while the loop's own accessor is a lookup."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_task
    import asyncio

    return asyncio.current_task


class Ticket:
    """One outstanding request of this rank; resolved by exactly one reply."""

    __slots__ = ("id", "reply", "words", "event", "abandoned", "orphan")

    def __init__(self, ident: int, orphan: Orphan | None) -> None:
        self.id = ident
        self.reply: M | None = None
        self.words: Msg = ()
        self.event: anyio.Event | None = None
        self.abandoned = False
        self.orphan = orphan

    def resolve(self, kind: M, words: Msg) -> None:
        if self.abandoned:
            if self.orphan is not None:
                self.orphan(kind, words)
            return
        self.reply, self.words = kind, words
        if self.event is not None:
            self.event.set()



class SyncHost(Protocol):
    """What the sync primitives need of the coordinator: its plumbing (`coord.lowlevel`)."""

    @property
    def sync_lane(self) -> Lane: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def sync(self) -> SyncService: ...

log = logging.getLogger("asynclock.sync")

__all__ = ["Msg", "SyncPolicy", "SyncService", "Ticket"]


class SyncService:
    """Per-coordinator message pump, manager registry and ticket table."""

    def __init__(self, coord: SyncHost) -> None:
        self.coord = coord
        self.channel: Channel = coord.sync_lane.transport
        self.rank, self.size = self.channel.rank, self.channel.size
        self.progress: ProgressPolicy = coord.engine.policy
        self.policy = SyncPolicy.from_env()
        self.cold_max_sleep_s = settings.number("ASYNCLOCK_SYNC_COLD_SLEEP_US") * 1e-6
        self.primitives: dict[tuple[str, str], Any] = {}
        self.known_events: set[int] = set()
        self.token_sinks: dict[int, Callable[[int], None]] = {}
        self.recall_sinks: dict[int, Callable[[int], None]] = {}
        self.early_tokens: dict[int, list[int]] = {}
        self._permits: dict[int, PermitManager] = {}
        self._events: dict[int, EventManager] = {}
        self._tickets: dict[int, Ticket] = {}
        self._next_ticket = 0
        self._local: deque[Msg] = deque()
        self._pumping = False
        self._sends: list[tuple[Request, Any]] = []
        self._buf = np.zeros(MAX_WORDS, np.int64)
        p = self.progress  # the pump polls like the engine: tight, then growing sleeps
        self._backoff = Backoff(p.min_sleep_s, p.max_sleep_s, share=p.sleep_fraction,
                                busy_s=p.busy_s)
        self._wakeup = Wakeup()  # the pump's idle sleep, ended early by activity
        self.running = False
        self.received = self.sent = 0
        self.current_task: Callable[[], object] = any_task
        self._last_yield = time.perf_counter()
        self.unreachable: set[int] = set()

    async def maybe_yield(self) -> None:
        """Fast paths take no checkpoint (like asyncio.Lock), but a task looping
        on them yields once a millisecond, so the loop is never monopolised.

        Twice: on asyncio one checkpoint only lets an expired timer's callback
        run, and the task it wakes is queued behind this one's next 1 ms, so a
        1 ms ticker would wake several ms late; the second checkpoint lets the
        woken task run (`bench/sync.py` measures the ticker's lateness).
        """
        now = time.perf_counter()
        if now - self._last_yield > 1e-3:
            self._last_yield = now
            await anyio.lowlevel.checkpoint()
            await anyio.lowlevel.checkpoint()

    def next_id(self) -> int:
        """A fresh ticket number without a Ticket (fast local grants)."""
        self._next_ticket += 1
        return self._next_ticket

    def local_permits(self, obj: int) -> PermitManager:
        """The manager of a primitive homed on this rank (the fast path uses it)."""
        return self._permit(obj)

    # -- registry --------------------------------------------------------------
    def primitive(self, kind: str, name: str, make: Callable[[], Any]) -> Any:
        """One object per (kind, name) on this rank, shared by its tasks."""
        key = (kind, name)
        obj = self.primitives.get(key)
        if obj is None:
            obj = self.primitives[key] = make()
        return obj

    def ticket(self, orphan: Orphan | None = None) -> Ticket:
        self._next_ticket += 1
        t = self._tickets[self._next_ticket] = Ticket(self._next_ticket, orphan)
        return t

    def reopen(self, ident: int, orphan: Orphan | None = None) -> Ticket:
        """Wait for a second reply on an old ticket id (a condition's re-grant)."""
        t = self._tickets[ident] = Ticket(ident, orphan)
        return t

    # -- sending ---------------------------------------------------------------
    def send(self, dest: int, words: Msg) -> None:
        """Send now; to ourselves it is handled before this returns."""
        if dest == self.rank:
            self._local.append(words)
            if not self._pumping:
                self._pump_local()
            return
        buf = np.array(words, np.int64)
        try:
            req = self.channel.p2p_isend(buf, dest)
        except Exception as exc:  # e.g. a TCP peer that closed: it is gone
            self._lost(dest, exc)
            return
        self.sent += 1
        if not req.Test():
            self._sends.append((req, buf))
        self._activity()

    def _lost(self, dest: int, exc: Exception) -> None:
        """The transport refused to reach `dest`: its waiters learn it from the
        next liveness probe (RankFailedError), not from a crash of the pump."""
        if dest not in self.unreachable:
            log.warning("sync: rank %d unreachable: %s", dest, exc)
        self.unreachable.add(dest)

    def broadcast(self, words: Msg) -> None:
        for r in range(self.size):
            self.send(r, words)

    def _pump_local(self) -> None:
        self._pumping = True
        try:
            while self._local:
                self._dispatch(self.rank, self._local.popleft())
        finally:
            self._pumping = False

    def _activity(self) -> None:
        """Something was sent or received: poll tightly again for a while."""
        self._backoff.reset()
        self._wakeup.wake()

    # -- receiving and routing -----------------------------------------------------
    def poll(self) -> bool:
        """Handle every message that has arrived; complete finished sends."""
        got = False
        while (hit := self.channel.p2p_try_recv(self._buf)) is not None:
            source, nbytes = hit
            self.received += 1
            got = True
            self._dispatch(source, self._buf[: nbytes // 8].tolist())
        if self._sends:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        return got

    def _dispatch(self, source: int, w: Msg) -> None:
        kind = _KINDS[w[0]]
        if kind >= M.GRANT:
            self._reply(kind, w)
        elif kind <= M.INFO or kind is M.BUSY:
            self._permit(w[1]).handle(source, kind, w)
        elif kind <= M.EVENT_CANCEL:
            self._event(w[1]).handle(source, kind, w)
        elif kind is M.PING:
            self.send(source, (int(M.PONG), 0, w[2]))
        elif kind is M.RECALL:
            self._recall(w[1], w[2])
        else:
            self._token(w[1], w[HEAD])

    def _recall(self, obj: int, ticket: int) -> None:
        sink = self.recall_sinks.get(obj)
        if sink is not None:
            sink(ticket)

    def _reply(self, kind: M, w: Msg) -> None:
        if kind is M.EVENT_KNOWN:
            self.known_events.add(w[1])
            return
        t = self._tickets.pop(w[2], None)
        if t is None:
            log.debug("sync: reply %s for unknown ticket %d", kind.name, w[2])
            return
        t.resolve(kind, w)

    def _permit(self, obj: int) -> PermitManager:
        m = self._permits.get(obj)
        if m is None:
            m = self._permits[obj] = PermitManager(obj, self.send, self.rank,
                                                   self.policy.lease)
        return m

    def _event(self, obj: int) -> EventManager:
        m = self._events.get(obj)
        if m is None:
            m = self._events[obj] = EventManager(obj, self.send, self.broadcast)
        return m

    def _token(self, obj: int, generation: int) -> None:
        sink = self.token_sinks.get(obj)
        if sink is None:
            self.early_tokens.setdefault(obj, []).append(generation)
        else:
            sink(generation)

    def home_state(self, obj: int) -> PermitManager | None:
        """The manager of `obj` if this rank is its home and it was used."""
        return self._permits.get(obj)

    # -- waiting ---------------------------------------------------------------
    async def wait(self, t: Ticket, timeout: float | None,
                   stall: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Await t's reply; False if `timeout` passed first.

        Every `stall_s` without a reply, `stall()` probes the ranks this wait
        depends on, and raises if one of them is gone.
        """
        if t.reply is not None:
            return True
        t.event = anyio.Event()
        self._activity()
        deadline = None if timeout is None else time.monotonic() + timeout
        while t.reply is None:
            step = self.policy.stall_s
            if deadline is not None:
                step = min(step, deadline - time.monotonic())
                if step <= 0:
                    return False
            with anyio.move_on_after(step):
                await t.event.wait()
            if t.reply is None and stall is not None and (
                    deadline is None or time.monotonic() < deadline):
                await stall()
        return True

    async def request(self, dest: int, words: Msg, timeout: float) -> Msg | None:
        """A round trip with a deadline; None if `dest` did not answer in time."""
        t = self.ticket()
        self.send(dest, (words[0], words[1], t.id, *words[HEAD:]))
        if await self.wait(t, timeout):
            return t.words
        t.abandoned = True
        return None

    async def alive(self, rank: int) -> bool:
        """Does `rank`'s pump answer a ping within `probe_s`?"""
        if rank == self.rank:
            return True
        if rank in self.unreachable:
            return False
        with anyio.CancelScope(shield=True):
            answer = await self.request(rank, (int(M.PING), 0, 0), self.policy.probe_s)
        return answer is not None

    # -- the pump task -----------------------------------------------------------
    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                  ) -> None:
        """Receive until cancelled (the coordinator's task group owns this task)."""
        self.current_task = task_getter()
        self.running = True
        task_status.started()
        try:
            await self._loop()
        finally:
            self.running = False
            self._return_leases()
            self._finish_sends()

    def _return_leases(self) -> None:
        """Leaving: idle cached permits go home, or a later RECALL would find
        nobody to answer it."""
        for obj in self.primitives.values():
            release = getattr(obj, "release_cached", None)
            if release is not None:
                try:
                    release()
                except Exception as exc:  # best effort on the way out
                    log.warning("sync: returning leases at shutdown: %s", exc)

    async def _loop(self) -> None:
        backoff = self._backoff
        while True:
            if self.poll():
                backoff.reset()
            if self._sends or backoff.busy():
                await anyio.sleep(0)
                continue
            await self._wakeup.sleep(backoff.next_sleep(
                tight=False, max_s=self.cold_max_sleep_s if self._cold() else None))

    def _cold(self) -> bool:
        """No sync primitive was ever used here, as user or home, and no reply is
        awaited. Such a rank (a training job without locks) polls at most every
        `cold_max_sleep_s` when idle instead of every 20 ms: each wake of the loop
        takes CPU from the cores that train (`bench/wakeups.py`; figures on the
        benchmarks page). The price: the first request ever to reach a primitive
        homed here may wait that long once; after it, the usual cadence."""
        return not (self.primitives or self._permits or self._events or self._tickets)

    def _finish_sends(self) -> None:
        """Small sends complete at once (eager); give stragglers a bounded spin."""
        def sent() -> bool:
            self._sends = [(r, b) for r, b in self._sends if not r.Test()]
            return not self._sends

        if self._sends and not poll_until(sent, Backoff.every(0.0), timeout=0.1):
            log.warning("sync: %d messages still unsent at shutdown", len(self._sends))
