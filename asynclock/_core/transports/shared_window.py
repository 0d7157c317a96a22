"""The node's shared window: one region per local rank, each behind a control block.

Both reducers that work in shared memory are built on this: the channel's large
allreduces (`node_window`) and the gradient engine's buckets
(`torch._grad.shm`, `torch._grad.shm_pipeline`). Each allocates one
`SharedWindow` over the ranks of a node (`MPI_Win_allocate_shared`), in which
every rank can read every other rank's region. What they share is defined
here, once:

* the control block: `CTL_BYTES` ahead of each region (so a region starts on
  a page), int64 progress counters from its start, slot `ABORTED` first, and a
  32-bit futex bell at `BELL_OFFSET`, on a cache line of its own. Only its
  owner writes a counter; every rank reads all of them. Counters only grow.
* the memory-ordering discipline (`publish`, `least`): a counter is stored
  between two `MPI_Win_sync` and read between two. Large copies are
  non-temporal stores, which a plain store does not order, so the first sync
  makes the data a counter vouches for visible before the counter; the second
  sync after a read keeps the reader's data loads behind its counter load.
  A rank may read what a peer wrote only after it saw that peer's counter
  reach the step that wrote it (`least`), and may overwrite what peers read
  only after their counters say they are done with it.
* the bell: a rank that changes a counter rings every peer (`ring`), and a
  waiting rank reads its own bell before it looks at the counters, then
  sleeps on the futex only while the bell still holds that value (`sleep`):
  a ring between the look and the sleep wakes it. The futex wake is a system
  call, so a ring makes it only where the bell's owner says a thread of its
  own is asleep there (`SLEEPERS_OFFSET`, a word only its owner writes): the
  sleeper stores its count before the futex looks at the bell, the ringer
  stores the bell before it looks at the count, each behind a full barrier,
  so one of the two always sees the other's store.
* failure: a rank that fails mid-step sets its `ABORTED` slot (`abort`);
  peers see it in `aborted()` and fail too instead of waiting for it.
* slice ownership (`owned_slice`): of n items over n ranks, local rank r owns
  one contiguous slice; it reduces that slice over every rank's region, in
  local rank order, and the others copy the result back. Each element is
  summed by one rank, so every rank ends with the same bits.

`MPI_Win_sync` is only valid inside a passive-target epoch (MPICH refuses it
outside one): a window is locked (`Lock_all`) for its whole life. Allocating
and freeing are collective over the node; freeing waits for every peer, so
callers free off the event loop.

A job with no MPI world (`horovodrun --gloo`) maps one file of /dev/shm
instead (`over_mapping`; the file is made by `node_segment`'s helpers and
unlinked once every rank mapped it). Its memory barrier is `fence`: on
x86-64 a locked read-modify-write orders every earlier store, non-temporal
ones included, before every later access, which is all `MPI_Win_sync` does
there; elsewhere there is no such window (`FENCE_OK`).
"""

from __future__ import annotations

import itertools
import platform
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..base import futex
from ..base.errors import BackendError

Array = np.ndarray[Any, Any]

CTL_BYTES = 4096  # a control block; the region after it starts on a page
BELL_OFFSET = 128  # the futex word peers ring, on its own cache line
SLEEPERS_OFFSET = 192  # how many of the owner's threads sleep on its bell, a line of its own
COUNTERS = BELL_OFFSET // 8  # int64 slots ahead of the bell
ABORTED = 0  # counter slot every user shares: 1 once the rank failed
# who rings a bell: a peer, the rank itself (its own threads), or a peer's hint
PEER, LOCAL, HINT = "peer", "local", "hint"
SPIN_S = 50e-6  # `wait` spins this long before it sleeps on the bell
CHECK_S = 0.1  # a sleeping `wait` looks at its peers' abort flags this often

_OPEN: set[int] = set()  # ids of the MPI shared windows this process holds
FENCE_OK = platform.machine() in ("x86_64", "AMD64")  # `fence` is a full barrier here
_FENCE = threading.Lock()


def fence() -> None:
    """A full memory barrier on x86-64: CPython's lock acquire and release are locked
    read-modify-writes (a semaphore's compare-and-swap and add), which drain the
    store buffer and the write-combining buffers of non-temporal stores."""
    with _FENCE:
        pass


