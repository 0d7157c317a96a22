"""Only the job's ranks get into the sockets asynclock opens (docs/guide/security.md).

In-process: the mesh handshake (`transports.handshake`) against foreign
clients of every kind, a flood past its cap on pending handshakes and every
transient `accept()` error, the frame checks of an authenticated mesh, and the
address torch's store for the gloo bulk path listens on. Jobs: `horovodrun
--gloo` at 2 and 3 ranks with ASYNCLOCK_MESH_HOLD, so the test's clients reach
the ranks' mesh listeners before any real peer; the jobs must finish with
correct results, refuse every client in one log line each, load nothing a
client sent, and listen on loopback only; a rank out of file descriptors
(RLIMIT_NOFILE lowered) under a flood still joins; and the ranks and their
children open no listener but asynclock's and Horovod's, all on the address
the peers were told (no MPI singleton: the job's backend is not MPI).
"""

from __future__ import annotations

import errno
import hmac
import json
import logging
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from listeners import Listener, listeners, without_launcher
from mpijob import (
    DEFAULT_KIND,
    Job,
    assert_labels,
    horovodrun_missing,
    mpi_select,
    processes_with,
    run_horovodrun,
)
from test_horovod import _mesh

from asynclock._core.base.backoff import Deadline
from asynclock._core.base.errors import BackendError
from asynclock._core.transports import handshake
from asynclock._core.transports.handshake import Acceptor, MeshKey, connect
from asynclock._core.transports.mailbox import LISTEN_BACKLOG, MAX_FRAME_BYTES, P2P

SECRET = bytes(range(32))
HELLO = struct.Struct("<4sHxxii32s")  # the handshake's first message, as a client forges it
OLD_ID = struct.Struct("<q")  # what a connecting rank sent before the handshake existed
FRAME = struct.Struct("<iI")
LOOPBACK_HEX = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


