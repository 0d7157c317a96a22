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

Only the job's ranks get in: the mesh listens on the one address its peers
are told (loopback when the job has one host), and a connection carries
frames only after both ends proved they hold the job's secret (`handshake`).
Frames are checked before they are used: a stream id outside the mesh's
streams, or a payload over `MAX_FRAME_BYTES`, ends that peer's connection
(it is then a dead peer, with the reason in its error).
"""

from __future__ import annotations

import logging
import socket
import struct
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..base import settings
from ..base.backoff import Backoff, Deadline, poll_until
from ..base.errors import BackendError
from .base import DONE, Array, Request
from .handshake import Acceptor, MeshKey, connect

_FRAME = struct.Struct("<iI")  # stream id, payload bytes
WAIT_POLL_S = 1e-4  # a blocking `Wait` (the engine's wait thread) tests this often
MESH_DEADLINE_S = 60.0  # every peer has joined the mesh by then, or start-up fails
HOLD_POLL_S = 0.05  # the test hook (ASYNCLOCK_MESH_HOLD) looks for its go file this often
# Every frame asynclock sends is far smaller (header slots, sync messages, statuses);
# a larger length is a broken or foreign sender, not a message to buffer.
MAX_FRAME_BYTES = 16 << 20
MAX_CHANNELS = 1 << 16  # channel ids a backend may open (it opens a few per lane)
# The listener's queue of connections not yet accepted (the kernel caps it at
# net.core.somaxconn). A full queue drops a real peer's SYN, and its connect then
# waits on SYN retries (1, 3, 7, 15 s), so the queue is deeper than what a foreign
# client plausibly holds in it while this rank is still connecting to lower ranks.
LISTEN_BACKLOG = 4096
Address = tuple[str, int]
P2P, HEADERS, AGREE, DATA = range(4)  # a channel's streams: id = 4 * channel + kind

log = logging.getLogger("asynclock.transport")


class Mailbox:
    """A full mesh of TCP connections between the ranks of one backend."""

    def __init__(self, rank: int, size: int, key: MeshKey, host: str,
                 exchange: Callable[[Address], list[Address]]) -> None:
        """Collective: listen on `host` (the address peers reach this rank at) and
        join the mesh of every rank holding `key`; `exchange` must gather every
        rank's address in rank order, over a channel the job already trusts."""
        self.rank, self.size, self.key = rank, size, key
        self.inboxes: dict[int, deque[tuple[int, bytes]]] = {}
        self.gathers: dict[int, GatherStream] = {}
        self._rx: dict[int, bytearray] = {}
        self._tx: dict[int, bytearray] = {}
        self._sent: dict[int, int] = {}
        self._queued: dict[int, int] = {}
        self.dead: set[int] = set()
        self.broken: dict[int, str] = {}  # peers whose frames broke the protocol: why
        self.refused = 0  # connections refused while the mesh was built
        with socket.create_server((host, 0), backlog=LISTEN_BACKLOG) as listener:
            addresses = exchange(listener.getsockname()[:2])
            _hold_for_test(key.mesh, rank, addresses[rank])
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
        """Connect to every lower rank, then accept every higher one, each after
        the handshake (`handshake`).

        Rank 0 only accepts, and a rank answers its higher peers once it is
        connected to its lower ones, so this order cannot deadlock; a
        connection waits in the listen backlog until its rank accepts.
        """
        deadline = Deadline(MESH_DEADLINE_S)
        peers: dict[int, socket.socket] = {}
        try:
            for peer in range(self.rank):
                peers[peer] = connect(addresses[peer], self.key, self.rank, peer, deadline)
        except BaseException:
            for sock in peers.values():
                sock.close()
            raise
        acceptor = Acceptor(listener, self.key, self.rank, set(range(self.rank + 1, self.size)),
                            settings.number("ASYNCLOCK_HANDSHAKE_S"))
        try:
            peers.update(acceptor.run(deadline))
        finally:
            self.refused = acceptor.refused
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
            raise BackendError(self.gone(dest))
        if len(payload) > MAX_FRAME_BYTES:
            raise BackendError(f"a {len(payload)}-byte message to rank {dest}: the mesh "
                               f"carries at most {MAX_FRAME_BYTES} bytes per message")
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
        while len(rx) >= _FRAME.size and peer not in self.broken:
            channel, n = _FRAME.unpack_from(rx)
            if not 0 <= channel < 4 * MAX_CHANNELS:
                self._break(peer, f"sent a frame on stream {channel}, not a stream of this mesh")
                return
            if n > MAX_FRAME_BYTES:
                self._break(peer, f"sent a {n}-byte frame, over the mesh's limit of "
                                  f"{MAX_FRAME_BYTES} bytes")
                return
            if len(rx) < _FRAME.size + n:
                return
            payload = bytes(rx[_FRAME.size:_FRAME.size + n])
            del rx[:_FRAME.size + n]
            if channel % 4 == P2P:
                self.inboxes.setdefault(channel, deque()).append((peer, payload))
            else:
                self._gather_stream(channel).arrive(peer, payload)

    def _break(self, peer: int, why: str) -> None:
        """`peer` broke the frame protocol: drop its connection, say why once."""
        self.broken[peer] = why
        self.dead.add(peer)
        self._rx[peer].clear()
        self._peers[peer].close()
        log.warning("asynclock[rank %d]: %s: rank %d %s; its connection is closed",
                    self.rank, self.key.mesh, peer, why)

    def gone(self, peer: int) -> str:
        """Why `peer` can no longer be reached."""
        if peer in self.broken:
            return f"rank {peer} {self.broken[peer]}: its connection was closed"
        return f"rank {peer} closed its connection: it exited or died"

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
            why = "".join(f"; {self.box.gone(p)}" for p in lost if p in self.box.broken)
            raise BackendError(f"allgather round {self.k}: rank(s) {lost} closed their "
                               f"connection before sending: they exited or died{why}")

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


def _hold_for_test(mesh: str, rank: int, address: Address) -> None:
    """The test hook ASYNCLOCK_MESH_HOLD: say where this rank listens; then every rank
    that connects to lower ranks waits for the test's go, so a test's client reaches
    the listeners before any real peer does (rank 0 goes on to accept at once)."""
    folder = settings.text("ASYNCLOCK_MESH_HOLD")
    if not folder:
        return
    hold = Path(folder)
    (hold / f"{mesh}.{rank}.tmp").write_text(f"{address[0]} {address[1]}\n")
    (hold / f"{mesh}.{rank}.tmp").rename(hold / f"{mesh}.{rank}")
    go = hold / f"go.{mesh}"
    if rank == 0:
        return
    if not poll_until(go.exists, Backoff.every(HOLD_POLL_S), MESH_DEADLINE_S):
        raise BackendError(f"ASYNCLOCK_MESH_HOLD: no {go} within {MESH_DEADLINE_S:g} s")
