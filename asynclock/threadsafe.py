"""Call a function on the event loop from another thread, on asyncio or trio.

anyio's `from_thread.run_sync` blocks the calling thread until the loop ran
the call; a transport's wait thread must not block on the loop, so this uses
the backends' own fire-and-forget entry points.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import sniffio


def loop_caller() -> Callable[[Callable[[], object]], None]:
    """Return `call(fn)` that schedules `fn()` on the current loop from any thread."""
    library = sniffio.current_async_library()
    if library == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()
        return lambda fn: _quiet(token.run_sync_soon, fn)
    import asyncio

    loop = asyncio.get_running_loop()
    return lambda fn: _quiet(loop.call_soon_threadsafe, fn)


def _quiet(schedule: Callable[[Callable[[], object]], object], fn: Callable[[], object]) -> None:
    """A loop that already closed has nobody left to wake: drop the call."""
    with contextlib.suppress(RuntimeError):
        schedule(fn)
