"""The small-call header round: one Python implementation and its C twin.

`engine.small_calls` finishes a small collective inside the call when its
header round completes within the engine's spin. The round it uses is a
`Round`: `exchange()` writes the packed header (its sequence word patched)
and the inline payload into the send slot, starts the allgather of slots,
tests it until the spin ends and compares every rank's header. Both
implementations put the same bytes on the wire and answer with the same
states:

* `DONE`: every rank agreed; the caller finishes from the receive slots;
* `DONE_FOLDED`: agreed, and the inline rows are already folded into `out`
  (only the C round folds, for the `fastpath.FOLDS` kinds);
* `DIFFERENT`: finished, and some rank's header differs;
* `IN_FLIGHT`: the spin ended first; `take_request` hands the round's
  request to the general path, which owns it from there.

`PythonRound` is the reference implementation. `engine.fastpath` builds the
C `Round` (`_fastpath.c`) per MPI library; `round_for` picks it where it is
built and the transport exposes its MPI header communicator, else the
Python round.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base.header import HEADER_BYTES, agree
from . import fastpath

Array = np.ndarray[Any, Any]
Start = Callable[[Array, Array], Any]  # (send slot, receive slots) -> a request

# `_fastpath.c`'s enum: exchange() results
DONE_FOLDED, DIFFERENT, IN_FLIGHT, DONE = 0, 1, 2, 3


class PythonRound:
    """The header round with mpi4py calls (or any transport's slot allgather)."""

    __slots__ = ("_start", "_send", "_send_u8", "_send_bytes", "_recv", "_size", "_request")

    def __init__(self, start: Start, send: Array, recv: Array, size: int) -> None:
        self._start, self._send, self._recv, self._size = start, send, recv, size
        self._send_u8 = send.view(np.uint8)
        self._send_bytes = self._send_u8.data
        self._request: Any = None

    def exchange(self, header: bytes, seq: int, data: Array | None, spin: float, fold: int,
                 out: Array | None) -> int:
        """Issue the round and test it for `spin` seconds; `fold` and `out` are the
        C round's folding, which this round leaves to the caller (never DONE_FOLDED)."""
        if self._request is not None:
            raise RuntimeError("a round is still in flight")
        self._send_bytes[:HEADER_BYTES] = header
        self._send[1] = seq  # W_SEQ
        if data is not None:
            payload = data.reshape(-1).view(np.uint8)
            self._send_u8[HEADER_BYTES:HEADER_BYTES + payload.size] = payload
        deadline = time.perf_counter() + spin
        req = self._start(self._send, self._recv)
        while not req.Test():
            if time.perf_counter() >= deadline:
                self._request = req
                return IN_FLIGHT
        return DONE if agree(self._recv, self._size) else DIFFERENT

    def take(self) -> Any:
        req, self._request = self._request, None
        return req


def round_for(transport: Any, send: Array, recv: Array) -> Any:
    """The C round on the transport's MPI header communicator where it is built,
    else a `PythonRound` on the transport's own slot allgather."""
    c_round = fastpath.round_for(transport, send, recv)
    if c_round is not None:
        return c_round
    start = getattr(transport, "iallgather_slots_direct", transport.iallgather_slots)
    return PythonRound(start, send, recv, transport.size)


def is_c(rnd: Any) -> bool:
    return not isinstance(rnd, PythonRound)


def take_request(rnd: Any) -> Any:
    """The request of a round left IN_FLIGHT, as a request the engine can own."""
    if isinstance(rnd, PythonRound):
        return rnd.take()
    return fastpath.take_request(rnd)


def finished_request() -> Any:
    """A request that tests complete (MPI_REQUEST_NULL): a round already finished."""
    from mpi4py import MPI

    return MPI.Request()
