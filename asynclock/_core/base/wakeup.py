"""A cheap "sleep until woken or until a timeout" for the engine's own tasks.

The progress engine and the sync pump spend their idle time asleep and are
woken either by a timer or by a peer thread's `call_soon`. With anyio the
natural spelling is `Event` inside `move_on_after`, but on asyncio every
timed-out wait then goes through a cancel scope: a cancellation delivered
as a `CancelledError` thrown through the task, caught again by the scope.
A timed wait costs markedly more CPU that way than with a bare future and
`call_later` (`bench/wakeups.py`; figures on the benchmarks page), and an
idle coordinator's pump wakes up to ~50 times a second, on the same cores
that train. On trio (whose cancellation is cheap and the only tool) the
anyio spelling stays.
"""

from __future__ import annotations

import asyncio
from typing import Any

import anyio

__all__ = ["Wakeup"]


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _on_asyncio() -> bool:
    """Whether the running task is asyncio's (under trio there is no running loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Wakeup:
    """One sleeper at a time; `wake()` (on the loop's thread) ends its sleep early.

    A wake with nobody asleep is dropped, as with the `Event` it replaces:
    callers re-check their state after every sleep.
    """

    def __init__(self) -> None:
        self._asyncio: bool | None = None
        self._future: asyncio.Future[None] | None = None
        self._event: anyio.Event | None = None

    @property
    def sleeping(self) -> bool:
        return self._future is not None or self._event is not None

    def wake(self) -> None:
        """End the current sleep, if any (loop thread only)."""
        if self._future is not None:
            _settle(self._future)
        elif self._event is not None:
            self._event.set()

    async def sleep(self, timeout: float | None) -> None:
        """Until `wake()` or `timeout` seconds (None: no timeout)."""
        if self._asyncio is None:
            self._asyncio = _on_asyncio()
        if self._asyncio:
            await self._sleep_asyncio(timeout)
        else:
            await self._sleep_anyio(timeout)

    async def _sleep_asyncio(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._future = fut = loop.create_future()
        timer: Any = None if timeout is None else loop.call_later(max(timeout, 0.0), _settle, fut)
        try:
            await fut
        finally:  # also on cancellation: no timer or future outlives the sleep
            self._future = None
            if timer is not None:
                timer.cancel()

    async def _sleep_anyio(self, timeout: float | None) -> None:
        self._event = event = anyio.Event()
        try:
            with anyio.move_on_after(timeout):
                await event.wait()
        finally:
            self._event = None
