"""Proof that a connection to asynclock's TCP mesh comes from a rank of the same job.

Where there is no MPI world, asynclock's ranks talk over a TCP mesh of their
own (`mailbox`), and what arrives there feeds the collectives and is
unpickled by the heartbeats. So before a connection carries its first frame,
both ends prove that they hold the job's secret (`MeshKey`), in a
challenge-response whose proofs cover the claimed rank, the rank it is
addressed to, the mesh and a fresh nonce from each side:

1. the connecting rank sends HELLO: magic, version, its rank, the rank it
   calls, its nonce;
2. the accepting rank checks the claim (a rank it expects and does not yet
   have) and answers CHALLENGE: its nonce and HMAC(key, "acceptor" | HELLO |
   its nonce);
3. the connecting rank checks that proof and sends HMAC(key, "connector" |
   HELLO | acceptor's nonce);
4. the accepting rank checks it and sends ACCEPTED; frames may follow.

Proofs are HMAC-SHA256 compared with `hmac.compare_digest`. The role words
keep one side's proof from being replayed as the other's; the nonces keep
an old handshake from being replayed; the key is derived per mesh, so a
proof for one mesh is worthless on another. Every message has a fixed size,
and the accepting side reads no byte beyond the one it expects next.

The accepting rank serves all pending handshakes at once (a selector), each
within its own deadline, so a foreign client that connects first and stalls
cannot keep the real peer out; a connection that fails is closed, counted
and reported in one log line, and the mesh waits on for the ranks it lacks.
It keeps accepting whatever a client does: the kernel's queue of connections
never fills ahead of a real peer, whose connect would then wait on SYN
retries. Pending handshakes are capped (`FOREIGN_ROOM`); one more refuses the
one that has shown the least (nothing before part of a HELLO before a whole
one; the oldest of those), and so does a rank out of file descriptors. A real
peer sends its HELLO as it connects, so it is the last an idle client's
connections push out. A failed `accept()` is reported once per kind and never
ends the mesh: the next connection in the queue is another client's.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import selectors
import socket
import struct
import time

from ..base.backoff import Deadline
from ..base.errors import BackendError

__all__ = ["SECRET_BYTES", "Acceptor", "MeshKey", "connect"]

SECRET_BYTES = 32  # the job secret, as Horovod's own (`secret.SECRET_LENGTH`)
NONCE_BYTES = 32
VERSION = 1
_MAGIC = b"ALKM"
_HELLO = struct.Struct("<4sHxxii32s")  # magic, version, claimed rank, called rank, nonce
_CHALLENGE = struct.Struct("<4sHxx32s32s")  # magic, version, nonce, acceptor's proof
_PROOF_BYTES = hashlib.sha256().digest_size
_ACCEPTED = b"ALKA"
Address = tuple[str, int]
# Handshakes served at once beyond one per rank still expected. Every real peer may
# be in flight together, and each pending one holds a descriptor until its deadline,
# so without a cap a client that opens connections by the thousand spends the rank's
# descriptors; 64 leaves room for many slow connections while a flood takes at most
# 64 descriptors more than the job's own. A real peer's handshake lasts one round
# trip, so it is never the one that has shown the least for long.
FOREIGN_ROOM = 64
# Out of descriptors with nothing pending to refuse: the next connection waits in the
# kernel's queue this long before accept() is tried again.
ACCEPT_PAUSE_S = 0.05
# accept() errors that say the listener itself is unusable; any other is transient
# (Linux reports a connection's own network error from accept(), accept(2)).
_BROKEN_LISTENER = frozenset({errno.EBADF, errno.EINVAL, errno.ENOTSOCK, errno.EFAULT})
_OUT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

log = logging.getLogger("asynclock.transport")


class MeshKey:
    """One mesh's key, derived from the job secret and the mesh's name.

    It never leaves this object: no repr, log line or error message shows it.
    """

    __slots__ = ("mesh", "_key")

    def __init__(self, secret: bytes, mesh: str) -> None:
        if len(secret) < SECRET_BYTES // 2:
            raise ValueError(f"a job secret needs at least {SECRET_BYTES // 2} bytes")
        self.mesh = mesh
        self._key = hmac.digest(secret, b"asynclock mesh\0" + mesh.encode(), "sha256")

    def __repr__(self) -> str:
        return f"MeshKey({self.mesh!r})"

    def proof(self, role: bytes, hello: bytes, nonce: bytes) -> bytes:
        return hmac.digest(self._key, role + b"\0" + hello + nonce, "sha256")


def connect(address: Address, key: MeshKey, rank: int, peer: int,
            deadline: Deadline) -> socket.socket:
    """A connection to rank `peer` at `address` on which both sides proved the key.

    Raises BackendError when the other end proves nothing or refuses this rank.
    """
    if deadline.passed():
        raise BackendError(f"{key.mesh}: no time left to connect to rank {peer}")
    sock = socket.create_connection(address, timeout=deadline.left())
    try:
        nonce = os.urandom(NONCE_BYTES)
        hello = _HELLO.pack(_MAGIC, VERSION, rank, peer, nonce)
        sock.sendall(hello)
        magic, version, theirs, proof = _CHALLENGE.unpack(
            _recv_exact(sock, _CHALLENGE.size, deadline, peer))
        if (magic, version) != (_MAGIC, VERSION) or not hmac.compare_digest(
                proof, key.proof(b"acceptor", hello, theirs)):
            raise BackendError(f"{key.mesh}: the listener of rank {peer} at {address[0]}:"
                               f"{address[1]} did not prove it belongs to this job")
        sock.sendall(key.proof(b"connector", hello, theirs))
        if _recv_exact(sock, len(_ACCEPTED), deadline, peer) != _ACCEPTED:
            raise BackendError(f"{key.mesh}: rank {peer} answered the handshake with "
                               "something other than its acceptance")
    except BaseException:
        sock.close()
        raise
    return sock


def _recv_exact(sock: socket.socket, n: int, deadline: Deadline, peer: int) -> bytes:
    data = b""
    while len(data) < n:
        sock.settimeout(deadline.left())
        try:
            chunk = sock.recv(n - len(data))
        except (TimeoutError, BlockingIOError):
            raise BackendError(f"rank {peer} did not complete the mesh handshake in "
                               "time") from None
        if not chunk:
            raise BackendError(f"rank {peer} closed the connection during the mesh "
                               "handshake: it refused this rank")
        data += chunk
    return data


class _Refused(Exception):
    """Why a pending handshake is refused (the text of its log line)."""


class _Pending:
    """One accepted connection that has not yet proved anything."""

    __slots__ = ("sock", "where", "deadline", "buf", "hello", "nonce", "claimed")

    def __init__(self, sock: socket.socket, where: str, deadline: Deadline) -> None:
        self.sock, self.where, self.deadline = sock, where, deadline
        self.buf = bytearray()
        self.hello = b""  # set once HELLO is in; then PROOF is awaited
        self.nonce = b""
        self.claimed: int | None = None

    def need(self) -> int:
        return (_PROOF_BYTES if self.hello else _HELLO.size) - len(self.buf)

    def shown(self) -> int:
        """How far it got: 0 nothing, 1 part of HELLO, 2 a whole HELLO."""
        return 2 if self.hello else 1 if self.buf else 0

    def read(self) -> bool:
        """Take what arrived, never more than the next message; True once it is whole."""
        try:
            chunk = self.sock.recv(self.need())
        except BlockingIOError:
            return False
        except OSError as exc:
            raise _Refused(f"failed during the handshake ({exc})") from None
        if not chunk:
            raise _Refused("closed the connection during the handshake")
        self.buf += chunk
        return self.need() == 0


class Acceptor:
    """Accepts the ranks `expected` on `listener`, each only after a full handshake.

    Every other connection (a wrong or missing proof, a slow one, a rank
    claimed twice or not expected here, one past the cap on pending handshakes)
    is closed, counted in `refused` and reported in one log line; a failed
    `accept()` is counted in `accept_errors` and reported once per kind.
    """

    def __init__(self, listener: socket.socket, key: MeshKey, rank: int,
                 expected: set[int], handshake_s: float) -> None:
        self.listener, self.key, self.rank = listener, key, rank
        self.expected, self.handshake_s = set(expected), handshake_s
        self.peers: dict[int, socket.socket] = {}
        self.refused = 0
        self.accept_errors = 0
        self._pending: dict[socket.socket, _Pending] = {}  # oldest first
        self._selector = selectors.DefaultSelector()
        self._error_kinds: set[int | None] = set()  # accept() errors already reported
        self._paused_until: float | None = None  # listener out of the selector until then

    def cap(self) -> int:
        """The most handshakes pending at once (`FOREIGN_ROOM`)."""
        return len(self.expected - self.peers.keys()) + FOREIGN_ROOM

    def run(self, deadline: Deadline) -> dict[int, socket.socket]:
        """Serve handshakes until every expected rank is in, or raise at `deadline`."""
        self.listener.setblocking(False)
        self._selector.register(self.listener, selectors.EVENT_READ)
        try:
            while self.expected - self.peers.keys():
                if deadline.passed():
                    raise BackendError(self._missing_text())
                self._resume()
                for ready, _ in self._selector.select(self._next_timeout(deadline)):
                    self._serve(ready.fileobj)  # type: ignore[arg-type]
                self._expire()
        finally:
            for pending in list(self._pending.values()):
                self._refuse(pending, "had not finished its handshake when this rank "
                                      "stopped accepting")
            self._selector.close()
        return self.peers

    def _next_timeout(self, deadline: Deadline) -> float:
        lefts = [p.deadline.left() or 0.0 for p in self._pending.values()]
        if self._paused_until is not None:
            lefts.append(max(0.0, self._paused_until - time.monotonic()))
        return min([deadline.left() or 0.0, *lefts])

    def _serve(self, sock: socket.socket) -> None:
        if sock is self.listener:
            self._accept()
            return
        pending = self._pending[sock]
        try:
            if pending.read():
                self._advance(pending)
        except _Refused as why:
            self._refuse(pending, str(why))

    def _accept(self) -> None:
        try:
            sock, addr = self.listener.accept()
        except BlockingIOError:
            return
        except OSError as exc:
            self._accept_failed(exc)
            return
        sock.setblocking(False)
        where = f"{addr[0]}:{addr[1]}"
        self._pending[sock] = _Pending(sock, where, Deadline(self.handshake_s))
        self._selector.register(sock, selectors.EVENT_READ)
        self._serve(sock)  # a real peer's HELLO is in by now: let it count below
        if len(self._pending) > self.cap():
            self._refuse_least(f"handshakes pending at once, {self.cap()} the most this "
                               "rank serves")

    def _accept_failed(self, exc: OSError) -> None:
        """Count and report (once per kind) a failed accept(), and go on: out of
        descriptors, free one by refusing the pending handshake that has shown the
        least, or with none, leave the next connection queued for a moment."""
        if exc.errno in _BROKEN_LISTENER:
            raise BackendError(f"{self.key.mesh}: rank {self.rank}'s listener failed: "
                               f"{exc}") from exc
        self.accept_errors += 1
        out_of_resources = exc.errno in _OUT_OF_RESOURCES
        if exc.errno not in self._error_kinds:
            self._error_kinds.add(exc.errno)
            then = ("refusing the pending handshake that has shown the least, or waiting "
                    "while none is" if out_of_resources else "accepting the next")
            log.warning("asynclock[rank %d]: %s could not accept a connection (%s); %s "
                        "(reported once, counted in accept_errors)", self.rank, self.key.mesh,
                        exc, then)
        if not out_of_resources:
            return
        if self._pending:
            self._refuse_least("pending handshakes when this rank ran out of descriptors "
                               f"({os.strerror(exc.errno or 0)})")
        else:
            self._pause()

    def _refuse_least(self, when: str) -> None:
        """Refuse the pending handshake that has shown the least; the oldest of those."""
        least = min(self._pending.values(), key=_Pending.shown)
        self._refuse(least, f"had shown the least of {len(self._pending)} {when}")

    def _pause(self) -> None:
        if self._paused_until is None:
            self._selector.unregister(self.listener)
        self._paused_until = time.monotonic() + ACCEPT_PAUSE_S

    def _resume(self) -> None:
        if self._paused_until is not None and time.monotonic() >= self._paused_until:
            self._paused_until = None
            self._selector.register(self.listener, selectors.EVENT_READ)

    def _advance(self, pending: _Pending) -> None:
        """A whole message is in: HELLO gets a challenge, PROOF gets the verdict."""
        message, pending.buf = bytes(pending.buf), bytearray()
        if not pending.hello:
            self._challenge(pending, message)
            return
        claimed = pending.claimed
        assert claimed is not None
        if not hmac.compare_digest(message, self.key.proof(b"connector", pending.hello,
                                                           pending.nonce)):
            raise _Refused(f"claimed rank {claimed} without proof of the job secret")
        if claimed in self.peers:
            raise _Refused(f"claimed rank {claimed}, which is already connected")
        self._send(pending, _ACCEPTED)
        self._forget(pending)
        pending.sock.setblocking(True)
        self.peers[claimed] = pending.sock

    def _challenge(self, pending: _Pending, hello: bytes) -> None:
        magic, version, claimed, called, _nonce = _HELLO.unpack(hello)
        if magic != _MAGIC:
            raise _Refused("sent something that is not an asynclock mesh handshake")
        if version != VERSION:
            raise _Refused(f"speaks mesh handshake version {version}, this rank {VERSION}")
        if called != self.rank:
            raise _Refused(f"called rank {called}, not this rank")
        if claimed not in self.expected:
            raise _Refused(f"claimed rank {claimed}, which does not connect to rank "
                          f"{self.rank}")
        if claimed in self.peers:
            raise _Refused(f"claimed rank {claimed}, which is already connected")
        pending.hello, pending.claimed = hello, claimed
        pending.nonce = os.urandom(NONCE_BYTES)
        proof = self.key.proof(b"acceptor", hello, pending.nonce)
        self._send(pending, _CHALLENGE.pack(_MAGIC, VERSION, pending.nonce, proof))

    @staticmethod
    def _send(pending: _Pending, message: bytes) -> None:
        """A handshake message fits an empty socket buffer: one send takes it all."""
        try:
            sent = pending.sock.send(message)
        except OSError as exc:
            raise _Refused(f"failed during the handshake ({exc})") from None
        if sent != len(message):
            raise _Refused("does not read the handshake")

    def _expire(self) -> None:
        for pending in [p for p in self._pending.values() if p.deadline.passed()]:
            self._refuse(pending, f"sent no complete handshake within {self.handshake_s:g} s")

    def _forget(self, pending: _Pending) -> None:
        self._selector.unregister(pending.sock)
        del self._pending[pending.sock]

    def _refuse(self, pending: _Pending, why: str) -> None:
        self._forget(pending)
        pending.sock.close()
        self.refused += 1
        log.warning("asynclock[rank %d]: %s refused a connection from %s: it %s "
                    "(%d refused so far)", self.rank, self.key.mesh, pending.where, why,
                    self.refused)

    def _missing_text(self) -> str:
        missing = sorted(self.expected - self.peers.keys())
        return (f"rank {self.rank}: rank(s) {missing} did not join the {self.key.mesh} mesh "
                f"in time ({self.refused} connection(s) refused meanwhile)")