class Plant:
    """Unpickling this creates `path`: proof that something loaded a client's bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


# -- foreign clients: each connects, does its one wrong thing, and keeps its socket --
def hello(claimed: int, called: int, *, magic: bytes = b"ALKM", version: int = 1) -> bytes:
    return HELLO.pack(magic, version, claimed, called, os.urandom(32))


def impostor(claimed: int, marker: Path) -> Callable[[socket.socket, int], None]:
    """A rank id as ranks sent it before the handshake, then frames of every stream
    kind whose payload plants `marker` when unpickled."""
    def attack(sock: socket.socket, rank: int) -> None:
        bomb = pickle.dumps(Plant(marker))
        frames = b"".join(FRAME.pack(stream, len(bomb)) + bomb for stream in range(8))
        sock.sendall(OLD_ID.pack(claimed) + frames)
    return attack


def wrong_secret(claimed: int) -> Callable[[socket.socket, int], None]:
    """The whole handshake, with a key of its own."""
    def attack(sock: socket.socket, rank: int) -> None:
        first = hello(claimed, rank)
        sock.sendall(first)
        challenge = b""
        while len(challenge) < 72:
            chunk = sock.recv(72 - len(challenge))
            if not chunk:
                return
            challenge += chunk
        sock.sendall(hmac.digest(os.urandom(32), first + challenge[8:40], "sha256"))
    return attack


def send(data: bytes, close: bool = False) -> Callable[[socket.socket, int], None]:
    """`data`, then silence (or the end of the stream: `close`)."""
    def attack(sock: socket.socket, rank: int) -> None:
        sock.sendall(data)
        if close:
            sock.shutdown(socket.SHUT_WR)
    return attack


def blind_proof(claimed: int, called: int) -> Callable[[socket.socket, int], None]:
    """A hello and a made-up proof at once, without waiting for the challenge."""
    return send(hello(claimed, called) + os.urandom(32))


def oversize(claimed: int) -> Callable[[socket.socket, int], None]:
    """A hello, then at once a frame header of 1 GiB and 4 MiB of its bytes."""
    def attack(sock: socket.socket, rank: int) -> None:
        sock.sendall(hello(claimed, rank) + FRAME.pack(0, 1 << 30) + bytes(4 << 20))
    return attack


class Intruder:
    """One foreign client in a thread; its socket stays open until `release`."""

    def __init__(self, address: tuple[str, int], rank: int,
                 attack: Callable[[socket.socket, int], None]) -> None:
        self.address, self.rank, self.attack = address, rank, attack
        self.connected = threading.Event()  # in the listener's backlog from here on
        self.sent = threading.Event()  # its attack's bytes are in the socket's buffers
        self.port = ""  # its own port, as the acceptor's log lines name it
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            with socket.create_connection(self.address, timeout=30) as sock:
                self.port = str(sock.getsockname()[1])
                self.connected.set()
                self.attack(sock, self.rank)
                self.sent.set()
                self._release.wait(60)
        except OSError:
            pass  # refused and closed while it still sent: as it should be

    def release(self) -> None:
        self._release.set()
        self._thread.join(10)


# -- in-process: the handshake ---------------------------------------------------------
def _acceptor(expected: set[int], handshake_s: float = 1.5) -> tuple[Acceptor, socket.socket]:
    listener = socket.create_server(("127.0.0.1", 0), backlog=LISTEN_BACKLOG)
    return Acceptor(listener, MeshKey(SECRET, "test.mesh"), 0, expected, handshake_s), listener


def _run_acceptor(acceptor: Acceptor, seconds: float) -> dict[str, object]:
    out: dict[str, object] = {}

    def serve() -> None:
        try:
            out["peers"] = acceptor.run(Deadline(seconds))
        except BackendError as exc:
            out["error"] = exc

    thread = threading.Thread(target=serve)
    thread.start()
    out["thread"] = thread
    return out


REASONS = {
    "impostor": "sent something that is not an asynclock mesh handshake",
    "wrong_secret": "claimed rank 1 without proof of the job secret",
    "stall": "sent no complete handshake within 1.5 s",
    "closed": "closed the connection during the handshake",
    "version": "speaks mesh handshake version 9, this rank 1",
    "called": "called rank 3, not this rank",
    "unexpected": "claimed rank 7, which does not connect to rank 0",
    "oversize": "claimed rank 1 without proof of the job secret",
}


def test_acceptor_refuses_every_foreign_client_and_takes_the_real_peer(
        caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Clients that connect first, of every kind, are refused in one log line each,
    while the real ranks get in; the stalled one does not hold them up."""
    acceptor, listener = _acceptor({1, 2})
    address = listener.getsockname()
    attacks = {"impostor": impostor(1, tmp_path / "planted"), "wrong_secret": wrong_secret(1),
               "stall": send(hello(1, 0)[:20]), "closed": send(hello(1, 0)[:20], close=True),
               "version": send(hello(1, 0, version=9)), "called": send(hello(1, 3)),
               "unexpected": send(hello(7, 0)), "oversize": oversize(1)}
    key = MeshKey(SECRET, "test.mesh")
    with caplog.at_level(logging.WARNING, "asynclock.transport"), listener:
        intruders = [Intruder(address, 0, attack) for attack in attacks.values()]
        assert all(intruder.connected.wait(10) for intruder in intruders)
        out = _run_acceptor(acceptor, 20)
        real = connect(address, key, 1, 0, Deadline(10))
        stalled_still = not any("within" in r.getMessage() for r in caplog.records)
        time.sleep(1.7)  # past the handshake deadline: the stalled client is refused
        second = connect(address, key, 2, 0, Deadline(10))
        out["thread"].join(10)  # type: ignore[attr-defined]
        for intruder in intruders:
            intruder.release()
    assert "error" not in out, out.get("error")
    assert set(out["peers"]) == {1, 2}, out  # type: ignore[call-overload]
    assert stalled_still, "the real peer got in only after the stalled client's deadline"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(attacks) == acceptor.refused, lines
    for name, reason in REASONS.items():
        assert any(f": it {reason} (" in line for line in lines), (name, lines)
    assert all(re.match(r"asynclock\[rank 0\]: test.mesh refused a connection from "
                        r"127\.0\.0\.1:\d+: it ", line) for line in lines), lines
    assert not (tmp_path / "planted").exists()
    assert not any(SECRET.hex() in line or repr(SECRET) in line for line in lines)
    real.close()
    second.close()


def test_acceptor_refuses_a_second_claim_of_a_connected_rank(
        caplog: pytest.LogCaptureFixture) -> None:
    """Even with the key: the second rank 1 is told no and stops with an error."""
    acceptor, listener = _acceptor({1, 2})
    address, key = listener.getsockname(), MeshKey(SECRET, "test.mesh")
    with caplog.at_level(logging.WARNING, "asynclock.transport"), listener:
        out = _run_acceptor(acceptor, 10)
        real = connect(address, key, 1, 0, Deadline(10))
        with pytest.raises(BackendError, match="rank 0 closed the connection during the mesh "
                                               "handshake: it refused this rank"):
            connect(address, key, 1, 0, Deadline(10))
        second = connect(address, key, 2, 0, Deadline(10))
        out["thread"].join(10)  # type: ignore[attr-defined]
    assert set(out["peers"]) == {1, 2}  # type: ignore[call-overload]
    assert [r.getMessage() for r in caplog.records][0].endswith(
        "it claimed rank 1, which is already connected (1 refused so far)")
    real.close()
    second.close()


