"""Call a function on the event loop from another thread, on asyncio or trio.

anyio's `from_thread.run_sync` blocks the calling thread until the loop ran
the call; a transport's wait thread must not block on the loop, so this uses
the backends' own fire-and-forget entry points.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
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


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` (15 bytes at most) in the OS as well.

    Python's thread names stay inside Python; `top -H`, `perf`, py-spy's
    native view and `bench/train.py --threads` read the kernel's, which is
    "python" for every thread unless set. Linux only; elsewhere a no-op.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


_PR_SET_NAME = 15
