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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

# HostUpdateResult's bits, as Horovod's driver sends them
REMOVED, ADDED = 1, 2
_RENDEZVOUS_ENV = "HOROVOD_GLOO_RENDEZVOUS_ADDR"


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
