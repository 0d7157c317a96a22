"""Small pieces of the sync service: its policy, tickets, and task identity."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import anyio
import sniffio

from ..base import settings
from ._wire import M

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
