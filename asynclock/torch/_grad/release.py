"""What a reducer holds beyond Python's reach, released when its owner is dropped.

A reducer may hold a gradient channel of its own (five communicators, a wait
thread), the shared-memory pipeline's thread, and shared windows with their
node communicator. None of these go away with the garbage collector: threads
are roots, and MPI objects live until freed. So each reducer keeps them in a
`Held`, which references none of the user's objects, and the owner (the
Horovod optimizer, the train step) is watched with `weakref.finalize`: once
it is dropped, `Held.release` ends the threads and frees the rest.

The release runs on a short-lived thread of its own, never on the loop,
the training thread or whichever thread the collector ran on: it ends the
pipeline threads and has the loop stop serving the lane (which ends the
lane's wait thread). It frees no MPI window and no channel: freeing a
window is collective over the node and waits for every peer's free, and a
peer's collector may never drop its copy (a rank keeps its optimizer, or
exits first), which would leave this rank inside MPI_Win_free and its
MPI_Finalize behind it. The windows and communicators stay until MPI ends.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Protocol

from ..._core.engine.operation import Lane
from ..._core.runtime.coordinator import Coordinator

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
    """A reducer's pipeline threads and its own gradient lane."""

    def __init__(self, coord: Coordinator, lane: Lane, owns_lane: bool) -> None:
        self.coord = coord
        self.lane = lane if owns_lane else None
        self.transports: list[Closable] = []  # their `close()` ends pipeline threads
        self.released = False

    def watch(self, owner: object) -> None:
        """Release once `owner` is garbage (not at interpreter exit: MPI may be down)."""
        finalizer = weakref.finalize(owner, self.release)
        finalizer.atexit = False

    def release(self) -> None:
        """End the threads and stop serving the lane (idempotent; any thread)."""
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
        lane = self.lane
        if lane is None:
            return
        self.lane = None
        retired = threading.Event()

        def on_loop() -> None:
            _stop_serving(coord, lane)
            retired.set()

        if coord.lowlevel.engine.call_soon_threadsafe(on_loop):
            retired.wait(_LOOP_WAIT_S)


_LOOP_WAIT_S = 60.0  # the loop answers within a tick unless the job is stopping


def _stop_serving(coord: Coordinator, lane: Lane) -> None:
    """On the loop: stop serving a dropped optimizer's gradient lane, at once or once
    what is in flight on it (a join's round) completes; its channel is freed with the
    others at shutdown. It stays in `more_grad_lanes`: a peer's collector may not have
    dropped its copy yet, and a join serves every lane on every rank alike."""
    if not coord._closed:
        coord.lowlevel.engine.retire_when_idle(lane)
