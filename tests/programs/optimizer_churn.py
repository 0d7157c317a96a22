"""Optimizers made and dropped, one after another, release their threads and gradient
lanes. Every rank prints its counts (threads, shared windows, lanes served).

    optimizer_churn.py N [--allreduce]

`--allreduce`: buckets as allreduces (`Tuning(shm=False)`), not the shared-memory
pipeline: with a low ASYNCLOCK_WINDOW_MIN_BYTES they go through the channel's node
window."""

from __future__ import annotations

import faulthandler
import gc
import sys
import threading

import torch
from _common import report

import asynclock.torch as hvd
from asynclock._core.runtime import coordinator as runtime
from asynclock._core.transports.shared_window import open_windows
from asynclock.torch._grad.release import wait_released


def one_optimizer(rank: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(),
                                   tuning=hvd.Tuning(shm="--allreduce" not in sys.argv))
    for step in range(3):  # past the re-plan: the shared-memory path and its thread
        opt.zero_grad()
        model(torch.full((4, 8), float(rank + step))).sum().backward()
        opt.step()


def snapshot() -> tuple[bool, tuple[int, int, int]]:
    """Whether every release here has ended, and the counts then."""
    gc.collect()
    hvd.allreduce(torch.ones(1))  # every rank has collected, and so started its releases
    released = wait_released(2.0)
    hvd.allreduce(torch.ones(1))  # lets the loop run what the finalizers handed it
    lanes = len(runtime.coordinator().lowlevel.engine.lanes)  # the lanes still served
    return released, (threading.active_count(), open_windows(), lanes)


def counts() -> tuple[int, int, int]:
    """Threads, shared windows and lanes served once every dropped optimizer is
    released. A rank may collect an optimizer a pass later than its peers (the engine's
    last operation on a lane holds on to it until the lane is retired), and a window's
    free waits for the peers' frees of it, so releases may span passes: until every
    release has ended and two snapshots agree."""
    last: tuple[int, int, int] | None = None
    for _ in range(15):
        released, now = snapshot()
        settled = torch.tensor([1.0 if released and now == last else 0.0])
        if hvd.allreduce(settled, op=hvd.Min).item() == 1.0:  # every rank stops together
            return now
        last = now
    faulthandler.dump_traceback()
    raise AssertionError(f"dropped optimizers' releases did not settle: {last}")


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    hvd.init()
    rank = hvd.rank()
    for _ in range(2):  # the first takes the world's gradient lane; the second makes one
        one_optimizer(rank)  # on the user lane's wait thread, which stays for its bulk calls
    before = counts()
    for _ in range(n):
        one_optimizer(rank)
    after = counts()
    print(f"rank {rank}: threads, windows, lanes served before {before} after {after} "
          f"({sorted(t.name for t in threading.enumerate())})", flush=True)
    # shared windows stay mapped until MPI ends (freeing one waits for every peer's free)
    assert (after[0], after[2]) == (before[0], before[2]), (before, after)
    report(rank, "flat", f"{before}->{after}")
    hvd.shutdown()
    report(rank, "done")


if __name__ == "__main__":
    main()
