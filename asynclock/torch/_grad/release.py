"""What a reducer holds beyond Python's reach, released when its owner is dropped.

A reducer may hold a gradient channel of its own (five communicators, a wait
thread), the shared-memory pipeline's thread, and shared windows with their
node communicator. None of these go away with the garbage collector: threads
are roots, and MPI objects live until freed. So each reducer keeps them in a
`Held`, which references none of the user's objects, and the owner (the
Horovod optimizer, the train step) is watched with `weakref.finalize`: once
it is dropped, `Held.release` ends the threads and frees the rest.

Freeing a window is collective over its node and waits for every peer's
free, so the release runs on a short-lived thread of its own and never on
the loop, the training thread or whichever thread the collector ran on;
each reducer's windows have their own communicator, so ranks that drop
optimizers in different orders do not block one another. The lane stops
being served on the loop, where the engine's state lives; its channel is
freed on the release thread (its node window's free is collective too).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Protocol

from ..._core.engine.operation import Lane
from ..._core.runtime.coordinator import Coordinator
from .windows import free_shared

log = logging.getLogger("asynclock.torch")
_RUNNING: set[threading.Thread] = set()  # releases under way in this process


def wait_released(timeout: float) -> bool:
    """Wait until every release under way has ended (tests); False on timeout."""
    deadline = time.monotonic() + timeout
    for thread in list(_RUNNING):
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in _RUNNING)


class Closable(Protocol):
    def close(self) -> None: ...


class Held:
    """A reducer's threads, windows and channel, in the order they were made."""

    def __init__(self, coord: Coordinator, lane: Lane, owns_lane: bool) -> None:
        self.coord = coord
        self.lane = lane if owns_lane else None
        self.transports: list[Closable] = []  # their `close()` ends pipeline threads
        self.windows: list[Any] = []  # freed last made, first freed
        self.comms: list[Any] = []  # the windows' node communicators, freed after them
        self.released = False

    def watch(self, owner: object) -> None:
        """Release once `owner` is garbage (not at interpreter exit: MPI may be down)."""
        finalizer = weakref.finalize(owner, self.release)
        finalizer.atexit = False

    def release(self) -> None:
        """End the threads and free what was made (idempotent; any thread)."""
        if self.released:
            return
        self.released = True
        thread = threading.Thread(target=self._counted, name="asynclock-release", daemon=True)
        _RUNNING.add(thread)
        thread.start()

    def _counted(self) -> None:
        try:
            self._release()
        finally:
            _RUNNING.discard(threading.current_thread())

    def _release(self) -> None:
        for transport in self.transports:
            transport.close()
        self.transports.clear()
        coord = self.coord
        if coord._closed:  # the backend freed every channel; MPI may be finalized
            return
        try:
            while self.windows:
                free_shared(self.windows.pop())
            while self.comms:
                self.comms.pop().Free()
        except Exception as exc:  # MPI refused: the job goes on, the memory stays
            log.warning("asynclock: freeing a dropped optimizer's shared window failed: %s", exc)
        lane = self.lane
        if lane is None:
            return
        self.lane = None
        retired = threading.Event()
        ok: list[bool] = []

        def on_loop() -> None:
            ok.append(_stop_serving(coord, lane))
            retired.set()

        # the engine's state changes on the loop; the channel's frees (its node window's
        # is collective over the node) stay here, off the loop
        if coord.engine.call_soon_threadsafe(on_loop) and retired.wait(_LOOP_WAIT_S) \
                and ok[0] and not coord._closed:
            coord.backend.close_channel(lane.transport)


_LOOP_WAIT_S = 60.0  # the loop answers within a tick unless the job is stopping


def _stop_serving(coord: Coordinator, lane: Lane) -> bool:
    """On the loop: stop serving a dropped optimizer's gradient lane (True: its channel
    may be freed now)."""
    if coord._closed or lane not in coord.engine.lanes:
        return False
    if lane.queue:  # something of it is still in flight: it goes with the coordinator
        log.warning("asynclock: a dropped optimizer's gradient channel still has %d "
                    "operations in flight; it is freed at shutdown", len(lane.queue))
        return False
    if lane in coord.more_grad_lanes:
        coord.more_grad_lanes.remove(lane)
    coord.engine.retire_lane(lane)
    return True
