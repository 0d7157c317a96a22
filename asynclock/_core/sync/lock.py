"""A mutex shared by every task on every rank: `async with coord.lock("name"):`.

Owned by one task: acquiring twice from the same task raises (it would
deadlock), and only the holding task may release, as with `anyio.Lock`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._permits import Permits, PermitStatistics

if TYPE_CHECKING:
    from ._service import SyncService


@dataclass(frozen=True, slots=True)
class LockStatistics:
    """This rank's view; `await lock.info()` asks the home rank for the global one."""

    name: str
    home_rank: int
    locked_here: bool
    owner_task: str | None  # name of this rank's holding task
    tasks_waiting: int
    acquired: int
    contended: int  # acquires that waited for an answer: held, or homed on another rank
    cancelled: int
    timed_out: int
    orphaned: int
    cached: int


def _task_name(task: object) -> str | None:
    """asyncio tasks have get_name(), trio tasks a name."""
    if task is None:
        return None
    get_name = getattr(task, "get_name", None)
    return str(get_name() if get_name is not None else getattr(task, "name", task))


class Lock(Permits):
    """Mutual exclusion across ranks and tasks, FIFO-fair, cancellation-safe.

    Made by `coord.lock(name)`; `async with lock:` acquires and releases it.

    Args:
        service: this rank's sync service; `coord.lock(name)` passes it, and gives
            every task of the rank the same object for one name.
        name: the lock's name; the same name is the same lock on every rank.
    """

    kind = "lock"

    def __init__(self, service: SyncService, name: str) -> None:
        super().__init__(service, name, 1)

    async def acquire(self, timeout: float | None = None) -> None:
        """Wait for the lock, in FIFO order across ranks.

        Args:
            timeout: seconds to wait; None waits for ever (stalls are still probed
                and reported); 0 (or less) takes the lock only if it is free now.

        Raises:
            RuntimeError: the current task already holds the lock.
            CollectiveTimeout: not acquired within `timeout`; names the holder and
                the other waiters.
            RankFailedError: the home rank or a holder did not answer a liveness probe.
        """
        self._refuse_reentry()
        await super().acquire(timeout)

    async def acquire_nowait(self) -> None:
        """Take the lock if free now (never queues).

        Raises:
            anyio.WouldBlock: the lock is held.
            RuntimeError: the current task already holds the lock.
        """
        self._refuse_reentry()
        await super().acquire_nowait()

    def _refuse_reentry(self) -> None:
        if self.held_by_current_task() is not None:
            raise RuntimeError(f"lock {self.name!r} is already held by the current task")

    def release(self) -> None:
        """Release the lock.

        Raises:
            RuntimeError: the current task does not hold it.
        """
        ticket = self.held_by_current_task()
        if ticket is None:
            raise RuntimeError(f"lock {self.name!r}: the current task is not holding it")
        self._give_back(ticket)

    def locked(self) -> bool:
        """Whether a task of this rank holds it (`await info()` for every rank).

        Returns:
            True while a task of this rank holds the lock.
        """
        return bool(self._held)

    def statistics(self) -> LockStatistics:  # type: ignore[override]
        """This rank's counters for the lock; no messages.

        Returns:
            Name, home rank, holder task on this rank, waiters and counts.
        """
        s: PermitStatistics = super().statistics()
        owner = next(iter(self._held.values()), None)
        return LockStatistics(s.name, s.home_rank, bool(s.held_here), _task_name(owner),
                              s.tasks_waiting,
                              s.acquired, s.contended, s.cancelled, s.timed_out,
                              s.orphaned, s.cached)
