"""How a helper thread waits for an MPI request: tests with the backoff, sleeps between.

MPI's blocking calls wait by polling their progress engine without pause: a
wait thread sitting in one while a peer is late (a rank still in backward, a
slow host) keeps a core busy for as long as the peer takes, the core the
backward pass or the optimizer step it overlaps needs. So before a bulk stage's
blocking call the wait thread waits here for an `Ibarrier` (`mpi.BulkChannel`,
the node window's step across nodes): a test, then a sleep in the kernel whose
length grows with the time waited (`base.backoff`: `SHARE` of it, from `MIN_S`
to `MAX_S`), so a wait costs a few tests per millisecond, whatever its length,
and ends at most a few percent of it late.

The data itself still moves in MPI's blocking call: its non-blocking twin moves
data only inside a test, and tested this sparsely it is several times slower
across TCP hosts (figures: the benchmarks page).
"""

from __future__ import annotations

from typing import Any

from ..base.backoff import Backoff, poll_until

__all__ = ["MAX_S", "MIN_S", "SHARE", "settle"]

MIN_S = 50e-6
MAX_S = 1e-3
SHARE = 0.05


def settle(request: Any) -> None:
    """Until `request` (an mpi4py request) completes; its error is raised here."""
    poll_until(request.Test, Backoff(MIN_S, MAX_S, share=SHARE))
