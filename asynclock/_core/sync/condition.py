"""A condition variable across ranks, bound to a distributed Lock.

`wait()` sends one message that, on the home rank, atomically releases the
lock and queues the task on the condition; `notify(n)` moves n waiters from
the condition's queue to the lock's queue ("wait morphing"), so a woken
waiter's next message is the lock grant itself and no wake-up can be lost
between releasing and waiting.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.lowlevel

from ._permits import PermitInfo
from ._wire import M, object_id
from .lock import Lock, LockStatistics

if TYPE_CHECKING:
    from ._service import SyncService

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ConditionStatistics:
    name: str
    lock: LockStatistics
    tasks_waiting: int
    notified: int
    cancelled: int


class Condition:
    """`async with cond:` then `await cond.wait()` / `cond.notify(n)` on any rank.

    Made by `coord.condition(name)`, on the lock `coord.lock(name)`.

    Args:
        service: this rank's sync service; `coord.condition(name)` passes it, and gives
            every task of the rank the same object for one name.
        name: the condition's name; the same name is the same condition on every rank.
        lock: the lock it releases while waiting.
    """

    def __init__(self, service: SyncService, name: str, lock: Lock) -> None:
        self._svc = service
        self.name = name
        self.lock = lock
        self.cond = object_id("condition", name)
        self._waiting = self._notified = self._cancelled = 0

    # -- the lock ----------------------------------------------------------------
    async def acquire(self, timeout: float | None = None) -> None:
        """Acquire the condition's lock (`Lock.acquire`).

        Args:
            timeout: seconds to wait; None waits for ever.

        Raises:
            CollectiveTimeout: not acquired within `timeout`.
        """
        await self.lock.acquire(timeout)

    async def acquire_nowait(self) -> None:
        """Take the condition's lock if free now (`Lock.acquire_nowait`).

        Raises:
            anyio.WouldBlock: the lock is held.
        """
        await self.lock.acquire_nowait()

    def release(self) -> None:
        """Release the condition's lock (`Lock.release`)."""
        self.lock.release()

    def locked(self) -> bool:
        """Whether a task of this rank holds the condition's lock.

        Returns:
            True while a task of this rank holds it.
        """
        return self.lock.locked()

    async def __aenter__(self) -> None:
        await self.lock.acquire()

    async def __aexit__(self, *exc: Any) -> None:
        self.lock.release()

    def _held(self, what: str) -> int:
        ticket = self.lock.held_by_current_task()
        if ticket is None:
            raise RuntimeError(f"condition {self.name!r}: {what} needs the lock held "
                               f"by the current task")
        return ticket

    # -- waiting -----------------------------------------------------------------
    async def wait(self) -> None:
        """Release the lock, wait for a notify, and hold the lock again.

        Cancelled while waiting: the task still takes the lock back (shielded)
        before the cancellation propagates, as `anyio.Condition` does.

        Raises:
            RuntimeError: the current task does not hold the lock.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        ticket = self._held("wait()")
        lock, svc = self.lock, self._svc
        del lock._held[ticket]
        lock._leases.pop(ticket, None)  # the home rank ends a lease on COND_WAIT
        t = svc.reopen(ticket)
        lock.pending.add(ticket)
        svc.send(lock.home, (int(M.COND_WAIT), lock.obj, ticket, self.cond))
        self._waiting += 1
        try:
            await svc.wait(t, None, lock._stalled)
        except BaseException:
            self._cancelled += 1
            svc.send(lock.home, (int(M.COND_CANCEL), lock.obj, ticket, self.cond))
            with anyio.CancelScope(shield=True):
                await svc.wait(t, None, lock._stalled)
            raise
        finally:
            self._waiting -= 1
            lock.pending.discard(ticket)
            if t.reply is M.GRANT:
                lock._note_lease(t)
                lock._held[ticket] = svc.current_task()

    async def wait_for(self, predicate: Callable[[], T]) -> T:
        """Wait until `predicate()` is true (checked with the lock held).

        Args:
            predicate: called with the lock held, before each wait and after each
                wake-up.

        Returns:
            The predicate's last (true) result.

        Raises:
            RuntimeError: the current task does not hold the lock.
        """
        while not (result := predicate()):
            await self.wait()
        return result

    def notify(self, n: int = 1) -> None:
        """Wake up to n waiters (any rank) in the order they started waiting.

        Args:
            n: how many waiters to wake; -1 wakes all.

        Raises:
            RuntimeError: the current task does not hold the lock.
        """
        self._held("notify()")
        self._notified += 1
        self._svc.send(self.lock.home, (int(M.NOTIFY), self.lock.obj, 0, self.cond, n))

    def notify_all(self) -> None:
        """Wake every waiter, on every rank."""
        self.notify(-1)

    async def info(self) -> PermitInfo:
        """Ask the lock's home rank who holds, who waits, and who waits on this condition.

        Returns:
            The home rank's view, with `condition_waiters` counted.

        Raises:
            RankFailedError: the home rank did not answer within the probe time.
        """
        return await self.lock.info(self.cond)

    def statistics(self) -> ConditionStatistics:
        """This rank's counters; no messages.

        Returns:
            The lock's statistics, tasks waiting here, notifies and cancellations.
        """
        return ConditionStatistics(self.name, self.lock.statistics(), self._waiting,
                                   self._notified, self._cancelled)
