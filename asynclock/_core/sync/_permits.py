"""The requester side shared by Lock and Semaphore: acquire, withdraw, release.

Cancellation rules (tests/test_sync.py checks each):

* cancelled while queued: a CANCEL follows the ACQUIRE to the home rank
  (same sender, so it cannot overtake it); the manager drops the waiter and
  answers WITHDRAWN. If the manager had already granted, the GRANT is on
  its way; the ticket is marked abandoned and releases on arrival, so the
  permit is handed on, never lost.
* cancelled after the grant arrived but before the task resumed: released
  at once, before the cancellation propagates.
* timeout: like cancellation, but the task waits (shielded, bounded by the
  probe deadline) for the manager's answer to build a CollectiveTimeout that
  names the holder and waiter ranks. A GRANT that crossed the CANCEL is
  kept (the permit was this task's as the deadline passed), and an ERROR
  raises as it would without a deadline. `acquire(timeout=0)` is a
  try-acquire, `acquire_nowait`'s round: a free permit is taken whichever
  rank is its home, even one cached idle on another rank.

Leases (see `_manager`): a permit granted with a lease stays cached on this
rank after release, idle, and the next local acquire takes it without
messages; a RECALL from the home rank gives an idle one back at once, or
marks a busy one to be given back on release.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from ..base.errors import CollectiveTimeout, MismatchError, RankFailedError
from ._wire import HEAD, ErrorCode, M, home_rank, object_id, parse_info

if TYPE_CHECKING:
    from ._service import Msg, SyncService, Ticket

log = logging.getLogger("asynclock.sync")


@dataclass(frozen=True, slots=True)
class PermitInfo:
    """The home rank's view: who holds the permits and who waits, in order."""

    name: str
    home_rank: int
    capacity: int
    holders: tuple[int, ...]
    waiters: tuple[int, ...]
    condition_waiters: int
    leased: tuple[int, ...]  # holders that hold a lease (possibly idle, cached)


@dataclass(frozen=True, slots=True)
class PermitStatistics:
    """This rank's view of one lock or semaphore."""

    name: str
    home_rank: int
    capacity: int
    held_here: int
    tasks_waiting: int
    acquired: int
    contended: int  # acquires that waited for an answer: held, or homed on another rank
    cancelled: int
    timed_out: int
    orphaned: int  # grants that landed after their task left, passed on
    cached: int  # leased permits idle on this rank (taken without messages)


