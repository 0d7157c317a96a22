"""What Horovod's elastic driver tells a worker: hosts were added or removed.

`horovodrun --min-np/--max-np --host-discovery-script S` runs the script every
second; when the hosts it prints would change the world, the driver sends a
note to the worker holding rank 0, over a small service each worker registers
with the driver's rendezvous server (`horovod.common.elastic.notification_manager`,
Horovod's own, so a job that also uses `horovod.torch.elastic` runs one
service). The note arrives on the service's thread; the listener only queues
it, and rank 0 tells the other ranks at the next commit (`runtime.elastic`).

Outside an elastic launch (no rendezvous server in the environment) nothing
registers and no note ever comes.

`GlooSockets` ends the connections Horovod's gloo leaves open after
`hvd.shutdown()`, so that the peers of a rank that leaves a world do not wait
out gloo's timeout in a receive from it (see the class).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Protocol

_TCP = (socket.AF_INET, socket.AF_INET6)
# HostUpdateResult's bits, as Horovod's driver sends them
REMOVED, ADDED = 1, 2
_RENDEZVOUS_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"
_RENDEZVOUS_PORT_ENV = "HOROVOD_GLOO_RENDEZVOUS_PORT"


class HostListener(Protocol):
    def on_hosts_updated(self, timestamp: float, update_res: int) -> None: ...


def listen_for_host_updates(listener: HostListener, environ: dict[str, str]) -> Callable[[], None]:
    """Register `listener` for the driver's notes; returns what unregisters it."""
    if not environ.get(_RENDEZVOUS_ENV):
        return lambda: None
    from horovod.common.elastic import notification_manager

    notification_manager.init()
    notification_manager.register_listener(listener)
    return lambda: notification_manager.remove_listener(listener)


def driver_unreachable(environ: dict[str, str], timeout: float) -> str | None:
    """Why the elastic driver's rendezvous server cannot be reached from here (None
    where it can, or where there is none).

    A rank cut off from the others is usually cut off from the driver too. Its
    next `hvd.init()` would wait in C for a rendezvous it cannot reach, and the
    driver, which forms the next world only once every rank of the last one
    came back or ended, would wait for it. Asked before that init, a connection
    that does not open within `timeout` tells the rank to leave instead.
    """
    host, port = environ.get(_RENDEZVOUS_ENV), environ.get(_RENDEZVOUS_PORT_ENV)
    if not host or not port:
        return None
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        return f"Horovod's elastic driver at {host}:{port} does not answer ({exc})"
    return None


# -- Horovod's gloo sockets outlive hvd.shutdown() ------------------------------------------
def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> `socket:[inode]`."""
    found: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile, or the listing's own descriptor
            continue
        if target.startswith("socket:"):
            found[int(name)] = target
    return found


class GlooSockets:
    """The sockets Horovod's gloo opened in `hvd.init()`, to end their connections once
    `hvd.shutdown()` returned.

    Horovod 0.28 keeps its gloo pairs open after shutdown, until the next init
    replaces them, and the next init waits at the elastic driver's rendezvous for
    every survivor. A survivor whose Horovod thread waits in a gloo receive from
    this rank therefore waits out HOROVOD_GLOO_TIMEOUT_SECONDS (30 s) before its
    own shutdown returns, however soon this rank left the world. Ending the
    connections (`shutdown(2)`, never `close`: the descriptors stay Horovod's to
    close) makes such a receive fail at once.

    A descriptor is ended only while it is still the socket that init opened
    (same inode), so a number reused meanwhile is left alone, and only a TCP one
    (gloo's transport): never a local socket pair such as an event loop's wake-up.
    """

    def __init__(self, before: dict[int, str]) -> None:
        self.opened = {fd: what for fd, what in _sockets().items() if before.get(fd) != what}

    @staticmethod
    def snapshot() -> dict[int, str]:
        """Call before `hvd.init()`; pass the result to the constructor after it."""
        return _sockets() if os.path.isdir("/proc/self/fd") else {}

    def end_connections(self) -> int:
        """After `hvd.shutdown()`: end the connections still open; how many."""
        ended = 0
        for fd, what in self.opened.items():
            try:
                if f"socket:[{os.fstat(fd).st_ino}]" != what:
                    continue  # closed, and the number reused
                sock = socket.socket(fileno=fd)
            except OSError:  # closed meanwhile (gloo's own thread may close it)
                continue
            try:
                if sock.family in _TCP and sock.type == socket.SOCK_STREAM:
                    sock.shutdown(socket.SHUT_RDWR)
                    ended += 1
            except OSError:  # a listener, or a pair the peer already closed
                pass
            finally:
                sock.detach()
        return ended
