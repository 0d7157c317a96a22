"""How threads reach the rank's event loop, for both APIs.

The Horovod-style API runs the engine on the coordinator's private loop
thread (`coord.lowlevel.run_sync`); the async API runs it on the user's loop. Either
way a hook thread needs a fire-and-forget `call_soon` (it must never wait
for the loop), and a consumer thread needs a blocking `run` for the rare
collective it starts itself (the one-time plan broadcast).
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio.from_thread
import anyio.lowlevel

from ..._core.base.from_thread import loop_caller
from ..._core.runtime.coordinator import Coordinator


@dataclass(frozen=True)
class LoopAccess:
    call_soon: Callable[[Callable[[], object]], None]
    run: Callable[..., Any]  # run(async_fn, *args) from a thread other than the loop's
    loop_thread: int

    def on_loop_thread(self) -> bool:
        return threading.get_ident() == self.loop_thread


async def _capture() -> tuple[Callable[[Callable[[], object]], None], int]:
    return loop_caller(), threading.get_ident()


def private_loop(coord: Coordinator) -> LoopAccess:
    """For the Horovod API: the coordinator's private loop thread."""
    call_soon, ident = coord.lowlevel.run_sync(_capture)
    return LoopAccess(call_soon, coord.lowlevel.run_sync, ident)


def running_loop() -> LoopAccess:
    """For the async API; call on the loop that runs the coordinator."""
    token = anyio.lowlevel.current_token()

    def run(fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return anyio.from_thread.run(fn, *args, token=token)  # type: ignore[arg-type]

    return LoopAccess(loop_caller(), run, threading.get_ident())
