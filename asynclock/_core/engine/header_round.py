"""The small-call header round: the compact round (Python and its C twin) and the
rows round.

`engine.small_calls` finishes a small collective inside the call when its
header round completes within the engine's spin. The round it uses has one
method, `exchange()`: it writes this rank's part (its sequence number
patched in) and the inline payload into the send buffer, starts the round,
tests it until the spin ends and judges it. Every implementation answers
with the same states:

* `DONE`: every rank agreed; the caller finishes from the receive buffer;
* `DONE_FOLDED`: agreed, and the result is already in `out`;
* `DIFFERENT`: finished, and some rank's call differs (or a rank asked for
  the rows: the general path takes the call from there);
* `IN_FLIGHT`: the spin ended first; `take_request` hands the round's
  request to the general path, which owns it from there.

On a channel with a compact round (MPI; `base.header`), `exchange(key,
seq, data, spin, copy, out)` takes the call's 16-byte key (fingerprint key
and fold code) and copies the reduced payload into `out` when `copy`.
Elsewhere (the TCP mesh) `PythonRound` allgathers the packed slots,
`exchange(header, seq, ...)`, and never folds.

`rounds_for(transport)` is the one place a channel's variant is chosen, when
its lane is made; its `HeaderRounds` then makes every round of that channel:
the small-call round (`small_round`) and the general path's compact round
(`start`), both of the same variant, so both fold with the same op.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base.header import (
    C_FLAGS,
    C_FOLD,
    C_FP,
    C_NOT_FP,
    COMPACT_HEAD,
    HEADER_BYTES,
    agree,
    compact_agreed,
    fingerprint,
)
from ..transports.base import DONE as FINISHED
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
            idle()
        return DONE if agree(self._recv, self._size) else DIFFERENT

    def take(self) -> Any:
        req, self._request = self._request, None
        return req


KEY = struct.Struct("<qq")
# More ranks than cores on this host: spins give the core away between tests.
YIELD_WHEN_IDLE = [False]


def yield_when_idle(flag: bool) -> None:
    """Set by the coordinator from its host's ranks and cores; every spin of this
    process (both rounds, C and Python, and the engine's) follows it."""
    YIELD_WHEN_IDLE[0] = flag
    module = fastpath.module()
    if module is not None:
        module.set_yield(flag)


def idle() -> None:
    """One spin iteration found nothing: let a peer on this core run, if it must."""
    if YIELD_WHEN_IDLE[0]:
        os.sched_yield()  # a compact call's key: fingerprint key, fold code


class PythonCompactRound:
    """The compact round with mpi4py calls: the C `CompactRound`'s twin."""

    __slots__ = ("_start", "_send", "_recv", "_payload", "_result", "_request")

    def __init__(self, start: Start, send: Array, recv: Array) -> None:
        self._start, self._send, self._recv = start, send, recv
        self._payload = send.view(np.uint8)[COMPACT_HEAD * 8:]
        self._result = recv.view(np.uint8)[COMPACT_HEAD * 8:]
        self._request: Any = None

    def exchange(self, key: bytes, seq: int, data: Array | None, spin: float, copy: int,
                 out: Array | None) -> int:
        if self._request is not None:
            raise RuntimeError("a round is still in flight")
        h, fold = KEY.unpack(key)
        fp, send = fingerprint(h, seq), self._send
        send[C_FP], send[C_NOT_FP], send[C_FLAGS], send[C_FOLD] = fp, ~fp, 0, fold
        if data is None:
            self._payload[:] = 0  # a broadcast's non-root: OR'ed with zeros
        else:
            raw = data.reshape(-1).view(np.uint8)
            self._payload[: raw.size] = raw
        deadline = time.perf_counter() + spin
        req = self._start(send, self._recv)
        while not req.Test():
            if time.perf_counter() >= deadline:
                self._request = req
                return IN_FLIGHT
            idle()
        if not compact_agreed(self._recv, fold):
            return DIFFERENT
        if not copy or out is None:
            return DONE
        raw_out = out.reshape(-1).view(np.uint8)
        raw_out[:] = self._result[: raw_out.size]
        return DONE_FOLDED

    def take(self) -> Any:
        req, self._request = self._request, None
        return req


def is_compact(transport: Any) -> bool:
    return bool(getattr(transport, "compact", False))


# A channel's header-round variants (`HeaderRounds.kind`):
NODE = "node"  # compact rounds through node shared memory (C: `_fastpath.c`'s node round)
C = "c"  # compact rounds on MPI with the C op (`_fastpath.c`, built per MPI library)
PYTHON = "python"  # compact rounds on MPI with mpi4py calls (`PythonCompactRound`)
ROWS = "rows"  # no compact round: the rows round on the channel's slot allgather


def node_data(transport: Any, node: Any) -> Any:
    """Collective, after `rounds_for`: the channel's mid-size allreduce data through node
    shared memory (C), or None on every rank (`fastpath.node_data_for`)."""
    return fastpath.node_data_for(transport, node)


class HeaderRounds:
    """One channel's header rounds, of the variant `rounds_for` chose for it."""

    __slots__ = ("kind", "start", "node", "_transport")

    def __init__(self, kind: str, transport: Any, start: Start | None = None,
                 node: Any = None) -> None:
        self.kind = kind
        self._transport = transport
        # the general path's compact round `(send, recv) -> request` (None: rows only)
        self.start = start
        self.node = node  # the node round the compact rounds run through (kind NODE)

    @property
    def compact(self) -> bool:
        return self.kind != ROWS

    @property
    def in_c(self) -> bool:
        """The small-call round runs in C (it can fold, and arm a `HotAllreduce`)."""
        return self.kind in (NODE, C)

    def small_round(self, send: Array, recv: Array) -> Any:
        """A small-call round on `send`/`recv`: COMPACT_WORDS each, or (rows) a slot
        and `size` slots."""
        transport = self._transport
        if self.kind == NODE:
            return fastpath.module().NodeCompactRound(  # type: ignore[union-attr]
                self.node, send, recv)
        if self.kind == C:
            return fastpath.compact_round_for(transport, send, recv)
        if self.kind == PYTHON:
            return PythonCompactRound(transport.iallreduce_compact, send, recv)
        return PythonRound(transport.iallgather_slots, send, recv, transport.size)

    def take_request(self, rnd: Any) -> Any:
        """The request of a small-call round left IN_FLIGHT, as one the engine can own."""
        return fastpath.take_request(rnd) if self.in_c else rnd.take()


def rounds_for(transport: Any) -> HeaderRounds:
    """The channel's header-round variant (collective over the channel: whether the
    compact rounds go through node memory is agreed). Node memory where every rank
    of the channel can (`fastpath.node_round_for`), else the C op on MPI where the
    extension is loaded, else mpi4py; the rows round alone where the channel has no
    compact round (the TCP mesh)."""
    if not is_compact(transport):
        return HeaderRounds(ROWS, transport)
    node = fastpath.node_round_for(transport)
    if node is not None:
        return HeaderRounds(NODE, transport, node.start, node)
    start: Start | None = fastpath.compact_starter(transport)
    if start is not None:
        return HeaderRounds(C, transport, start)
    return HeaderRounds(PYTHON, transport, transport.iallreduce_compact)


def finished_request() -> Any:
    """A request that tests complete: a round already finished. Not MPI's null request,
    which would start MPI in a job whose rounds run on the TCP mesh."""
    return FINISHED
