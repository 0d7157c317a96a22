"""World size 1 without MPI: every collective completes when it is started."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from ..base.ops import ReduceOp
from .base import DONE, Array, Request


class LocalChannel:
    """Copies where MPI would communicate; reductions over one rank are identity."""

    rank = 0
    size = 1
    loop_band = (0, 0)

    def __init__(self, name: str) -> None:
        self.name = name
        self._inbox: deque[Array] = deque()

    def iallgather_slots(self, send: Array, recv: Array) -> Request:
        recv[: send.size] = send
        return DONE

    def iallreduce(self, send: Array | None, recv: Array, op: ReduceOp) -> Request:
        if send is not None:
            recv[...] = send
        return DONE

    def ibcast(self, buf: Array, root: int) -> Request:
        return DONE

    def iallgatherv(self, send: Array, recv: Array, counts: list[int]) -> Request:
        recv[: send.size] = send
        return DONE

    def ireduce_scatter(self, send: Array, recv: Array, counts: list[int],
                        op: ReduceOp) -> Request:
        recv[...] = send[: recv.size]
        return DONE

    def ialltoall(self, send: Array, recv: Array) -> Request:
        recv[...] = send
        return DONE

    def ialltoallv(self, send: Array, scounts: list[int], recv: Array,
                   rcounts: list[int]) -> Request:
        np.copyto(recv[: send.size], send)
        return DONE

    def ibarrier(self) -> Request:
        return DONE

    def bulk_view(self) -> LocalChannel:
        return self

    def p2p_isend(self, buf: Array, dest: int) -> Request:
        """A message to ourselves (the only rank) waits in a queue."""
        self._inbox.append(buf.copy())
        return DONE

    def p2p_try_recv(self, buf: Array) -> tuple[int, int] | None:
        if not self._inbox:
            return None
        msg = self._inbox.popleft()
        buf.view(np.uint8)[: msg.nbytes] = msg.view(np.uint8)
        return 0, msg.nbytes

    def p2p_iallreduce_max(self, send: Array, recv: Array) -> Request:
        recv[...] = send
        return DONE

    def close(self) -> None:
        return None


class LocalBackend:
    """Chosen by `backend="auto"` when mpi4py cannot be imported."""

    name = "local"
    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1

    def channel(self, name: str) -> LocalChannel:
        return LocalChannel(name)

    def subchannels(self, names: tuple[str, ...], ranks: tuple[int, ...]
                    ) -> list[LocalChannel]:
        return [LocalChannel(name) for name in names]  # the only possible set is [0]

    def close_channel(self, channel: Any) -> None:
        return None

    def describe(self) -> str:
        return "local (world size 1, no MPI)"

    def shutdown(self, lost: bool = False) -> None:
        return None
