"""A set-once event across ranks: `set()` on any rank, `await wait()` on all.

Like `anyio.Event` it cannot be cleared, which is what makes a rank's local
knowledge safe to cache: once this rank has seen the event set, later waits
return without messages. The home rank tells every rank when it is set, so
`is_set()` turns true everywhere shortly after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel

from ..base.errors import CollectiveTimeout, RankFailedError
from ._wire import M, home_rank, object_id

if TYPE_CHECKING:
    from ._service import SyncService, Ticket

log = logging.getLogger("asynclock.sync")


@dataclass(frozen=True, slots=True)
class EventStatistics:
    name: str
    home_rank: int
    is_set: bool
    tasks_waiting: int
    cancelled: int


class Event:
    """Set once, by any task on any rank; awaited by any task on any rank.

    Made by `coord.event(name)`.

    Args:
        service: this rank's sync service; `coord.event(name)` passes it, and gives
            every task of the rank the same object for one name.
        name: the event's name; the same name is the same event on every rank.
    """

    def __init__(self, service: SyncService, name: str) -> None:
        self._svc = service
        self.name = name
        self.obj = object_id("event", name)
        self.home = home_rank(name, service.size)
        self._set_here = False
        self._waiting = self._cancelled = 0

    def set(self) -> None:
        """Set the event for every rank (idempotent; returns at once)."""
        if not self._set_here:
            self._set_here = True
            self._svc.send(self.home, (int(M.EVENT_SET), self.obj, 0))

    def is_set(self) -> bool:
        """Whether this rank set it or learned that another rank did; no messages.

        Returns:
            True once set, as far as this rank knows.
        """
        return self._set_here or self.obj in self._svc.known_events

    async def wait(self, timeout: float | None = None) -> None:
        """Wait until some rank sets it.

        Args:
            timeout: seconds to wait; None waits for ever (stalls are still probed).

        Raises:
            CollectiveTimeout: not set within `timeout`.
            RankFailedError: the event's home rank did not answer a liveness probe.
        """
        if self.is_set():
            await anyio.lowlevel.checkpoint()
            return
        t = self._svc.ticket()
        self._svc.send(self.home, (int(M.EVENT_WAIT), self.obj, t.id))
        if t.reply is None:
            await self._await(t, timeout)
        self._set_here = True

    async def _await(self, t: Ticket, timeout: float | None) -> None:
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
            self._withdraw(t)
            raise CollectiveTimeout(f"event {self.name!r}: not set within {timeout:g} s "
                                    f"(waiting on rank {self._svc.rank}, home rank {self.home})")

    def _withdraw(self, t: Ticket) -> None:
        if t.reply is None:
            t.abandoned = True
            self._svc.send(self.home, (int(M.EVENT_CANCEL), self.obj, t.id))

    async def _stalled(self) -> None:
        if not await self._svc.alive(self.home):
            raise RankFailedError(
                f"event {self.name!r}: home rank {self.home} did not answer a liveness probe "
                f"within {self._svc.policy.probe_s:g} s (dead, or its event loop is blocked)")
        log.warning("event %r: rank %d still waiting after %g s", self.name, self._svc.rank,
                    self._svc.policy.stall_s)

    def statistics(self) -> EventStatistics:
        """This rank's counters; no messages.

        Returns:
            Name, home rank, whether set, tasks waiting and cancellations.
        """
        return EventStatistics(self.name, self.home, self.is_set(), self._waiting,
                               self._cancelled)
