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
    contended: int
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
    """Mutual exclusion across ranks and tasks, FIFO-fair, cancellation-safe."""

    kind = "lock"

    def __init__(self, service: SyncService, name: str) -> None:
        super().__init__(service, name, 1)

    async def acquire(self, timeout: float | None = None) -> None:
        """Wait for the lock; `timeout` raises CollectiveTimeout naming the holder."""
        self._refuse_reentry()
        await super().acquire(timeout)

    async def acquire_nowait(self) -> None:
        """Take the lock if free now, else raise `anyio.WouldBlock` (never queues)."""
        self._refuse_reentry()
        await super().acquire_nowait()

    def _refuse_reentry(self) -> None:
        if self.held_by_current_task() is not None:
            raise RuntimeError(f"lock {self.name!r} is already held by the current task")

    def release(self) -> None:
        """Release; only the holding task may (RuntimeError otherwise)."""
        ticket = self.held_by_current_task()
        if ticket is None:
            raise RuntimeError(f"lock {self.name!r}: the current task is not holding it")
        self._give_back(ticket)

    def locked(self) -> bool:
        """Whether a task of this rank holds it (`await info()` for every rank)."""
        return bool(self._held)

    def statistics(self) -> LockStatistics:  # type: ignore[override]
        s: PermitStatistics = super().statistics()
        owner = next(iter(self._held.values()), None)
        return LockStatistics(s.name, s.home_rank, bool(s.held_here), _task_name(owner),
                              s.tasks_waiting,
                              s.acquired, s.contended, s.cancelled, s.timed_out,
                              s.orphaned, s.cached)
