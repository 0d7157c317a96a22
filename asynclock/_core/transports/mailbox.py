"""Point-to-point messages and small allgathers over TCP, for a world without MPI.

Under `horovodrun --gloo` there is no MPI world, and Horovod has collectives
only, each costing at least one Horovod cycle (1 ms by default). So the
traffic MPI carries in the MPI setup travels on one full mesh of TCP
connections per backend instead: the sync primitives' point-to-point
messages (requests, grants, liveness pings) and the small allgathers of
header rounds, barriers and agreement rounds. Frames are
`(stream id, length, payload)`; each channel owns a few streams.

An allgather needs no sequence numbers: every rank issues the rounds of
one stream in the same order (the invariant MPI needs too), and a TCP
connection keeps order, so the k-th message from a peer on a stream belongs
to round k. Everything after start-up is non-blocking: a send queues the
frame and flushes what the socket takes, receiving drains what has
arrived. A peer that closes its end (it exited or died) is remembered; a
send to it, or a round still missing its message, raises `BackendError`.
"""

from __future__ import annotations

import socket
import struct
from collections import deque
from collections.abc import Callable

import numpy as np

from ..base.backoff import Backoff, poll_until
from ..base.errors import BackendError
from .base import DONE, Array, Request

_FRAME = struct.Struct("<iI")  # stream id, payload bytes
WAIT_POLL_S = 1e-4  # a blocking `Wait` (the engine's wait thread) tests this often
_ID = struct.Struct("<q")  # the connecting rank, sent once per connection
Address = tuple[str, int]
P2P, HEADERS, AGREE, DATA = range(4)  # a channel's streams: id = 4 * channel + kind


class Mailbox:
    """A full mesh of TCP connections between the ranks of one backend."""

    def __init__(self, rank: int, size: int, host: str,
                 exchange: Callable[[Address], list[Address]]) -> None:
        """Collective: `exchange` must gather every rank's address in rank order."""
        self.rank, self.size = rank, size
        self.inboxes: dict[int, deque[tuple[int, bytes]]] = {}
        self.gathers: dict[int, GatherStream] = {}
        self._rx: dict[int, bytearray] = {}
        self._tx: dict[int, bytearray] = {}
        self._sent: dict[int, int] = {}
        self._queued: dict[int, int] = {}
        self.dead: set[int] = set()
        with socket.create_server(("", 0), backlog=max(1, size)) as listener:
            addresses = exchange((host, listener.getsockname()[1]))
            try:
                self._peers = self._connect_mesh(listener, addresses)
            except OSError as exc:  # unreachable host, refused, or a peer that never came
                raise BackendError(f"rank {rank}: building the TCP mesh between "
                                   f"{addresses} failed: {exc}") from exc
        for peer, sock in self._peers.items():
            sock.setblocking(False)
            self._rx[peer], self._tx[peer] = bytearray(), bytearray()
            self._sent[peer] = self._queued[peer] = 0

    def _connect_mesh(self, listener: socket.socket,
                      addresses: list[Address]) -> dict[int, socket.socket]:
        """Connect to every lower rank, accept every higher one.

        Connections to lower ranks complete in their listen backlog before
        they call `accept`, so this order cannot deadlock.
        """
        peers: dict[int, socket.socket] = {}
        for peer in range(self.rank):
            sock = socket.create_connection(addresses[peer], timeout=60)
            sock.sendall(_ID.pack(self.rank))
            peers[peer] = sock
        listener.settimeout(60)
        for _ in range(self.rank + 1, self.size):
            sock, _addr = listener.accept()
            sock.settimeout(60)
            peers[_ID.unpack(_recv_exact(sock, _ID.size))[0]] = sock
        for sock in peers.values():
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return peers

    def port(self, channel: int) -> MailboxPort:
        """One channel's streams: point-to-point, and allgathers in header order,
    in agreement order and in data-stage order (each kind is ordered alike on
    every rank, but not with the others)."""
        self.inboxes.setdefault(4 * channel + P2P, deque())
        for kind in (HEADERS, AGREE, DATA):
            self._gather_stream(4 * channel + kind)  # a peer's first rounds may be in
        return MailboxPort(self, 4 * channel)

    def _gather_stream(self, stream_id: int) -> GatherStream:
        """The stream, made on first use: by our port, or by a frame that arrived
        before it (a peer that opened the channel first and already sent its
        first header round; dropping that frame would hang the round)."""
        stream = self.gathers.get(stream_id)
        if stream is None:
            stream = self.gathers[stream_id] = GatherStream(self.size)
        return stream

    # -- sending ---------------------------------------------------------------
    def send(self, dest: int, channel: int, payload: bytes) -> Request:
        if dest == self.rank:
            self.inboxes[channel].append((dest, payload))
            return DONE
        if dest in self.dead:
            raise BackendError(f"rank {dest} closed its connection: it exited or died")
        tx = self._tx[dest]
        tx += _FRAME.pack(channel, len(payload))
        tx += payload
        self._queued[dest] += _FRAME.size + len(payload)
        request = SendRequest(self, dest, self._queued[dest])
        self.flush(dest)
        return request

    def flush(self, dest: int) -> int:
        """Write what the socket accepts now; return the bytes written so far."""
        tx = self._tx[dest]
        if tx and dest not in self.dead:
            try:
                n = self._peers[dest].send(tx)
            except BlockingIOError:
                n = 0
            except OSError as exc:
                self.dead.add(dest)
                raise BackendError(f"sending to rank {dest} failed: {exc}") from exc
            del tx[:n]
            self._sent[dest] += n
        return self._sent[dest]

    # -- receiving -------------------------------------------------------------
    def pump(self) -> None:
        """Move every complete frame that has arrived into its channel's inbox."""
        for peer, sock in self._peers.items():
            if peer not in self.dead:
                self._drain(peer, sock)

    def _drain(self, peer: int, sock: socket.socket) -> None:
        rx = self._rx[peer]
        while True:
            try:
                chunk = sock.recv(1 << 16)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.dead.add(peer)
                break
            rx += chunk
        self._split_frames(peer, rx)

    def _split_frames(self, peer: int, rx: bytearray) -> None:
        while len(rx) >= _FRAME.size:
            channel, n = _FRAME.unpack_from(rx)
            if len(rx) < _FRAME.size + n:
                return
            payload = bytes(rx[_FRAME.size:_FRAME.size + n])
            del rx[:_FRAME.size + n]
            if channel % 4 == P2P:
                self.inboxes.setdefault(channel, deque()).append((peer, payload))
            else:
                self._gather_stream(channel).arrive(peer, payload)

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close()
        self._peers.clear()


