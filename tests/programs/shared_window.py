"""The node's shared window (`transports.shared_window`) on its own, over mpi4py.

    shared_window.py

Every rank of the job is on one node. Checks, each reported by every rank:

* `zeroed`: every control block reads zero once `allocate` returned;
* `handoff`: many rounds of the discipline both reducers follow: write my
  region, publish ARRIVED; once every rank arrived, read every peer's region
  (it must hold what that peer wrote this round, all of it); publish LEFT;
  write again only once every rank left. A counter that vouched for data not
  yet written, or a rank let on before the slowest, shows as a stale word;
* `bells`: a publish changes every peer's bell, and a sleep on a bell a peer
  rang since it was read returns at once;
* `abort`: the last rank aborts; every other rank's wait on it raises,
  naming it.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from _common import report, run_or_abort
from mpi4py import MPI

from asynclock._core.base.errors import BackendError
from asynclock._core.transports.shared_window import ABORTED, COUNTERS, SharedWindow

ARRIVED, LEFT, WAITED = 1, 2, 3
WORDS = 1 << 18  # 2 MiB a region: large copies, as the reducers make
ROUNDS = 60
LONG_S = 30.0  # a sleep a missing ring would not end


def check_zeroed(win: SharedWindow) -> None:
    for q in range(win.size):
        assert not win.counters[q][:COUNTERS].any(), (q, win.counters[q])
    assert win.least(ABORTED) == 0 and win.aborted() == []


def check_handoff(win: SharedWindow) -> None:
    me, n = win.rank, win.size
    regions = [r[: WORDS * 8].view(np.int64) for r in win.regions]
    stamps = [np.full(WORDS, 0, np.int64) for _ in range(2)]
    for i in range(1, ROUNDS + 1):
        win.wait(LEFT, i - 1, "the handoff")  # nobody still reads my region
        stamp = stamps[i % 2]
        stamp.fill(i * n + me)
        regions[me][:] = stamp
        win.publish(ARRIVED, i)
        win.wait(ARRIVED, i, "the handoff")
        for q in range(n):
            want = i * n + q
            got = regions[q]
            if got[0] != want or got[-1] != want or not (got == want).all():
                stale = int(np.count_nonzero(got != want))
                raise AssertionError(f"round {i}: rank {q}'s region has {stale} stale words")
        win.publish(LEFT, i)
    win.wait(LEFT, ROUNDS, "the handoff")


def check_bells(win: SharedWindow, node: MPI.Comm) -> None:
    me = win.rank
    before = win.bell()
    node.Barrier()
    if me == 1:
        win.publish(WAITED, 1)
    node.Barrier()
    if me != 1:
        assert win.bell() != before, "a publish left a peer's bell as it was"
        start = time.perf_counter()
        win.sleep(before, LONG_S)  # rung since `before` was read: returns at once
        assert time.perf_counter() - start < LONG_S / 2, "slept through a ring"
    node.Barrier()
    if me == 0:  # rank 0 sleeps until the others publish: their rings wake it
        node.Barrier()
        start = time.perf_counter()
        while True:
            bell = win.bell()  # before the counters: a ring after this ends the sleep
            if min(win.peek(WAITED)[1:]) >= 2:
                break
            win.sleep(bell, LONG_S)
        assert time.perf_counter() - start < LONG_S / 2, "slept through a ring"
    else:
        node.Barrier()
        time.sleep(0.05)  # rank 0 is asleep by now, most likely
        win.publish(WAITED, 2)
    node.Barrier()


def check_abort(win: SharedWindow, node: MPI.Comm) -> None:
    last = win.size - 1
    if win.rank == last:
        win.abort()
    else:
        try:
            win.wait(WAITED, 99, "the abort check")
        except BackendError as exc:
            assert f"node rank {last} failed in the abort check" in str(exc), exc
        else:
            raise AssertionError("waited on an aborted rank without an error")
    node.Barrier()
    assert win.aborted() == [last]


def main() -> None:
    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    assert node.Get_size() == comm.Get_size() >= 2, "one node, two ranks at least"
    rank = comm.Get_rank()
    win = SharedWindow.allocate(node, WORDS * 8)
    check_zeroed(win)
    node.Barrier()  # every rank looked before any publishes
    report(rank, "zeroed")
    check_handoff(win)
    report(rank, "handoff")
    check_bells(win, node)
    report(rank, "bells")
    check_abort(win, node)
    report(rank, "abort")
    win.free()
    node.Free()
    report(rank, "done")
    sys.stdout.flush()


if __name__ == "__main__":
    run_or_abort(main)
