"""Waits for large data stages, one thread per lane, off the event loop.

Libraries that progress only inside MPI calls (Open MPI's libnbc) need a
rank to sit in MPI for bandwidth; the thread does, with the GIL released, so
the loop keeps running. It enters a blocking collective only once every rank
has reached it, and waits for that asleep (`transports.settle`), so a late
peer costs it no core. Each lane has its own thread: two lanes' bulk stages
reached in opposite orders on two ranks would otherwise block each other.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from ..base.from_thread import name_os_thread
from .operation import Operation


class WaitThread:
    """Waits for large data stages, off the loop (`Deferred` requests run whole here)."""

    def __init__(self, poke: Callable[[Operation], None]) -> None:
        self._poke = poke
        self._put = self._done = 0  # each written by one thread only
        self._queue: queue.SimpleQueue[tuple[Operation, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="asynclock-wait", daemon=True)
        self._thread.start()

    def put(self, op: Operation, request: Any) -> None:
        self._put += 1
        self._queue.put((op, request))

    def _run(self) -> None:
        name_os_thread("asynclock-wait")
        while (item := self._queue.get()) is not None:
            self._wait(*item)
            # Hold no reference while idle: if the last buffer were freed here at
            # interpreter exit, torch's dealloc would re-take the GIL in a daemon
            # thread, which CPython ends by pthread_exit through C++: an abort.
            del item

    def _wait(self, op: Operation, request: Any) -> None:
        try:
            request.Wait()
        except Exception as exc:  # surfaced by the op on the loop
            op.error = exc
        op.thread_done = True
        self._done += 1
        self._poke(op)

    def stop(self) -> None:
        """End the thread; join it when idle, so no wait outlives the engine.

        A wait that never returns (a peer died mid-transfer) is not joined:
        the loop must not block on it, and the job is failing anyway.
        """
        self._queue.put(None)
        if self._put == self._done and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
