"""Waits for large data stages, one thread per lane, off the event loop.

Libraries that progress only inside MPI calls (Open MPI's libnbc) need a
rank to sit in MPI for bandwidth; the thread does, with the GIL released, so
the loop keeps running. It enters a blocking collective only once every rank
has reached it, and waits for that asleep (`transports.settle`), so a late
peer costs it no core. Each lane has its own thread: two lanes' bulk stages
reached in opposite orders on two ranks would otherwise block each other.

A request handed over with a backoff (`Operation.header_asleep`) is tested
instead, with a sleep in the kernel between tests: a test costs the thread a
few microseconds where a turn of the event loop costs tens.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from ..base.backoff import Backoff, poll_until
from ..base.from_thread import name_os_thread
from .operation import Operation


class WaitThread:
    """Waits for large data stages, off the loop (`Deferred` requests run whole here)."""

    def __init__(self, poke: Callable[[Operation], None]) -> None:
        self._poke = poke
        self._put = self._done = 0  # each written by one thread only
        self._stopping = False  # ends a test loop (`put` with a backoff) early
        self._testing = False  # in a test loop now
        self._queue: queue.SimpleQueue[tuple[Operation, Any, Backoff | None] | None] = (
            queue.SimpleQueue())
        self._thread = threading.Thread(target=self._run, name="asynclock-wait", daemon=True)
        self._thread.start()

    def put(self, op: Operation, request: Any, backoff: Backoff | None = None) -> None:
        """Wait for `request` here: in its blocking `Wait`, or, given a backoff, by
        testing it with the backoff's sleeps between tests."""
        self._put += 1
        self._queue.put((op, request, backoff))

    def _run(self) -> None:
        name_os_thread("asynclock-wait")
        while (item := self._queue.get()) is not None:
            self._wait(*item)
            # Hold no reference while idle: if the last buffer were freed here at
            # interpreter exit, torch's dealloc would re-take the GIL in a daemon
            # thread, which CPython ends by pthread_exit through C++: an abort.
            del item

    def _wait(self, op: Operation, request: Any, backoff: Backoff | None) -> None:
        try:
            if backoff is None:
                request.Wait()
            elif not self._tested(request, backoff):
                return  # stopped: the engine is gone, nobody reaps the op
        except Exception as exc:  # surfaced by the op on the loop
            op.error = exc
        op.thread_done = True
        self._done += 1
        self._poke(op)

    def _tested(self, request: Any, backoff: Backoff) -> bool:
        """Test `request` until it completes (True) or the thread is stopped (False)."""
        self._testing = True
        try:
            backoff.reset()
            poll_until(lambda: self._stopping or bool(request.Test()), backoff)
            return not self._stopping
        finally:
            self._testing = False

    def stop(self) -> None:
        """End the thread; join it when idle, so no wait outlives the engine.

        A wait that never returns (a peer died mid-transfer) is not joined:
        the loop must not block on it, and the job is failing anyway. A test
        loop ends at its next test, so it is joined: MPI may be finalized next.
        """
        self._stopping = True
        self._queue.put(None)
        if (self._put == self._done or self._testing) and \
                threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)
