"""Horovod's synthetic-benchmark loop through `import asynclock.torch as hvd`, long.

Usage: hvd_synthetic_loop.py [--steps N]   (under horovodrun --gloo)

A model of 32 small linear layers (64 gradient tensors) trains `--steps` steps as
`pytorch_synthetic_benchmark.py` does (DistributedOptimizer over named parameters,
rank 0's parameters and optimizer state broadcast first), then again with
`Compression.fp16`; each step also averages a named and an unnamed metric of 64
floats, as `pytorch_mnist.py` does. Each phase checks that every rank holds the same
parameters, then reports `fp32` / `fp16`. The test reads Horovod's warnings from the
job's output and its cache hits from HOROVOD_TIMELINE; each rank prints the cycle time
and group fusion setting Horovod was initialized with (`HVD_SETTINGS`).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F  # noqa: N812
from _common import report

import asynclock.torch as hvd


def model() -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(32):
        layers += [torch.nn.Linear(32, 32), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def phase(steps: int, compression: object, label: str) -> None:
    torch.manual_seed(0)
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.01 * hvd.size(), momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(),
                                   compression=compression)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    g = torch.Generator().manual_seed(hvd.rank())
    data, target = torch.randn(8, 32, generator=g), torch.randn(8, 32, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        loss = F.mse_loss(net(data), target)
        loss.backward()
        opt.step()
        metric = torch.full((64,), float(loss.item()))
        hvd.allreduce(metric, name="avg_loss")
        hvd.allreduce(metric)
    flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    everyone = hvd.allgather(flat.unsqueeze(0))
    assert torch.equal(everyone[0], everyone[-1]), "ranks' parameters differ"
    report(hvd.rank(), label)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    args = p.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    # what Horovod was started with: asynclock's defaults where the user set nothing
    print(f"HVD_SETTINGS {rank} cycle={os.environ.get('HOROVOD_CYCLE_TIME')} "
          f"group_fusion_off={os.environ.get('HOROVOD_DISABLE_GROUP_FUSION')}", flush=True)
    phase(args.steps, hvd.Compression.none, "fp32")
    phase(args.steps, hvd.Compression.fp16, "fp16")
    hvd.shutdown()
    report(rank, "done")

if __name__ == "__main__":
    main()
