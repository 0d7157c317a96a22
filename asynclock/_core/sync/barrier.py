"""Named consistency points: every rank waits until all ranks reached the same one.

`await coord.consistency_point("shards-written")` marks a data dependency
between ranks (everyone finished writing before anyone reads). It is a
barrier on the sync lane's point-to-point communicator, so it never queues
behind user or gradient collectives, and its agreement check is free: the
barrier itself is a MAX-allreduce of `[h, -h, g, -g]` (h: the point's name
hash, g: how many times this rank passed it), so every rank learns in the
same round trip whether all ranks are at the same point. On a mismatch, a
second round gathers every rank's name and round so each rank raises the
same MismatchError naming them.

It is issued at once and tested in a bounded spin (the engine's `spin_s`),
then handed to the engine's poller: awaiting never blocks the loop. Like
every collective, ranks must reach consistency points in the same order.
The header-checked `coord.barrier()` stays the user lane's barrier.
"""

from __future__ import annotations

import logging
import time
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from ..base.errors import CollectiveTimeout, MismatchError, RankFailedError

if TYPE_CHECKING:
    from collections.abc import Generator

    from ..transports.base import Request
    from ._service import SyncHost

log = logging.getLogger("asynclock.sync")

_LOW = np.iinfo(np.int64).min
_NAME_BYTES = 24


@dataclass(frozen=True, slots=True)
class ConsistencyStatistics:
    name: str
    passed: int
    spun: int


class ConsistencyPoint:
    """A reusable named barrier; `await point` or `await point.wait(timeout)`.

    Made by `coord.consistency_point(name)`.

    Args:
        coord: the coordinator; the point runs on its sync lane.
        name: the point's name; ranks that reach points of different names fail
            with MismatchError.
    """

    def __init__(self, coord: SyncHost, name: str) -> None:
        self._coord = coord
        self._channel = coord.sync_lane.transport
        self.name = name
        self._hash = zlib.crc32(name.encode())
        self._round = 0
        self._spun = 0
        self._busy = False
        self._send = np.array([self._hash, -self._hash, 0, 0], np.int64)
        self._recv = np.empty_like(self._send)

    async def wait(self, timeout: float | None = None) -> None:
        """Wait for every rank at this point.

        Args:
            timeout: seconds to wait; None waits for ever (stalls are still probed).

        Raises:
            CollectiveTimeout: not every rank arrived within `timeout`; the point's
                round stays in flight.
            MismatchError: on every rank, where ranks reached points of different names
                or rounds; names each rank's point.
            RankFailedError: a rank did not answer a liveness probe.
        """
        rnd, self._round = self._round, self._round + 1
        send, recv = self._buffers()
        send[2], send[3] = rnd, -rnd
        self._busy = True
        await self._complete(self._channel.p2p_iallreduce_max(send, recv), rnd, timeout)
        self._busy = False
        if recv.tolist() != send.tolist():
            await self._mismatch(rnd)

    def _buffers(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Reuse the pair unless a cancelled wait left its allreduce in flight."""
        if self._busy:
            self._send = np.array([self._hash, -self._hash, 0, 0], np.int64)
            self._recv = np.empty_like(self._send)
        return self._send, self._recv

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def _complete(self, req: Request, rnd: int, timeout: float | None) -> None:
        """Spin briefly (peers are often already there), else let the engine poll."""
        deadline = time.perf_counter() + self._coord.engine.policy.spin_s
        while time.perf_counter() < deadline:
            if req.Test():
                self._spun += 1
                return
        engine = self._coord.engine
        op = engine.track(req, f"consistency point {self.name!r} #{rnd}")
        try:
            with anyio.fail_after(timeout):
                await self._watch(op, rnd)
        except TimeoutError:
            raise CollectiveTimeout(
                f"consistency point {self.name!r} round {rnd}: not every rank arrived "
                f"within {timeout:g} s; the point stays in flight") from None

    async def _watch(self, op: Any, rnd: int) -> None:
        """Await op, probing the other ranks' liveness every `stall_s`."""
        engine, svc = self._coord.engine, self._coord.sync
        while not op.done:
            with anyio.move_on_after(svc.policy.stall_s):
                await engine.wait(op)
            if not op.done:
                await self._probe(svc, rnd)
        op.outcome()

    async def _probe(self, svc: Any, rnd: int) -> None:
        dead = [r for r in range(svc.size) if not await svc.alive(r)]
        if dead:
            raise RankFailedError(
                f"consistency point {self.name!r} round {rnd}: rank(s) {dead} did not "
                f"answer a liveness probe within {svc.policy.probe_s:g} s (dead, or their "
                f"event loops are blocked); the point stays in flight")
        log.warning("consistency point %r round %d: rank %d still waiting after %g s",
                    self.name, rnd, svc.rank, svc.policy.stall_s)

    async def _mismatch(self, rnd: int) -> None:
        """Gather every rank's (name, round) by a MAX-allreduce of one row each."""
        size, rank = self._channel.size, self._channel.rank
        rows = np.full((size, 2 + _NAME_BYTES // 8), _LOW, np.int64)
        rows[rank, 0], rows[rank, 1] = rnd, self._hash
        rows[rank, 2:] = np.frombuffer(self.name.encode()[:_NAME_BYTES].ljust(_NAME_BYTES,
                                                                              b"\0"), np.int64)
        out = np.empty_like(rows)
        await self._complete(self._channel.p2p_iallreduce_max(rows, out), rnd, None)
        parts = [f"rank {r}: {_label(out[r])} round {int(out[r, 0])}" for r in range(size)]
        raise MismatchError("ranks reached different consistency points: " + "; ".join(parts))

    def statistics(self) -> ConsistencyStatistics:
        """This rank's counters.

        Returns:
            Name, rounds passed, and how many completed within the spin.
        """
        return ConsistencyStatistics(self.name, self._round, self._spun)


def _label(row: np.ndarray[Any, Any]) -> str:
    """A point's name as sent: its first `_NAME_BYTES` bytes and, where it fills
    them (it may be cut), its crc32, so names that differ further on read apart."""
    name = row[2:].tobytes().rstrip(b"\0").decode(errors="replace")
    if len(name.encode()) < _NAME_BYTES:
        return repr(name)
    return f"{name + '...'!r} (crc32 {int(row[1]):08x})"
