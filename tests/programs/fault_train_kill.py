"""Rank 1 kills (`--signal KILL`) or freezes (`--signal STOP`) itself in the middle
of backward, once gradient buckets go through the node's shared memory (after the
profiling round): its peers wait on its counters in the window, not on a collective.

The survivors must exit non-zero, naming rank 1, whether the window is MPI's or a
mapped file (`horovodrun --gloo`). With ASYNCLOCK_BULK=gloo and ASYNCLOCK_NODE_WINDOW=0
the buckets go over gloo from the packing thread instead (`gloo_rounds`): the peers then
wait on gloo's calls.
"""

from __future__ import annotations

import os
import signal

import torch
from _common import report
from fault_common import announce_pid, arg

import asynclock.torch as hvd

VICTIM = 1
HOW = arg("--signal", "KILL")


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    announce_pid(hvd.rank())
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x = torch.randn(16, 256)
    for _ in range(2):  # the profiling round, then one through the window
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    transport = {"ShmTransport": "shm", "GlooRounds": "gloo"}.get(
        type(opt.reducer.transport).__name__, "allreduce")
    report(hvd.rank(), f"transport_{transport}")
    hvd.allreduce(torch.ones(1), name="warmed")  # every rank has written its lines

    def die(grad: torch.Tensor) -> torch.Tensor:
        os.kill(os.getpid(), getattr(signal, "SIG" + HOW))
        return grad

    if hvd.rank() == VICTIM:  # the first layer's gradient comes last: the rest is packed
        model[0].weight.register_hook(die)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    report(hvd.rank(), "unexpected")


main()
