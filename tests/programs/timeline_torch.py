"""Rank program: a Horovod-style training script, unchanged but for the import,
recorded on the timeline by `ASYNCLOCK_TIMELINE` alone (no recorder calls).

`--gated`: layer-gated forward (`gate_forward=model`), which also traces the
model's forward passes; otherwise `trace_module(model)` does.
"""

from __future__ import annotations

import sys

import torch
from _common import report

import asynclock.torch as hvd


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gated = "--gated" in sys.argv
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   gate_forward=model if gated else None)
    if not gated:
        hvd.trace_module(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(4):
        x = torch.randn(16, 64) + hvd.rank() + step
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    report(hvd.rank(), "done")
    hvd.shutdown()


if __name__ == "__main__":
    main()
