"""Optimizers made and dropped, one after another, release what they held: threads,
shared windows, channels. Every rank prints its counts; the test compares them."""

from __future__ import annotations

import faulthandler
import gc
import sys
import threading

import torch
from _common import report

import asynclock.torch as hvd
from asynclock._core.runtime import coordinator as runtime
from asynclock.torch._grad.release import wait_released
from asynclock.torch._grad.windows import open_windows


def one_optimizer(rank: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    for step in range(3):  # past the re-plan: the shared-memory path and its thread
        opt.zero_grad()
        model(torch.full((4, 8), float(rank + step))).sum().backward()
        opt.step()


def counts() -> tuple[int, int, int]:
    """Threads, shared windows and extra gradient lanes, once every dropped optimizer's
    release (a thread that waits for the peers' frees) is over."""
    gc.collect()
    if not wait_released(30.0):
        faulthandler.dump_traceback()
        raise AssertionError("a dropped optimizer's release did not finish")
    hvd.allreduce(torch.ones(1))  # lets the loop run what the finalizers handed it
    lanes = len(runtime.coordinator().more_grad_lanes)
    return threading.active_count(), open_windows(), lanes


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
    print(f"rank {rank}: threads, windows, extra lanes before {before} after {after} "
          f"({sorted(t.name for t in threading.enumerate())})", flush=True)
    assert after == before, (before, after)
    report(rank, "flat", f"{before}->{after}")
    hvd.shutdown()
    report(rank, "done")


if __name__ == "__main__":
    main()