class Permits:
    """`capacity` permits named `name`, shared by every task on every rank."""

    kind = "semaphore"

    def __init__(self, service: SyncService, name: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"{self.kind} {name!r}: capacity must be >= 1, got {capacity}")
        self._svc = service
        self.name = name
        self.capacity = capacity
        self.obj = object_id(self.kind, name)
        self.home = home_rank(name, service.size)
        self._held: dict[int, object] = {}  # ticket -> task, oldest first
        self._mgr = service.local_permits(self.obj) if self.home == service.rank else None
        if self._mgr is not None:
            self._mgr.declare(capacity)
        self._leases: dict[int, bool] = {}  # leased ticket -> recalled
        self._idle: list[int] = []  # leased tickets cached here, free
        self.pending: set[int] = set()  # tickets asked for and not yet taken
        service.recall_sinks[self.obj] = self._on_recall
        self._waiting = 0
        self._acquired = self._contended = self._cancelled = self._timed_out = 0
        self._orphaned = 0

    # -- acquiring ---------------------------------------------------------------
    async def acquire(self, timeout: float | None = None) -> None:
        """Wait for a permit (FIFO across ranks).

        On the home rank (or with an idle lease) a free permit is taken without
        messages; see `_take_local` for how that stays fair.

        Args:
            timeout: seconds to wait; None waits for ever (stalls are still probed
                and reported); 0 (or less) takes a free permit like `acquire_nowait`,
                whichever rank is its home.

        Raises:
            CollectiveTimeout: not acquired within `timeout`; names the holders and
                the other waiters.
            RankFailedError: the home rank or a holder did not answer a liveness probe.
            MismatchError: this rank asked for another capacity than the home rank has.
        """
        if self._take_local():
            await self._yield_holding()
            return
        poll = timeout is not None and timeout <= 0  # a try-acquire: `acquire_nowait`'s round
        t = self._request(nowait=poll)
        if t.reply is None:
            self._contended += 1
            await self._await_grant(t, None if poll else timeout)
        if t.reply is M.DENY:
            self._timed_out += 1
            self.pending.discard(t.id)
            raise CollectiveTimeout(self._timeout_text(t, timeout, True))
        self._take(t)

    async def acquire_nowait(self) -> None:
        """Take a permit only if one is free now.

        Never waits for a holder; when the home rank is another rank this
        costs one round trip (no queueing), which is why it is async.

        Raises:
            anyio.WouldBlock: no permit is free.
        """
        if self._take_local():
            await self._yield_holding()
            return
        t = self._request(nowait=True)
        if t.reply is None:
            await self._await_grant(t, None)
        if t.reply is M.DENY:
            self.pending.discard(t.id)
            raise anyio.WouldBlock(f"{self.kind} {self.name!r} is not free")
        self._take(t)

    async def _yield_holding(self) -> None:
        """The fairness checkpoint after a local take. Cancelled here, the task
        never entered the lock: hand the permit on before re-raising
        (tests/test_sync_regressions.py checks it)."""
        try:
            await self._svc.maybe_yield()
        except BaseException:
            self.release()
            raise

    def _take_local(self) -> bool:
        """Take a permit without messages, if that is fair.

        Other ranks' requests and recalls that already arrived are read first
        (one Iprobe), so a task looping on a lock homed here cannot starve
        remote waiters: once one is queued, FIFO sends this task to the queue.
        """
        mgr, svc = self._mgr, self._svc
        svc.poll()
        if self._idle:
            self._held[self._idle.pop()] = svc.current_task()
            self._acquired += 1
            return True
        if mgr is None:
            return False
        ticket = svc.next_id()
        if not mgr.take_now((svc.rank, ticket), self.capacity):
            return False
        self._held[ticket] = svc.current_task()
        self._acquired += 1
        return True

    def _request(self, nowait: bool) -> Ticket:
        t = self._svc.ticket(self._orphan)
        self.pending.add(t.id)
        self._svc.send(self.home, (int(M.ACQUIRE), self.obj, t.id, self.capacity, int(nowait)))
        return t

    def _take(self, t: Ticket) -> None:
        self.pending.discard(t.id)
        if t.reply is M.ERROR:
            raise self._error(t.words)
        self._note_lease(t)
        self._held[t.id] = self._svc.current_task()
        self._acquired += 1

    def _note_lease(self, t: Ticket) -> None:
        """A grant that carries a lease: cache the permit when it is released
        (unless a RECALL already came in before the task resumed)."""
        if len(t.words) > HEAD and t.words[HEAD]:
            self._leases.setdefault(t.id, False)

    def _on_recall(self, ticket: int) -> None:
        """The home rank wants a leased permit back: now if idle, else on release."""
        if ticket in self._idle:
            self._idle.remove(ticket)
            del self._leases[ticket]
            self._svc.send(self.home, (int(M.RELEASE), self.obj, ticket))
        elif ticket in self._held or ticket in self.pending:  # granted, task not back yet
            self._leases[ticket] = True
            self._svc.send(self.home, (int(M.BUSY), self.obj, ticket))

    async def _await_grant(self, t: Ticket, timeout: float | None) -> None:
        self._waiting += 1
        try:
            ok = await self._svc.wait(t, timeout, self._stalled)
        except BaseException:
            self._cancelled += 1
            self._withdraw(t)
            raise
        finally:
            self._waiting -= 1
        if not ok:
            await self._timeout(t, timeout)

    # -- cancellation --------------------------------------------------------------
    def _withdraw(self, t: Ticket) -> None:
        """Leave the queue; a grant that already arrived (or will) is passed on."""
        self.pending.discard(t.id)
        self._leases.pop(t.id, None)
        if t.reply is M.GRANT:
            self._svc.send(self.home, (int(M.RELEASE), self.obj, t.id))
        elif t.reply is None:
            t.abandoned = True
            self._svc.send(self.home, (int(M.CANCEL), self.obj, t.id))

    def _orphan(self, kind: M, w: Msg) -> None:
        """A grant for a task that already left: hand the permit on."""
        if kind is M.GRANT:
            self._orphaned += 1
            self._svc.send(self.home, (int(M.RELEASE), self.obj, w[2]))

    async def _timeout(self, t: Ticket, timeout: float | None) -> None:
        """Withdraw and learn the home rank's state: return where the answer is a
        grant or an error (the caller takes or raises it), else raise
        CollectiveTimeout naming the holders and waiters."""
        self._svc.send(self.home, (int(M.CANCEL), self.obj, t.id))
        with anyio.CancelScope(shield=True):
            answered = await self._svc.wait(t, self._svc.policy.probe_s)
        if t.reply is M.GRANT or t.reply is M.ERROR:
            return
        self._timed_out += 1
        self.pending.discard(t.id)
        self._leases.pop(t.id, None)
        if not answered:
            t.abandoned = True
        raise CollectiveTimeout(self._timeout_text(t, timeout, answered))

    def _timeout_text(self, t: Ticket, timeout: float | None, answered: bool) -> str:
        head = (f"{self.kind} {self.name!r}: not acquired within {timeout:g} s "
                f"by a task on rank {self._svc.rank}")
        if not answered:
            return (f"{head}; home rank {self.home} did not answer within "
                    f"{self._svc.policy.probe_s:g} s (dead, or its event loop is blocked)")
        _, holders, waiters, _, _ = parse_info(t.words)
        return (f"{head}; held by rank(s) {list(holders)}, other waiters on rank(s) "
                f"{list(waiters)} (home rank {self.home})")

    def _error(self, w: Msg) -> Exception:
        if w[3] == ErrorCode.CAPACITY_MISMATCH:
            return MismatchError(f"{self.kind} {self.name!r}: rank {self._svc.rank} asked for "
                                 f"capacity {self.capacity}, but the home rank {self.home} "
                                 f"has {w[4]}: create it with the same value on every rank")
        return RuntimeError(f"{self.kind} {self.name!r}: error {w[3]} from home rank")

    # -- stalls and diagnostics --------------------------------------------------------
    async def _stalled(self) -> None:
        """No grant for `stall_s`: is the home rank alive, and every holder?"""
        info = await self.info()
        for r in sorted(set(info.holders)):
            if not await self._svc.alive(r):
                raise RankFailedError(
                    f"{self.kind} {self.name!r}: holder rank {r} did not answer a liveness "
                    f"probe within {self._svc.policy.probe_s:g} s (dead, or its event loop "
                    f"is blocked); waiters on rank(s) {list(info.waiters)}")
        log.warning("%s %r: rank %d still waiting after %g s; held by rank(s) %s, "
                    "waiters %s", self.kind, self.name, self._svc.rank,
                    self._svc.policy.stall_s, list(info.holders), list(info.waiters))

    async def info(self, cond: int = 0) -> PermitInfo:
        """Ask the home rank who holds and who waits.

        Args:
            cond: the condition whose waiters to count (`Condition.info` passes its
                own; 0: none).

        Returns:
            The home rank's view: holders and waiters in queue order, leases.

        Raises:
            RankFailedError: the home rank did not answer within the probe time.
        """
        w = await self._svc.request(self.home, (int(M.INFO), self.obj, 0, cond),
                                    self._svc.policy.probe_s)
        if w is None:
            raise RankFailedError(
                f"{self.kind} {self.name!r}: home rank {self.home} did not answer within "
                f"{self._svc.policy.probe_s:g} s (dead, or its event loop is blocked)")
        return PermitInfo(self.name, self.home, *parse_info(w))

    # -- releasing -----------------------------------------------------------------
    def release(self) -> None:
        """Give back the permit the current task holds (else the oldest on this rank).

        Raises:
            RuntimeError: no permit is held on this rank.
        """
        self._give_back(self._pick())

    def _pick(self) -> int:
        me = self._svc.current_task()
        mine = [t for t, task in self._held.items() if task == me]
        if mine:
            return mine[-1]
        if not self._held:
            raise RuntimeError(f"{self.kind} {self.name!r}: no permit is held on rank "
                               f"{self._svc.rank}")
        return next(iter(self._held))

    def _give_back(self, ticket: int) -> None:
        del self._held[ticket]
        recalled = self._leases.get(ticket)
        if recalled is False:  # leased and not recalled: keep it cached, idle
            self._idle.append(ticket)
            return
        self._leases.pop(ticket, None)
        if self._mgr is not None:
            self._mgr.release((self._svc.rank, ticket))
        else:
            self._svc.send(self.home, (int(M.RELEASE), self.obj, ticket))

    def release_cached(self) -> int:
        """Give idle leased permits back to the home rank now (e.g. before this
        rank stops using the lock for a while, or exits).

        Returns:
            How many permits went back.
        """
        idle, self._idle = self._idle, []
        for ticket in idle:
            del self._leases[ticket]
            self._svc.send(self.home, (int(M.RELEASE), self.obj, ticket))
        return len(idle)

    def held_by_current_task(self) -> int | None:
        """The ticket of a permit the current task holds, if any.

        Returns:
            The ticket, or None where the current task holds no permit.
        """
        me = self._svc.current_task()
        return next((t for t, task in self._held.items() if task == me), None)

    def statistics(self) -> PermitStatistics:
        """This rank's counters; no messages.

        Returns:
            Name, home rank, capacity, permits held here, waiters and counts.
        """
        return PermitStatistics(self.name, self.home, self.capacity, len(self._held),
                                self._waiting, self._acquired, self._contended,
                                self._cancelled, self._timed_out, self._orphaned,
                                len(self._idle))

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self.release()
