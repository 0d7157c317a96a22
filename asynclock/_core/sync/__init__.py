"""Cross-rank async primitives: Lock, Semaphore, Condition, Event, sequential
sections and named consistency points, on asyncio and trio.

Design (`bench/sync.py` measures it): each lock-like primitive has a home rank
(crc32(name) % size) whose per-coordinator message pump keeps its state (a
FIFO queue and its holders); other ranks reach it with point-to-point
messages on the sync lane's own communicator. Requests on the home rank
itself never touch MPI. A permit granted to another rank while nobody else
waits comes with a lease (lock caching, see `_manager`): uncontended use
from any rank then costs no messages at all; a RECALL takes it back as soon
as anyone else asks.

MPI RMA (mpi4py.util.sync's MCS lock) is the alternative: it is fast
while nobody else runs (shared-memory atomics need no help from the
target), but passive-target progress across nodes needs the target inside
MPI or a progress thread, an RMA wait cannot be awaited without spinning,
and withdrawing a queued MCS waiter is not expressible (its predecessor
will write to it later). A manager makes FIFO order, cancellation,
timeouts and diagnostics plain state transitions.

Failures: every wait has an optional `timeout` (CollectiveTimeout naming
the primitive, the holder ranks and the waiting ranks). A wait without one
probes the ranks it depends on every `stall_s` (ASYNCLOCK_SYNC_STALL_S,
30 s): the home rank (INFO round trip), each holder, the predecessor of a
sequential section, every rank for a consistency point. A rank whose pump
does not answer a PING within `probe_s` (ASYNCLOCK_SYNC_PROBE_S, 10 s) is
reported as dead or blocked with RankFailedError naming it; live ranks only
produce a warning. (A rank killed outright usually takes the whole MPI job
down with it; the probes catch the rank that hangs, is stopped, or whose
event loop is blocked.) A rank that exits returns its idle leases first.

Create primitives through the coordinator: `coord.lock(name)`,
`coord.semaphore(name, n)`, `coord.condition(name)`, `coord.event(name)`,
`coord.sequential(name)`, `coord.consistency_point(name)`.
"""

from __future__ import annotations

from ._factories import SyncPrimitives
from ._permits import PermitInfo, PermitStatistics
from ._service import SyncPolicy, SyncService
from .barrier import ConsistencyPoint, ConsistencyStatistics
from .condition import Condition, ConditionStatistics
from .event import Event, EventStatistics
from .lock import Lock, LockStatistics
from .semaphore import Semaphore, SemaphoreStatistics
from .sequential import Sequential, SequentialStatistics

__all__ = [
    "Condition", "ConditionStatistics", "ConsistencyPoint", "ConsistencyStatistics", "Event",
    "EventStatistics", "Lock", "LockStatistics", "PermitInfo", "PermitStatistics", "Semaphore",
    "SemaphoreStatistics", "Sequential", "SequentialStatistics", "SyncPolicy", "SyncPrimitives",
    "SyncService",
]
