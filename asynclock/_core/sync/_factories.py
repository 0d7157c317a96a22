"""The coordinator's factories for cross-rank primitives (mixed into Coordinator).

Each name maps to one object per rank, shared by that rank's tasks; the
message pump (`coord.lowlevel.sync`) is created on first use and runs with the
progress engine for the whole of `coord.running()`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._service import SyncService
from .barrier import ConsistencyPoint
from .condition import Condition
from .event import Event
from .lock import Lock
from .semaphore import Semaphore
from .sequential import Sequential

if TYPE_CHECKING:
    from ._service import SyncHost


class SyncPrimitives:
    """Mixin for Coordinator: `coord.lock(name)` and friends."""

    _sync: SyncService | None = None

    def _host(self) -> SyncHost:
        raise NotImplementedError

    @property
    def _service(self) -> SyncService:
        """The sync lane's message pump, made on first use."""
        if self._sync is None:
            self._sync = SyncService(self._host())
        return self._sync

    def _one(self, kind: str, name: str, make: Any) -> Any:
        return self._service.primitive(kind, name, make)

    def lock(self, name: str) -> Lock:
        """The cross-rank lock `name`: FIFO, cancellation-safe, `acquire(timeout=)`.

        Args:
            name: the primitive's name; the same name is the same object on every rank (and
                for every task of this rank).

        Returns:
            The rank's `Lock` of that name, made on first use.
        """
        lock: Lock = self._one("lock", name, lambda: Lock(self._service, name))
        return lock

    def semaphore(self, name: str, n: int) -> Semaphore:
        """A cross-rank semaphore with `n` permits.

        Args:
            name: the primitive's name; the same name is the same object on every rank (and
                for every task of this rank).
            n: how many permits; the same on every rank (the home rank checks).

        Returns:
            The rank's `Semaphore` of that name, made on first use.

        Raises:
            ValueError: this rank made the semaphore with another `n`, or `n` is below 1.
        """
        sem: Semaphore = self._one("semaphore", name, lambda: Semaphore(self._service, name, n))
        if sem.capacity != n:
            raise ValueError(f"semaphore {name!r} already exists with n={sem.capacity}")
        return sem

    def condition(self, name: str) -> Condition:
        """A cross-rank condition variable on `coord.lock(name)`.

        Args:
            name: the primitive's name; the same name is the same object on every rank (and
                for every task of this rank).

        Returns:
            The rank's `Condition` of that name, made on first use.
        """
        cond: Condition = self._one("condition", name,
                                    lambda: Condition(self._service, name, self.lock(name)))
        return cond

    def event(self, name: str) -> Event:
        """A set-once event: set on any rank, awaited on all.

        Args:
            name: the primitive's name; the same name is the same object on every rank (and
                for every task of this rank).

        Returns:
            The rank's `Event` of that name, made on first use.
        """
        event: Event = self._one("event", name, lambda: Event(self._service, name))
        return event

    def sequential(self, name: str) -> Sequential:
        """`async with coord.sequential(name):` ranks take turns in rank order.

        Args:
            name: the primitive's name; the same name is the same object on every rank (and
                for every task of this rank).

        Returns:
            The rank's `Sequential` of that name, made on first use.
        """
        seq: Sequential = self._one("sequential", name, lambda: Sequential(self._service, name))
        return seq

    def consistency_point(self, name: str) -> ConsistencyPoint:
        """`await coord.consistency_point(name)`: a named, agreement-checked barrier.

        Args:
            name: the primitive's name; the same name is the same object on every rank (and
                for every task of this rank).

        Returns:
            The rank's `ConsistencyPoint` of that name, made on first use.
        """
        point: ConsistencyPoint = self._one("point", name,
                                            lambda: ConsistencyPoint(self._host(), name))
        return point

