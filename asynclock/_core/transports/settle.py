"""How a helper thread waits for an MPI request: tests with the backoff, sleeps between.

MPI's blocking calls wait by polling their progress engine without pause: over
TCP between hosts a blocking allreduce keeps a core busy for as long as the
wire is (about as much CPU as wall time), and over shared memory too. A wait
thread that sits in one takes that core from the backward pass or the
optimizer step it overlaps. So the bulk data stages (`mpi.BulkChannel`), the
node window's step across nodes and the 16-bit ring issue MPI's non-blocking
twin and wait here: a test, then a sleep in the kernel whose length grows
with the time waited (`base.backoff`: `SHARE` of it, from `MIN_S` to
`MAX_S`), so the CPU a wait takes is a few tests per millisecond, whatever
its length, and a completion is seen at most a few percent of its wait late.

Each test also drives MPI's progress (libraries such as Open MPI's libnbc
move data only inside MPI calls), so the ceiling is short enough that a TCP
send buffer does not drain between two tests on a fast link.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..base.backoff import Backoff, poll_until

__all__ = ["MAX_S", "MIN_S", "SHARE", "settle", "settle_all"]

MIN_S = 50e-6
MAX_S = 1e-3
SHARE = 0.05


def settle(request: Any) -> None:
    """Until `request` (an mpi4py request) completes; its error is raised here."""
    poll_until(request.Test, Backoff(MIN_S, MAX_S, share=SHARE))


def settle_all(requests: Sequence[Any]) -> None:
    """Until every one of `requests` completes (one backoff for the lot)."""
    from mpi4py import MPI

    pending = list(requests)
    poll_until(lambda: bool(MPI.Request.Testall(pending)), Backoff(MIN_S, MAX_S, share=SHARE))
