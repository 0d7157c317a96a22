"""A counting semaphore across ranks: at most `n` holders anywhere at once.

Every rank must create it with the same `n`; the home rank checks, and a
rank that disagrees gets a MismatchError on its first acquire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._permits import Permits, PermitStatistics

if TYPE_CHECKING:
    from ._service import SyncService

SemaphoreStatistics = PermitStatistics


class Semaphore(Permits):
    """`n` permits shared by every task on every rank, granted in FIFO order.

    Permits are not owned by a task: `release()` gives back the current
    task's permit if it holds one, else the oldest permit held on this rank.
    Made by `coord.semaphore(name, n)`; `async with sem:` acquires and releases.

    Args:
        service: this rank's sync service; `coord.semaphore(name)` passes it, and gives
            every task of the rank the same object for one name.
        name: the semaphore's name; the same name is the same semaphore on every rank.
        n: how many permits; the same on every rank (a rank that disagrees gets a
            MismatchError on its first acquire).

    Raises:
        ValueError: `n` is below 1.
    """

    kind = "semaphore"

    def __init__(self, service: SyncService, name: str, n: int) -> None:
        super().__init__(service, name, n)

    @property
    def initial_value(self) -> int:
        """The number of permits, `n`."""
        return self.capacity
