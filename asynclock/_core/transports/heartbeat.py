"""How the watchdog's heartbeats travel: an MPI communicator, or a TCP mesh.

The watchdog (`runtime.watchdog`) sends each peer a small status every
half second and drains what arrived, from its own thread. Under MPI it has
a communicator of its own. Under `horovodrun --gloo` there is no MPI world,
and without heartbeats a lost message or a frozen rank would hang the job in
silence (invariant 2); there the heartbeats take a TCP mesh of their own
(`Mailbox`), used by the watchdog thread only, since a mailbox is not
thread-safe and the loop owns the backend's.
"""

from __future__ import annotations

import pickle
from typing import Any, Protocol

import numpy as np

from .mailbox import P2P, Mailbox

TAG = 0x4842  # the watchdog communicator's only tag


class Heartbeats(Protocol):
    """Non-blocking sends of picklable statuses, and a drain of what arrived."""

    needs_thread_multiple: bool

    def send(self, status: Any, peer: int) -> Any: ...  # a request with Test()

    def receive(self) -> list[tuple[int, Any]]: ...

    def lost(self) -> set[int]: ...  # peers whose link closed (empty where none can tell)


class MPIHeartbeats:
    """Heartbeats on a communicator of their own (`MPIBackend.watchdog_comm`)."""

    needs_thread_multiple = True

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def send(self, status: Any, peer: int) -> Any:
        return self.comm.isend(status, dest=peer, tag=TAG)

    def receive(self) -> list[tuple[int, Any]]:
        from mpi4py import MPI

        status, got = MPI.Status(), []
        while (msg := self.comm.improbe(MPI.ANY_SOURCE, TAG, status)) is not None:
            got.append((status.Get_source(), msg.recv()))
        return got

    def lost(self) -> set[int]:
        """MPI reports no closed link: a lost peer is one that falls silent."""
        return set()


class MailboxHeartbeats:
    """Heartbeats on a TCP mesh of their own (no MPI world: `horovodrun --gloo`)."""

    needs_thread_multiple = False

    def __init__(self, box: Mailbox) -> None:
        self.box, self.port = box, box.port(0)

    def send(self, status: Any, peer: int) -> Any:
        return self.port.isend(np.frombuffer(pickle.dumps(status), np.uint8), peer)

    def receive(self) -> list[tuple[int, Any]]:
        self.box.pump()
        inbox = self.box.inboxes[self.port.base + P2P]
        got = [(peer, pickle.loads(payload)) for peer, payload in inbox]
        inbox.clear()
        return got

    def lost(self) -> set[int]:
        """Peers whose connection closed (read by `receive`): their process ended."""
        return set(self.box.dead)

    def close(self) -> None:
        self.box.close()