class MailboxPort:
    """One channel's streams on the shared mesh."""

    def __init__(self, box: Mailbox, base: int) -> None:
        self.box, self.base = box, base

    def isend(self, buf: Array, dest: int) -> Request:
        return self.box.send(dest, self.base + P2P, np.ascontiguousarray(buf).tobytes())

    def try_recv(self, buf: Array) -> tuple[int, int] | None:
        inbox = self.box.inboxes[self.base + P2P]
        if not inbox:
            self.box.pump()
        if not inbox:
            return None
        source, payload = inbox.popleft()
        raw = buf.view(np.uint8)
        if len(payload) > raw.size:
            raise BackendError(f"a {len(payload)}-byte message from rank {source} does not fit "
                               f"the {raw.size}-byte receive buffer")
        raw[: len(payload)] = np.frombuffer(payload, np.uint8)
        return source, len(payload)

    def iallgather(self, send: Array, recv: Array, kind: int = HEADERS,
                   finish: Callable[[], object] | None = None) -> GatherRequest:
        """Every rank's `send` into row r of `recv`; `finish` runs once when complete."""
        stream_id = self.base + kind
        stream, box = self.box.gathers[stream_id], self.box
        payload = np.ascontiguousarray(send).tobytes()
        sends = [box.send(p, stream_id, payload) for p in range(box.size) if p != box.rank]
        stream.issued += 1
        return GatherRequest(box, stream, stream.issued - 1, payload, recv, sends, finish)


class GatherStream:
    """Arrived messages of one allgather stream, by round and source."""

    def __init__(self, size: int) -> None:
        self.arrived = [0] * size
        self.rounds: dict[int, dict[int, bytes]] = {}
        self.issued = 0

    def arrive(self, peer: int, payload: bytes) -> None:
        self.rounds.setdefault(self.arrived[peer], {})[peer] = payload
        self.arrived[peer] += 1


class GatherRequest:
    """Round `k` of a stream: done when every peer's k-th message arrived and
    ours are written (a half-written frame would stall a peer)."""

    __slots__ = ("box", "stream", "k", "own", "recv", "sends", "finish", "done")

    def __init__(self, box: Mailbox, stream: GatherStream, k: int, own: bytes, recv: Array,
                 sends: list[Request], finish: Callable[[], object] | None) -> None:
        self.box, self.stream, self.k, self.own, self.recv = box, stream, k, own, recv
        self.sends, self.finish, self.done = sends, finish, False

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        if self.done:
            return True
        self.sends = [s for s in self.sends if not s.Test()]
        need = self.box.size - 1
        if len(self.stream.rounds.get(self.k, ())) < need:
            self.box.pump()
        got = self.stream.rounds.get(self.k, {})
        if len(got) < need:
            self._check_peers(got)
            return False
        if self.sends:
            return False
        self._complete(got)
        return True

    def _check_peers(self, got: dict[int, bytes]) -> None:
        lost = sorted(p for p in self.box.dead if p not in got)
        if lost:
            raise BackendError(f"allgather round {self.k}: rank(s) {lost} closed their "
                               "connection before sending: they exited or died")

    def _complete(self, got: dict[int, bytes]) -> None:
        rows = self.recv.view(np.uint8).reshape(self.box.size, -1)
        got[self.box.rank] = self.own
        for peer, payload in got.items():
            if len(payload) != rows.shape[1]:
                raise BackendError(f"allgather round {self.k}: rank {peer} sent "
                                   f"{len(payload)} bytes, {rows.shape[1]} expected")
            rows[peer] = np.frombuffer(payload, np.uint8)
        self.stream.rounds.pop(self.k, None)
        self.done = True
        if self.finish is not None:
            self.finish()

    def Wait(self) -> None:  # noqa: N802
        poll_until(self.Test, Backoff.every(WAIT_POLL_S))


class SendRequest:
    """Done once every byte up to this frame's end has been written."""

    __slots__ = ("box", "dest", "mark")

    def __init__(self, box: Mailbox, dest: int, mark: int) -> None:
        self.box, self.dest, self.mark = box, dest, mark

    def Test(self) -> bool:  # noqa: N802 - mpi4py's spelling
        return self.box.flush(self.dest) >= self.mark

    def Wait(self) -> None:  # noqa: N802
        poll_until(self.Test, Backoff.every(WAIT_POLL_S))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise BackendError("a peer closed its connection during start-up")
        data += chunk
    return data
