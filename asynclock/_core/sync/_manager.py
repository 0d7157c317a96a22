"""Home-rank state of each primitive: who holds it, who waits, in arrival order.

A manager is plain synchronous state driven by messages; it never awaits,
so every transition is atomic on the home rank's loop. Requesters are keyed
by `(rank, ticket)`. FIFO: a request is granted only when nothing queued
before it is still waiting, so a stream of newcomers cannot starve an
earlier waiter, whichever rank either is on.

Leases (lock caching): a permit granted to another rank while nobody else
waits comes with a lease. The holder may then keep it after its task
releases and hand it to its next local task without any message, which
makes an uncontended lock homed elsewhere as cheap as a local one. The
home still counts the leaseholder as a holder; as soon as anyone else
queues it sends RECALL, and the leaseholder answers RELEASE (idle) or BUSY
(a task holds it: RELEASE follows when it lets go). A `nowait` request
that finds only leases waits for that one answer round: granted if the
lease was idle, denied if it was busy. Under contention leases would only
add a RECALL per hand-off, so after a recall no lease is granted until the
lock is released with nobody waiting.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ._wire import HEAD, ErrorCode, M, info_words

log = logging.getLogger("asynclock.sync")

Msg = Sequence[int]
Key = tuple[int, int]  # (rank, ticket)
Send = Callable[[int, Msg], None]


class PermitManager:
    """Lock, Semaphore and Condition state: `capacity` permits, one FIFO queue,
    and per condition a FIFO of tasks that released the lock to wait."""

    def __init__(self, obj: int, send: Send, rank: int, lease: bool) -> None:
        self.obj = obj
        self.send = send
        self.rank = rank
        self.lease = lease
        self.capacity = 0  # 0: not known yet (first contact was not an ACQUIRE)
        self.holders: dict[Key, bool] = {}  # -> leased
        self.recalled: set[Key] = set()
        self.nowait: set[Key] = set()
        self.contended = False  # a lease was recalled since the queue was last empty
        self.queue: OrderedDict[Key, None] = OrderedDict()
        self.conds: dict[int, OrderedDict[Key, None]] = {}
        self.grants = 0

    def handle(self, source: int, kind: M, w: Msg) -> None:
        key = (source, w[2])
        if kind is M.ACQUIRE:
            self._acquire(key, w[HEAD], w[HEAD + 1])
        elif kind is M.RELEASE:
            self._release(key)
        elif kind is M.CANCEL:
            self._cancel(key)
        elif kind is M.COND_WAIT:
            self._cond_wait(key, w[HEAD])
        elif kind is M.COND_CANCEL:
            self._cond_cancel(key, w[HEAD])
        elif kind is M.NOTIFY:
            self._notify(w[HEAD], w[HEAD + 1])
        elif kind is M.BUSY:
            self._deny_nowait()
        else:
            self._reply(M.INFO_REPLY, key, w[HEAD])

    # -- the home rank's own tasks (no messages) --------------------------------------
    def declare(self, capacity: int) -> None:
        """The home rank made its own object: its capacity is the one every rank must
        ask for, whichever rank acquires first (unless one already did)."""
        if not self.capacity:
            self.capacity = capacity

    def take_now(self, key: Key, capacity: int) -> bool:
        """Grant at once if a permit is free and nobody queues (FIFO holds)."""
        if self.queue or (self.capacity and capacity != self.capacity):
            return False
        self.capacity = capacity
        if len(self.holders) >= capacity:
            return False
        self.holders[key] = False
        self.grants += 1
        return True

    def release(self, key: Key) -> None:
        self._release(key)

    # -- transitions ---------------------------------------------------------------
    def _acquire(self, key: Key, capacity: int, nowait: int) -> None:
        if self.capacity and capacity != self.capacity:
            self.send(key[0], (int(M.ERROR), self.obj, key[1],
                               int(ErrorCode.CAPACITY_MISMATCH), self.capacity))
            return
        self.capacity = capacity
        if not self.queue and len(self.holders) < self.capacity:
            self._grant(key)
        elif nowait and (self.queue or not self._unrecalled()):
            self._reply(M.DENY, key)
        else:
            self.queue[key] = None
            if nowait:
                self.nowait.add(key)
            self._recall()

    def _unrecalled(self) -> bool:
        return any(leased and k not in self.recalled for k, leased in self.holders.items())

    def _recall(self) -> None:
        """Someone waits: ask every leaseholder for its permit back (once)."""
        for key, leased in self.holders.items():
            if leased and key not in self.recalled:
                self.recalled.add(key)
                self.contended = True
                self.send(key[0], (int(M.RECALL), self.obj, key[1]))

    def _deny_nowait(self) -> None:
        """The recall round is answered: nowait requests still queued are refused."""
        for key in self.nowait:
            if self.queue.pop(key, 0) is None:
                self._reply(M.DENY, key)
        self.nowait.clear()

    def _release(self, key: Key) -> None:
        if key not in self.holders:
            log.warning("sync: release from rank %d ticket %d, which holds nothing", *key)
            return
        del self.holders[key]
        if not self.queue:
            self.contended = False
        self._grant_next()
        if key in self.recalled:
            self.recalled.discard(key)
            self._deny_nowait()

    def _cancel(self, key: Key) -> None:
        """Withdraw a waiter; one already granted will RELEASE when the grant lands."""
        if self.queue.pop(key, 0) is None:
            self._reply(M.WITHDRAWN, key)

    def _cond_wait(self, key: Key, cond: int) -> None:
        """Atomically release the lock and join the condition's queue."""
        self.holders.pop(key, None)
        self.recalled.discard(key)
        self.conds.setdefault(cond, OrderedDict())[key] = None
        self._grant_next()

    def _cond_cancel(self, key: Key, cond: int) -> None:
        """A cancelled condition waiter still needs the lock back: requeue it."""
        waiting = self.conds.get(cond)
        if waiting is not None and waiting.pop(key, 0) is None:
            self.queue[key] = None
            self._grant_next()
            self._recall_if_waiting()

    def _notify(self, cond: int, n: int) -> None:
        """Move up to n condition waiters (all if n < 0) to the lock's queue."""
        waiting = self.conds.get(cond)
        while waiting and n != 0:
            key, _ = waiting.popitem(last=False)
            self.queue[key] = None
            n -= 1
        self._grant_next()
        self._recall_if_waiting()

    def _recall_if_waiting(self) -> None:
        if self.queue:
            self._recall()

    # -- granting ----------------------------------------------------------------
    def _grant_next(self) -> None:
        while self.queue and len(self.holders) < self.capacity:
            key, _ = self.queue.popitem(last=False)
            self.nowait.discard(key)
            self._grant(key)

    def _grant(self, key: Key) -> None:
        """Another rank that gets a permit nobody else waits for gets a lease."""
        leased = self.lease and key[0] != self.rank and not (self.queue or self.contended)
        self.holders[key] = leased
        self.grants += 1
        self.send(key[0], (int(M.GRANT), self.obj, key[1], int(leased)))

    def _reply(self, kind: M, key: Key, cond: int = 0) -> None:
        """DENY / WITHDRAWN / INFO_REPLY carry the state for error messages."""
        words = info_words(self.capacity, [r for r, _ in self.holders],
                           [r for r, _ in self.queue], len(self.conds.get(cond, ())),
                           [r for (r, _), leased in self.holders.items() if leased])
        self.send(key[0], (int(kind), self.obj, key[1], *words))


class EventManager:
    """A set-once flag and the tasks waiting for it, on the event's home rank."""

    def __init__(self, obj: int, send: Send, broadcast: Callable[[Msg], None]) -> None:
        self.obj = obj
        self.send = send
        self.broadcast = broadcast
        self.is_set = False
        self.waiters: dict[Key, None] = {}

    def handle(self, source: int, kind: M, w: Msg) -> None:
        key = (source, w[2])
        if kind is M.EVENT_WAIT:
            if self.is_set:
                self._fire(key)
            else:
                self.waiters[key] = None
        elif kind is M.EVENT_SET:
            self._set()
        elif self.waiters.pop(key, 0) is None:  # EVENT_CANCEL of a queued waiter
            self.send(key[0], (int(M.WITHDRAWN), self.obj, key[1]))

    def _set(self) -> None:
        if self.is_set:
            return
        self.is_set = True
        for key in self.waiters:
            self._fire(key)
        self.waiters.clear()
        self.broadcast((int(M.EVENT_KNOWN), self.obj, 0))

    def _fire(self, key: Key) -> None:
        self.send(key[0], (int(M.FIRED), self.obj, key[1]))
