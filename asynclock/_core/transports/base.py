"""The small protocol every transport implements.

A backend hands out channels; a channel is a private pair of communicators
(one for headers, one for data) so that each subsystem (user collectives,
gradients, sync primitives) orders its own traffic and can never match
another's or the user's own MPI calls. Every method starts a non-blocking
operation and returns a request with mpi4py's `Test`/`Wait` names, so MPI
requests need no wrapper on the hot path.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..base.ops import ReduceOp

Array = np.ndarray[Any, Any]


class Request(Protocol):
    """A started operation; `Wait` is only ever called from a worker thread."""

    def Test(self) -> bool: ...  # noqa: N802 - mpi4py's spelling

    def Wait(self) -> Any: ...  # noqa: N802


class DataTransport(Protocol):
    """The data-stage operations: what a collective's stages call."""

    def iallreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> Request: ...

    def ibcast(self, buf: Array, root: int) -> Request: ...

    def iallgatherv(self, send: Array, recv: Array, counts: list[int]) -> Request: ...

    def ireduce_scatter(self, send: Array, recv: Array, counts: list[int],
                        op: ReduceOp) -> Request: ...

    def ialltoall(self, send: Array, recv: Array) -> Request: ...

    def ialltoallv(self, send: Array, scounts: list[int], recv: Array,
                   rcounts: list[int]) -> Request: ...


class Channel(DataTransport, Protocol):
    """Non-blocking collectives on one private communicator set (header, data,
    point-to-point, bulk) so each subsystem orders its own traffic."""

    rank: int
    size: int
    name: str
    # Allreduces of [lo, hi) bytes that a caller awaits stay on the loop, polled, even
    # from the wait thread's size on (`ASYNCLOCK_THREAD_MIN_BYTES`); (0, 0): none.
    loop_band: tuple[int, int]

    def iallgather_slots(self, send: Array, recv: Array) -> Request: ...

    def ibarrier(self) -> Request: ...

    # -- point-to-point, on a third private communicator (sync primitives) ----
    def p2p_isend(self, buf: Array, dest: int) -> Request:
        """Send int64 words to `dest`; the caller keeps `buf` alive until done."""
        ...

    def p2p_try_recv(self, buf: Array) -> tuple[int, int] | None:
        """Receive one waiting message into `buf`: `(source, nbytes)`, or None."""
        ...

    def p2p_iallreduce_max(self, send: Array, recv: Array) -> Request:
        """Element-wise max of int64 words over ranks (agreement, fast barriers)."""
        ...

    def bulk_view(self) -> DataTransport | None:
        """The same methods, returning `Deferred` blocking calls on a separate
        communicator, for large transfers run in the engine's wait thread
        (None: the transport has no bulk path)."""
        ...

    def close(self) -> None: ...


class Backend(Protocol):
    """A transport: who we are, and channels to talk on."""

    name: str
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int

    def channel(self, name: str) -> Channel: ...

    def close_channel(self, channel: Any) -> None: ...

    def describe(self) -> str: ...

    def shutdown(self, lost: bool = False) -> None:
        """Free what the backend holds; `lost`: the world is being abandoned and a
        peer may never answer again, so nothing waits on one."""
        ...


def close_channel_of(channels: list[Any], channel: Any) -> None:
    """A backend's `close_channel`: free `channel` once, if the backend made it."""
    if channel in channels:
        channels.remove(channel)
        channel.close()


class Deferred:
    """A call that runs to its end in the engine's wait thread, in FIFO order.

    Large data stages run there, off the loop, on a communicator of their own
    (one thread in FIFO order keeps the order identical on every rank): MPI's
    blocking collectives, faster for bulk data than their non-blocking twins
    (Open MPI 4's libnbc most), each once every rank has reached it (waited for
    asleep, `settle`), and the node window and gloo paths.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def Test(self) -> bool:  # noqa: N802 - never polled: the wait thread runs it
        return False

    def Wait(self) -> None:  # noqa: N802
        self.fn()


class Done:
    """A request that completed when it was made (local transports)."""

    __slots__ = ()

    def Test(self) -> bool:  # noqa: N802
        return True

    def Wait(self) -> None:  # noqa: N802
        return None


DONE = Done()