def test_a_rank_without_the_secret_cannot_join_nor_be_joined() -> None:
    """Another key fails both ways, first at the connecting side (it checks the
    listener's proof before it proves anything): as the connecting rank it stops
    with an error and the mesh waits on until its deadline; as the listener, the
    connecting rank stops with the same error."""
    acceptor, listener = _acceptor({1})
    with listener:
        out = _run_acceptor(acceptor, 1.0)
        with pytest.raises(BackendError, match="rank 0 at 127.0.0.1:.* did not prove it "
                                               "belongs to this job"):
            connect(listener.getsockname(), MeshKey(b"x" * 32, "test.mesh"), 1, 0, Deadline(5))
        out["thread"].join(10)  # type: ignore[attr-defined]
    assert "did not join the test.mesh mesh in time (1 connection(s) refused" in str(
        out["error"])
    other, listener = _acceptor({1})
    other.key = MeshKey(b"x" * 32, "test.mesh")
    with listener:
        out = _run_acceptor(other, 1.0)
        with pytest.raises(BackendError, match="did not prove it belongs to this job"):
            connect(listener.getsockname(), MeshKey(SECRET, "test.mesh"), 1, 0, Deadline(5))
        out["thread"].join(10)  # type: ignore[attr-defined]
    assert other.refused == 1


class Crowd:
    """`n` idle connections to `address`, held open until `release`."""

    def __init__(self, address: tuple[str, int], n: int) -> None:
        self.sockets = [socket.create_connection(address, timeout=10) for _ in range(n)]
        self.ports = [str(sock.getsockname()[1]) for sock in self.sockets]

    def release(self) -> None:
        for sock in self.sockets:
            sock.close()


def wait_until(ready: Callable[[], bool], seconds: float = 10) -> bool:
    deadline = Deadline(seconds)
    while not ready():
        if deadline.passed():
            return False
        time.sleep(0.005)
    return True


def _log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_flood_past_the_cap_cannot_keep_the_real_peers_out(
        caplog: pytest.LogCaptureFixture) -> None:
    """200 idle connections queued ahead of the real peers: the acceptor holds at
    most the cap of them at once, refusing the oldest idle one for each that comes
    past it, and each real peer gets in at once, far within the handshake deadline."""
    flood = 200
    acceptor, listener = _acceptor({1, 2}, handshake_s=5.0)
    address, key = listener.getsockname(), MeshKey(SECRET, "test.mesh")
    assert acceptor.cap() == 2 + handshake.FOREIGN_ROOM
    with caplog.at_level(logging.WARNING, "asynclock.transport"), listener:
        crowd = Crowd(address, flood)
        out = _run_acceptor(acceptor, 20)
        took = []
        for rank in (1, 2):
            begun = time.perf_counter()
            peer = connect(address, key, rank, 0, Deadline(10))
            took.append(time.perf_counter() - begun)
            peer.close()
        out["thread"].join(10)  # type: ignore[attr-defined]
        crowd.release()
    assert "error" not in out, out.get("error")
    assert set(out["peers"]) == {1, 2}, out  # type: ignore[call-overload]
    assert max(took) < 1.0, took
    lines = _log_lines(caplog)
    assert len(lines) == acceptor.refused == flood, (len(lines), acceptor.refused)
    capped = [line for line in lines if "handshakes pending at once" in line]
    # one per idle connection past the cap, and one for each real peer that came at it
    assert len(capped) == flood - handshake.FOREIGN_ROOM, (len(capped), capped[:3])
    cap = 2 + handshake.FOREIGN_ROOM
    assert capped[0].endswith(f"it had shown the least of {cap + 1} handshakes pending at "
                              f"once, {cap} the most this rank serves (1 refused so far)")
    assert all("stopped accepting" in line for line in lines if line not in capped)