def owned_slice(items: int, r: int, n: int) -> tuple[int, int]:
    """Local rank r's slice [lo, hi) of `items` items shared by n ranks: contiguous,
    in rank order, sizes differing by one at most."""
    base, extra = divmod(items, n)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


def allocate(nbytes: int, node: Any) -> Any:
    """`MPI_Win_allocate_shared` of `nbytes` per rank over `node` (collective), locked
    for its life and counted until `free`."""
    from mpi4py import MPI

    win = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
    win.Lock_all(MPI.MODE_NOCHECK)
    _OPEN.add(id(win))
    return win


def free(win: Any) -> None:
    """Free a window from `allocate` (collective over its node)."""
    _OPEN.discard(id(win))
    win.Unlock_all()
    win.Free()


def open_windows() -> int:
    """Shared windows this process allocated and has not freed (tests hold it flat)."""
    return len(_OPEN)


class SharedWindow:
    """Every node rank's control block and region, as this rank sees them."""

    def __init__(self, rank: int, memory: list[Any], region_bytes: int,
                 sync: Callable[[], None], win: Any = None) -> None:
        """`memory[q]`: rank q's writable buffer of `CTL_BYTES + region_bytes` bytes;
        `sync`: the window's memory barrier (`MPI_Win_sync`)."""
        self.rank, self.size = rank, len(memory)
        self.region_bytes, self.win, self._sync = region_bytes, win, sync
        self.mapping: Any = None  # the shared file's mapping, for a window without MPI
        self.counters = [np.frombuffer(m, np.int64, count=COUNTERS) for m in memory]
        self.bells = [np.frombuffer(m, np.uint32, count=1, offset=BELL_OFFSET) for m in memory]
        self.bell_addresses = [int(b.ctypes.data) for b in self.bells]
        self.sleepers = [np.frombuffer(m, np.uint32, count=1, offset=SLEEPERS_OFFSET)
                         for m in memory]
        self._asleep = 0  # my threads in `sleep`; stored in my sleepers word
        self._asleep_lock = threading.Lock()
        self.regions = [np.frombuffer(m, np.uint8, count=region_bytes, offset=CTL_BYTES)
                        for m in memory]
        # a bell value nobody wrote before: one count per kind of writer (next() on
        # itertools.count is atomic, and several threads of a rank may ring)
        self._rings = {kind: itertools.count(1) for kind in (PEER, LOCAL, HINT)}
        self._writers = {PEER: rank + 1, LOCAL: self.size + 1, HINT: self.size + 2 + rank}

    @classmethod
    def allocate(cls, node: Any, region_bytes: int) -> SharedWindow:
        """A window of `region_bytes` per rank over the node communicator `node`
        (collective); every control block is zero when any rank returns."""
        win = allocate(CTL_BYTES + region_bytes, node)
        memory: list[Any] = [win.Shared_query(q)[0] for q in range(node.Get_size())]
        window = cls(node.Get_rank(), memory, region_bytes, win.Sync, win)
        window.clear()
        node.Barrier()  # nobody reads a control block before its owner cleared it
        return window

    @classmethod
    def over_mapping(cls, rank: int, size: int, mapping: Any, region_bytes: int) -> SharedWindow:
        """A window over one zero-filled shared mapping of `size` slots of
        `CTL_BYTES + region_bytes` (slot q is rank q's), with `fence` as its barrier;
        the mapping is unmapped once nothing refers to the window."""
        slot = CTL_BYTES + region_bytes
        if len(mapping) < size * slot:
            raise ValueError(f"a mapping of {len(mapping)} bytes holds no {size} slots of {slot}")
        whole = memoryview(mapping)
        window = cls(rank, [whole[q * slot:(q + 1) * slot] for q in range(size)], region_bytes,
                     fence)
        window.mapping = mapping
        return window

    def clear(self) -> None:
        """Zero my control block (MPI does not promise zeroed memory)."""
        self.counters[self.rank][:] = 0
        self.bells[self.rank][0] = 0
        self.sleepers[self.rank][0] = 0
        self._sync()

    def free(self) -> None:
        """Free the MPI window (collective over the node); a mapped file's window is
        unmapped when the last view of it goes (peers keep their own mappings)."""
        if self.win is not None:
            free(self.win)
            self.win = None
        self.mapping = None

    def sync(self) -> None:
        """The window's memory barrier (`MPI_Win_sync`)."""
        self._sync()

    # -- counters ----------------------------------------------------------------------
    def publish(self, counter: int, value: int, kind: str = PEER) -> None:
        """Say how far I am, after everything I wrote before it, and ring the peers."""
        self._sync()  # my writes are visible before the counter says so
        self.counters[self.rank][counter] = value
        self._sync()
        peers = [q for q in range(self.size) if q != self.rank]
        for q in peers:
            self._stamp(q, kind)
        self._sync()  # the bells are stored before I look who sleeps on them
        for q in peers:
            self._wake(q)

    def least(self, counter: int) -> int:
        """The smallest value of `counter` over every rank; what it vouches for may be
        read after this returns."""
        self._sync()
        least = min(int(c[counter]) for c in self.counters)
        self._sync()  # ... and the data the counters vouch for is read after them
        return least

    def peek(self, counter: int) -> list[int]:
        """Every rank's `counter`, unsynchronised: for stall reports, never for data."""
        return [int(c[counter]) for c in self.counters]

    def aborted(self) -> list[int]:
        """Ranks that failed mid-step (`abort`)."""
        return [q for q, c in enumerate(self.counters) if int(c[ABORTED])]

    def abort(self) -> None:
        """This rank failed mid-step: its peers fail instead of waiting for it."""
        if not int(self.counters[self.rank][ABORTED]):
            self.publish(ABORTED, 1)

    # -- bells -------------------------------------------------------------------------
    def ring(self, q: int, kind: str = PEER) -> None:
        """Change q's bell to a value nobody wrote before, then wake it."""
        self._stamp(q, kind)
        self._sync()  # the bell is stored before I look who sleeps on it
        self._wake(q)

    def writer(self, kind: str) -> int:
        """The code `kind`'s stamps carry (C steps that ring bells stamp as PEER)."""
        return self._writers[kind]

    def rings(self, kind: str) -> Iterator[int]:
        """`kind`'s count of stamps, which C steps draw from too: one sequence."""
        return self._rings[kind]

    def _stamp(self, q: int, kind: str) -> None:
        futex.stamp(self.bells[q], self._writers[kind], next(self._rings[kind]))

    def _wake(self, q: int) -> None:
        """Wake q's sleepers, if q says it has any (no system call otherwise)."""
        if int(self.sleepers[q][0]):
            futex.wake(self.bell_addresses[q])

    def bell(self) -> int:
        """My bell now: read it before looking at the counters, then `sleep(bell)`."""
        return int(self.bells[self.rank][0])

    def sleep(self, bell: int, timeout_s: float) -> None:
        """Sleep until my bell differs from `bell` (a peer rang since), at most
        `timeout_s`; a wake-up is a hint, the caller looks again."""
        self._count_asleep(1)
        try:
            self._sync()  # ringers see my count before the futex looks at the bell
            futex.wait(self.bell_addresses[self.rank], bell, timeout_s)
        finally:
            self._count_asleep(-1)

    def _count_asleep(self, change: int) -> None:
        with self._asleep_lock:
            self._asleep += change
            self.sleepers[self.rank][0] = self._asleep

    def wait(self, counter: int, value: int, what: str, limit_s: float | None = None) -> bool:
        """Until every rank's `counter` reached `value` (True), or `limit_s` passed
        (False). A peer's abort raises BackendError naming it and `what` it was doing."""
        start = time.perf_counter()
        while True:
            bell = self.bell()  # read first: a ring after it wakes us
            if self.least(counter) >= value:
                return True
            failed = self.aborted()
            if failed:
                raise BackendError(f"node rank {failed[0]} failed in {what}")
            waited = time.perf_counter() - start
            if limit_s is not None and waited >= limit_s:
                return False
            if waited >= SPIN_S:
                self.sleep(bell, CHECK_S)