def test_at_the_cap_the_connection_that_has_shown_the_least_goes_first(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing sent goes before part of a HELLO, which goes before a whole HELLO
    awaiting its proof; among equals the oldest goes. The real peer, whose HELLO
    comes with its connection, is never the one."""
    monkeypatch.setattr(handshake, "FOREIGN_ROOM", 2)
    acceptor, listener = _acceptor({1}, handshake_s=5.0)
    address, key = listener.getsockname(), MeshKey(SECRET, "test.mesh")
    with caplog.at_level(logging.WARNING, "asynclock.transport"), listener:
        forged = Intruder(address, 0, send(hello(1, 0)))  # a whole HELLO, then no proof
        assert forged.sent.wait(10)
        partial = Intruder(address, 0, send(hello(1, 0)[:20]))
        assert partial.sent.wait(10)
        idle = Crowd(address, 2)  # the cap is 3: the fourth connection refuses one
        out = _run_acceptor(acceptor, 10)
        assert wait_until(lambda: acceptor.refused == 1)
        time.sleep(0.1)  # nothing more is refused before the real peer comes
        first = _log_lines(caplog)
        real = connect(address, key, 1, 0, Deadline(5))
        out["thread"].join(10)  # type: ignore[attr-defined]
        for client in (forged, partial):
            client.release()
        idle.release()
    assert set(out["peers"]) == {1}, out  # type: ignore[call-overload]
    lines = _log_lines(caplog)
    ports = idle.ports
    assert len(first) == 1 and first[0].split(": it ")[0].endswith(ports[0]), (first, ports)
    assert "had shown the least of 4 handshakes pending at once, 3 the most" in first[0]
    assert lines[1].split(": it ")[0].endswith(ports[1]), lines
    assert "had shown the least of 4 handshakes pending at once" in lines[1], lines
    assert len(lines) == 4 and all("stopped accepting" in line for line in lines[2:]), lines
    real.close()


def test_a_real_peer_counts_by_the_hello_it_sent_with_its_connection(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """At the cap with forged HELLOs awaiting their proofs, a real peer that comes
    is read as it is accepted: it has shown as much as they have and is the newest,
    so the oldest forged one goes, not the peer."""
    monkeypatch.setattr(handshake, "FOREIGN_ROOM", 2)
    acceptor, listener = _acceptor({1}, handshake_s=5.0)
    address, key = listener.getsockname(), MeshKey(SECRET, "test.mesh")
    with caplog.at_level(logging.WARNING, "asynclock.transport"), listener:
        forged = []
        for _ in range(3):  # one after the other: their HELLOs arrive in this order
            forged.append(Intruder(address, 0, send(hello(1, 0))))
            assert forged[-1].sent.wait(10)
        hello_sent = threading.Event()
        monkeypatch.setattr(handshake.socket, "create_connection",
                            _reporting_first_send(socket.create_connection, hello_sent))
        real: dict[str, object] = {}
        peer = threading.Thread(target=lambda: real.update(
            sock=connect(address, key, 1, 0, Deadline(10))))
        peer.start()
        assert hello_sent.wait(10)  # accepted after its HELLO is in, as a real peer is
        out = _run_acceptor(acceptor, 10)
        out["thread"].join(10)  # type: ignore[attr-defined]
        peer.join(10)
        for client in forged:
            client.release()
    assert set(out["peers"]) == {1}, out  # type: ignore[call-overload]
    lines = _log_lines(caplog)
    assert "had shown the least of 4 handshakes pending at once" in lines[0], lines
    assert lines[0].split(": it ")[0].endswith(forged[0].port), (lines, forged[0].port)
    assert len(lines) == 3, lines
    real["sock"].close()  # type: ignore[attr-defined]


class _FirstSendReported:
    """A connecting socket that sets `sent` once its first message is in its buffers."""

    def __init__(self, sock: socket.socket, sent: threading.Event) -> None:
        self._sock, self._sent = sock, sent

    def sendall(self, data: bytes) -> None:
        self._sock.sendall(data)
        self._sent.set()

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def _reporting_first_send(create: Callable[..., socket.socket],
                          sent: threading.Event) -> Callable[..., object]:
    return lambda *args, **kwargs: _FirstSendReported(create(*args, **kwargs), sent)


class FlakyListener:
    """A listening socket whose accept() first fails as `errors` say, one a call;
    selectors see the real socket, so it is called only when a connection waits."""

    def __init__(self, real: socket.socket, errors: list[int | None]) -> None:
        self.real, self.errors = real, list(errors)

    def fileno(self) -> int:
        return self.real.fileno()

    def setblocking(self, flag: bool) -> None:
        self.real.setblocking(flag)

    def accept(self) -> tuple[socket.socket, object]:
        if self.errors:
            code = self.errors.pop(0)
            if code is not None:
                raise OSError(code, os.strerror(code))
        return self.real.accept()


TRANSIENT = [errno.ECONNABORTED, errno.EPROTO, errno.ENETDOWN, errno.EHOSTUNREACH,
             errno.EPERM, errno.ETIMEDOUT]
OUT_OF_RESOURCES = [errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM]


def test_the_acceptor_survives_every_transient_accept_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """Two idle clients are accepted, then accept() fails every way it can while the
    real peer waits in the queue: out of descriptors the acceptor refuses an idle
    client to free one (the oldest first), with none left it waits a moment; each
    kind of error is one log line however often it comes; the real peer gets in."""
    acceptor, listener = _acceptor({1}, handshake_s=5.0)
    address, key = listener.getsockname(), MeshKey(SECRET, "test.mesh")
    errors: list[int | None] = [None, None, errno.EMFILE, *TRANSIENT, *TRANSIENT,
                                errno.ENFILE, *OUT_OF_RESOURCES, *OUT_OF_RESOURCES]
    acceptor.listener = FlakyListener(listener, errors)  # type: ignore[assignment]
    with caplog.at_level(logging.WARNING, "asynclock.transport"), listener:
        idle = Crowd(address, 2)
        out = _run_acceptor(acceptor, 20)
        real = connect(address, key, 1, 0, Deadline(15))
        out["thread"].join(10)  # type: ignore[attr-defined]
        idle.release()
    assert "error" not in out, out.get("error")
    assert set(out["peers"]) == {1}, out  # type: ignore[call-overload]
    kinds = len(TRANSIENT) + len(OUT_OF_RESOURCES)
    assert acceptor.accept_errors == len(errors) - 2, acceptor.accept_errors
    lines = _log_lines(caplog)
    failed = [line for line in lines if "could not accept a connection" in line]
    assert len(failed) == kinds, failed
    for code in TRANSIENT + OUT_OF_RESOURCES:
        assert sum(f"[Errno {code}] {os.strerror(code)})" in line for line in failed) == 1
    refused = [line for line in lines if "refused a connection" in line]
    ports = idle.ports
    assert [line.split(": it ")[0].rsplit(":", 1)[1] for line in refused] == ports, refused
    assert all("had shown the least of" in line and "ran out of descriptors" in line
               for line in refused), refused
    real.close()


def test_a_broken_listener_ends_the_mesh_at_once() -> None:
    """EBADF and its kind say the listener itself is gone: no point waiting on."""
    acceptor, listener = _acceptor({1})
    acceptor.listener = FlakyListener(listener, [errno.EBADF])  # type: ignore[assignment]
    with listener:
        idle = Crowd(listener.getsockname(), 1)
        out = _run_acceptor(acceptor, 10)
        out["thread"].join(10)  # type: ignore[attr-defined]
        idle.release()
    assert "listener failed: [Errno 9]" in str(out["error"]), out


def test_the_key_shows_nowhere() -> None:
    key = MeshKey(SECRET, "job.mailbox")
    assert repr(key) == str(key) == "MeshKey('job.mailbox')"
    assert not hasattr(key, "__dict__")
    with pytest.raises(ValueError, match="at least 16 bytes"):
        MeshKey(b"short", "job.mailbox")


# -- in-process: frames on an authenticated mesh ---------------------------------------------
@pytest.mark.parametrize("frame, why", [
    (FRAME.pack(0, MAX_FRAME_BYTES + 1), f"sent a {MAX_FRAME_BYTES + 1}-byte frame, over"),
    (FRAME.pack(-5, 4) + b"abcd", "sent a frame on stream -5, not a stream of this mesh"),
    (FRAME.pack(1 << 30, 4) + b"abcd", f"sent a frame on stream {1 << 30}, not a stream"),
], ids=["oversize", "negative stream", "stream past the mesh's"])
def test_a_broken_frame_ends_that_peers_connection(frame: bytes, why: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Checked before it is used: nothing of it reaches an inbox, the peer counts as
    gone with the reason, and the other peers carry on."""
    boxes = _mesh(3)
    try:
        ports = [b.port(0) for b in boxes]
        with caplog.at_level(logging.WARNING, "asynclock.transport"):
            boxes[1]._peers[0].sendall(frame)
            ports[2].isend(np.array([42], np.int64), 0)
            for _ in range(20_000):
                boxes[0].pump()
                if 1 in boxes[0].dead and boxes[0].inboxes[P2P]:
                    break
                time.sleep(0.0005)
        assert boxes[0].broken[1].startswith(why[:40]), boxes[0].broken
        assert [source for source, _ in boxes[0].inboxes[P2P]] == [2]
        assert [r.getMessage() for r in caplog.records] == [
            f"asynclock[rank 0]: test.mailbox: rank 1 {boxes[0].broken[1]}; its connection "
            "is closed"]
        with pytest.raises(BackendError, match=re.escape(why[:30])):
            ports[0].isend(np.ones(1, np.int64), 1)
    finally:
        for b in boxes:
            b.close()


def test_a_message_over_the_frame_limit_is_not_sent() -> None:
    boxes = _mesh(2)
    try:
        with pytest.raises(BackendError, match="carries at most"):
            boxes[0].port(0).isend(np.zeros(MAX_FRAME_BYTES // 8 + 1, np.int64), 1)
    finally:
        for b in boxes:
            b.close()


# -- where the listeners are bound -----------------------------------------------------------
def listening(port: int) -> list[str]:
    """The local addresses (hex, as the kernel writes them) of the listeners on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            host, hex_port = fields[1].split(":")
            if fields[3] == "0A" and int(hex_port, 16) == port:
                found.append(host)
    return found


def test_the_gloo_bulk_store_listens_on_the_address_it_gives_out() -> None:
    """torch's TCPStore binds every interface by itself; rank 0's store for the gloo
    bulk path and the device path (`process_group`) listens on loopback within one node,
    on the host's address across."""
    pytest.importorskip("torch.distributed")
    from asynclock._core.transports import process_group

    for spans, want in ((False, "127.0.0.1"), (True, socket.gethostbyname(socket.gethostname()))):
        served = process_group.serve(2, spans)
        assert served is not None, spans
        (addr, port), store = served
        assert addr == want, addr
        want_hex = socket.inet_aton(want)[::-1].hex().upper()
        assert listening(port) == [want_hex], (addr, port, listening(port))
        del served, store  # closed with its last reference: nothing listens there any more
        for _ in range(100):  # the store's own thread closes the socket
            if not listening(port):
                break
            time.sleep(0.02)
        assert listening(port) == [], (addr, port, listening(port))


def test_the_fast_path_starts_no_mpi_where_none_is_up() -> None:
    """Asked for the C rounds where MPI is not up, the fast path answers None and
    imports nothing (mpi4py's MPI would initialise MPI); once MPI is up it loads."""
    code = ("import sys\nimport asynclock._core.engine.fastpath as f\n"
            "print(f.module() is None, 'mpi4py.MPI' in sys.modules)\n"
            "from mpi4py import MPI\n"
            "print(f.mpi_up(), f.module() is not None or not f.built_path().exists())\n")
    env = {**mpi_select.environ_for(DEFAULT_KIND), "ASYNCLOCK_FASTPATH": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.stdout.split() == ["True", "False", "True", "True"], done


# -- jobs ------------------------------------------------------------------------------------
def wait_for(paths: list[Path], job_done: threading.Event, seconds: float = 90) -> bool:
    deadline = Deadline(seconds)
    while not all(p.exists() for p in paths):
        if job_done.is_set() or deadline.passed():
            return False
        time.sleep(0.05)
    return True


Attacks = dict[tuple[str, int], list[tuple[str, Callable[[socket.socket, int], None]]]]


SETTLE_S = 0.3  # rank 0 serves its clients while the others hold: this long before the go


Crowds = dict[tuple[str, int], int]


def run_with_intruders(nranks: int, attacks: Attacks, tmp_path: Path, stall_s: float = 0.0,
                       crowds: Crowds | None = None,
                       more_env: dict[str, str] | None = None) -> tuple[Job, list[str]]:
    """A trust_mesh.py job whose mesh listeners meet `attacks` first: per (mesh, rank),
    (reason, attack), and `crowds`: per (mesh, rank), how many idle connections. Rank 0
    serves its clients as they come; the other ranks hold until the test's go, so theirs
    wait in the listen backlog ahead of every real peer. `stall_s`: added time before
    the mailbox mesh's go (a stalled client's deadline)."""
    hold, marker = tmp_path / "hold", tmp_path / "planted"
    hold.mkdir()
    env = {"ASYNCLOCK_MESH_HOLD": str(hold), "ASYNCLOCK_HANDSHAKE_S": "1",
           "ASYNCLOCK_HEARTBEAT_S": "0.1", **(more_env or {})}
    result: dict[str, Job] = {}
    done = threading.Event()

    def job() -> None:
        try:
            result["job"] = run_horovodrun("trust_mesh.py", nranks, str(marker), gloo=True,
                                           timeout=120, env=env)
        finally:
            done.set()

    runner = threading.Thread(target=job)
    runner.start()
    intruders: list[Intruder] = []
    held: list[Crowd] = []
    problems: list[str] = []
    try:
        for mesh in ("mailbox", "heartbeat"):
            announced = [hold / f"asynclock0.{mesh}.{r}" for r in range(nranks)]
            if not wait_for(announced, done):
                problems.append(f"the {mesh} listeners were never announced")
                break
            addresses = [(host, int(port)) for host, port in
                         (p.read_text().split() for p in announced)]
            problems += [f"{mesh} rank {r} listens on {listening(port)}, not loopback only"
                         for r, (_, port) in enumerate(addresses)
                         if listening(port) != [LOOPBACK_HEX]]
            for (target, rank), planned in attacks.items():
                if target == mesh:
                    intruders += [Intruder(addresses[rank], rank, a) for _, a in planned]
            held += [Crowd(addresses[rank], n) for (target, rank), n in (crowds or {}).items()
                     if target == mesh]
            problems += [f"{mesh}: a client could not connect"
                         for i in intruders if not i.connected.wait(10)]
            time.sleep(SETTLE_S + (stall_s if mesh == "mailbox" else 0.0))
            (hold / f"go.asynclock0.{mesh}").touch()
    finally:
        for mesh in ("mailbox", "heartbeat"):
            (hold / f"go.asynclock0.{mesh}").touch()
        runner.join(150)
        for intruder in intruders:
            intruder.release()
        for crowd in held:
            crowd.release()
    assert not marker.exists(), "a foreign client's pickle was loaded"
    return result["job"], problems


def assert_refusals(job: Job, attacks: Attacks) -> None:
    """One log line per client, on the rank and mesh it tried; each rank's count."""
    for (mesh, rank), planned in attacks.items():
        lines = re.findall(rf"asynclock\[rank {rank}\]: asynclock0\.{mesh} refused a "
                           rf"connection from 127\.0\.0\.1:\d+: it (.*) \(\d+ refused so far\)",
                           job.output)
        assert sorted(lines) == sorted(reason for reason, _ in planned), (
            mesh, rank, lines, job.explain())
    for rank in {r for _, r in attacks}:
        total = sum(len(p) for (_, r), p in attacks.items() if r == rank)
        assert f"RANK {rank} OK refused {total}\n" in job.output, job.explain()


def need_gloo() -> None:
    if why := horovodrun_missing(gloo=True):
        pytest.skip(why)


@pytest.mark.mpi
@pytest.mark.horovod
def test_foreign_clients_first_at_two_ranks(tmp_path: Path) -> None:
    """Rank 0 meets an impostor that claims rank 1 and sends frames (a pickle that
    plants a file when loaded), a client with its own key, a stalled one, an
    oversize one, then on the heartbeat mesh more of each kind; the job runs."""
    need_gloo()
    marker = tmp_path / "planted"
    attacks: Attacks = {
        ("mailbox", 0): [(REASONS["impostor"], impostor(1, marker)),
                         (REASONS["wrong_secret"], wrong_secret(1)),
                         ("sent no complete handshake within 1 s", send(hello(1, 0)[:20])),
                         (REASONS["oversize"], oversize(1))],
        ("heartbeat", 0): [(REASONS["impostor"], impostor(1, marker)),
                           ("speaks mesh handshake version 9, this rank 1",
                            send(hello(1, 0, version=9))),
                           ("claimed rank 5, which does not connect to rank 0",
                            send(hello(5, 0)))],
    }
    job, problems = run_with_intruders(2, attacks, tmp_path, stall_s=2.0)
    assert not problems, problems
    assert_labels(job, 2, "collectives")
    assert_refusals(job, attacks)


@pytest.mark.mpi
@pytest.mark.horovod
def test_foreign_clients_first_at_three_ranks(tmp_path: Path) -> None:
    """Rank 1 accepts rank 2 only after connecting to rank 0: its clients wait in its
    backlog ahead of the real rank 2 and are refused when it gets to them."""
    need_gloo()
    marker = tmp_path / "planted"
    attacks: Attacks = {
        ("mailbox", 0): [("called rank 1, not this rank", send(hello(2, 1))),
                         (REASONS["impostor"], impostor(2, marker))],
        ("mailbox", 1): [(REASONS["impostor"], impostor(2, marker)),
                         ("claimed rank 2 without proof of the job secret", blind_proof(2, 1))],
        ("heartbeat", 1): [("claimed rank 0, which does not connect to rank 1",
                            send(hello(0, 1))),
                           (REASONS["closed"], send(hello(2, 1)[:30], close=True)),
                           (REASONS["impostor"], impostor(2, marker))],
    }
    job, problems = run_with_intruders(3, attacks, tmp_path)
    assert not problems, problems
    assert_labels(job, 3, "collectives")
    assert_refusals(job, attacks)


FLOOD = 200  # idle connections on each flooded listener: past the cap, and the rank's descriptors


def refusals(job: Job, mesh: str, rank: int) -> list[str]:
    return re.findall(rf"asynclock\[rank {rank}\]: asynclock0\.{mesh} refused a connection "
                      rf"from 127\.0\.0\.1:\d+: it (.*) \(\d+ refused so far\)", job.output)


@pytest.mark.mpi
@pytest.mark.horovod
@pytest.mark.parametrize("nranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_flood_on_a_rank_out_of_descriptors(nranks: int, tmp_path: Path) -> None:
    """200 idle connections on both meshes of rank 0, whose RLIMIT_NOFILE leaves it a
    few dozen descriptors: accept() fails with EMFILE, reported once per mesh, and
    each time the acceptor refuses the idle connection that has shown the least to
    free one, so the real peers get in and the job runs. At 3 ranks rank 1 keeps its
    descriptors and meets the flood with its cap instead: the flood waits in its
    backlog, ahead of rank 2, until it accepts."""
    need_gloo()
    crowds: Crowds = {("mailbox", 0): FLOOD, ("heartbeat", 0): FLOOD}
    if nranks == 3:
        crowds.update({("mailbox", 1): FLOOD, ("heartbeat", 1): FLOOD})
    job, problems = run_with_intruders(nranks, {}, tmp_path, crowds=crowds,
                                       more_env={"TRUST_MESH_NOFILE": "0:40"})
    assert not problems, problems
    assert_labels(job, nranks, "collectives")
    for (mesh, rank), n in crowds.items():
        lines = refusals(job, mesh, rank)
        assert len(lines) == n, (mesh, rank, len(lines), job.explain())
        out_of_fds = [line for line in lines if "ran out of descriptors" in line]
        capped = [line for line in lines if "handshakes pending at once" in line]
        failed = re.findall(rf"asynclock\[rank {rank}\]: asynclock0\.{mesh} could not accept "
                            r"a connection \((.*?)\)", job.output)
        if rank == 0:
            assert failed == ["[Errno 24] Too many open files"], (mesh, failed, job.explain())
            assert out_of_fds and not capped, (mesh, lines[:5], job.explain())
        else:
            assert not failed and not out_of_fds, (mesh, failed, job.explain())
            assert len(capped) >= n - (nranks - 1 - rank) - 64, (mesh, len(capped))
    for rank in {r for _, r in crowds}:
        total = sum(n for (_, r), n in crowds.items() if r == rank)
        assert f"RANK {rank} OK refused {total}\n" in job.output, job.explain()


class Watch:
    """Every listener the processes carrying `token` and their children hold, each with
    when it was first seen, looked up every WATCH_S in a thread (horovodrun's own
    process left out: its rendezvous server is the launcher's)."""

    WATCH_S = 0.003

    def __init__(self, token: str) -> None:
        self.token = token
        self.seen: dict[int, tuple[float, Listener]] = {}  # by inode
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def look(self) -> None:
        # A listener is dated by when the look began: it was open at some moment of the
        # look, and a look of a loaded machine can outlast the opening of a mesh, so the
        # end would date a listener Horovod opened and closed in its init after it.
        now = time.monotonic()
        try:
            found = listeners(without_launcher(processes_with(self.token)))
        except OSError:  # a process ended while it was read
            return
        with self._lock:
            for listener in found:
                self.seen.setdefault(listener.inode, (now, listener))

    def _run(self) -> None:
        while not self._stop.wait(self.WATCH_S):
            self.look()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.mark.mpi
@pytest.mark.horovod
@pytest.mark.parametrize("nranks", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_gloo_ranks_listen_only_where_their_peers_were_told(nranks: int,
                                                            tmp_path: Path) -> None:
    """From the job's start to its end, the ranks of a `horovodrun --gloo` job and the
    processes they start hold no listener but asynclock's meshes and Horovod's gloo
    pairs (opened in its init, before asynclock's first), all on the address the
    peers were told (127.0.0.1: one host), and mpi4py's MPI is never loaded. An MPI
    singleton's daemon and transports, on every interface, would show here."""
    need_gloo()
    hold = tmp_path / "hold"
    hold.mkdir()
    result: dict[str, Job] = {}
    done = threading.Event()

    def job() -> None:
        try:
            result["job"] = run_horovodrun("open_ports.py", nranks, str(tmp_path), gloo=True,
                                           timeout=120, env={"ASYNCLOCK_MESH_HOLD": str(hold)})
        finally:
            done.set()

    watch = Watch(str(tmp_path))
    runner = threading.Thread(target=job)
    runner.start()
    meshes: dict[tuple[int, int], str] = {}  # (rank, port) -> mesh
    first_mesh: dict[int, float] = {}  # rank -> when its first mesh listener was announced
    try:
        for mesh in ("mailbox", "heartbeat"):
            announced = [hold / f"asynclock0.{mesh}.{r}" for r in range(nranks)]
            assert wait_for(announced, done), f"the {mesh} listeners were never announced"
            for rank, path in enumerate(announced):
                host, port = path.read_text().split()
                assert host == "127.0.0.1", (mesh, rank, host)
                meshes[(rank, int(port))] = mesh
                first_mesh.setdefault(rank, path.stat().st_mtime - time.time()
                                      + time.monotonic())
            watch.look()  # while the ranks hold, every listener of this mesh is open
            (hold / f"go.asynclock0.{mesh}").touch()
        states = [tmp_path / f"rank.{r}" for r in range(nranks)]
        assert wait_for(states, done), "the ranks never said they had started"
        watch.look()
        (tmp_path / "go").touch()
    finally:
        for mesh in ("mailbox", "heartbeat"):
            (hold / f"go.asynclock0.{mesh}").touch()
        (tmp_path / "go").touch()
        runner.join(150)
        watch.stop()
    job = result["job"]
    assert_labels(job, nranks, "started")
    ranks = [json.loads(path.read_text()) for path in states]
    rank_of = {state["pid"]: r for r, state in enumerate(ranks)}
    problems, owners = [], {}
    for inode, (at, listener) in watch.seen.items():
        rank = rank_of.get(listener.pid)
        if rank is None:
            problems.append(f"{listener.row()} is not a rank's")
            continue
        if listener.address != "127.0.0.1":
            problems.append(f"{listener.row()} (rank {rank}) is not on 127.0.0.1")
        if (rank, listener.port) in meshes:
            owners[inode] = f"asynclock {meshes[(rank, listener.port)]}"
        elif inode in ranks[rank]["horovod"] or at < first_mesh[rank]:
            owners[inode] = "horovod"
        else:
            problems.append(f"{listener.row()} (rank {rank}) is neither asynclock's nor "
                            f"Horovod's (first seen {at - first_mesh[rank]:+.3f} s from the "
                            "rank's first mesh listener)")
    assert not problems, (problems, job.explain())
    mesh_seen = {(rank_of[lis.pid], lis.port) for _, lis in watch.seen.values()
                 if lis.pid in rank_of}
    assert set(meshes) <= mesh_seen, (meshes, mesh_seen)  # the watch saw what was there
    assert not any(state["mpi4py"] for state in ranks), ranks
