"""Step time on the GPU at world size 1: what asynclock's machinery costs against DDP's.

    mpiexec -n 1 python tests/gpu/bench_step_gpu.py [--api dropin|async] [--cpu] [--steps 40]

For a CNN (ResNet-18's layout: 64-512 channels, basic blocks, about 11 M parameters)
and a small transformer (4 layers, width 512), both in bfloat16 on the GPU, it times:

- compute: forward, backward and SGD step alone (the floor);
- ddp: `DistributedDataParallel` over NCCL (a one-rank default group on loopback);
- dropin: `asynclock.torch.DistributedOptimizer` (the Horovod drop-in), with `--api dropin`;
- async: `coord.train_step` (the async API), with `--api async`: one engine per process
  runs either the Horovod-style loop thread or the caller's loop, so each API gets a run.

Each variant runs `--windows` windows of `--steps` steps after a warm-up; the figure is
the median window's milliseconds per step (each window ends with a device synchronize:
the benchmark's, never asynclock's). It prints one `SUMMARY` line per model with each
variant over DDP; the GPU check's target is asynclock at most 1.02x DDP.
`--cpu` (the dry run) uses tiny models in float32 on the CPU and gloo for DDP.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import anyio
import torch

import asynclock
import asynclock.torch as hvd
from asynclock import cuda


def cnn(width: int) -> torch.nn.Module:
    def block(cin: int, cout: int, stride: int) -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Conv2d(cin, cout, 3, stride, 1, bias=False), torch.nn.BatchNorm2d(cout),
            torch.nn.ReLU(), torch.nn.Conv2d(cout, cout, 3, 1, 1, bias=False),
            torch.nn.BatchNorm2d(cout), torch.nn.ReLU())
    layers: list[torch.nn.Module] = [torch.nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                     torch.nn.BatchNorm2d(width), torch.nn.ReLU()]
    cin = width
    for i, mult in enumerate((1, 2, 4, 8)):
        for j in range(2):
            layers.append(block(cin, width * mult, 2 if i and not j else 1))
            cin = width * mult
    layers += [torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(cin, 1000)]
    return torch.nn.Sequential(*layers)


def transformer(width: int, layers: int) -> torch.nn.Module:
    layer = torch.nn.TransformerEncoderLayer(width, 8, 4 * width, batch_first=True)
    return torch.nn.TransformerEncoder(layer, layers)


def models(cpu: bool) -> dict[str, tuple[Callable[[], torch.nn.Module], Callable[[], Any]]]:
    if cpu:
        return {"cnn": (lambda: cnn(8), lambda: torch.randn(2, 3, 32, 32)),
                "transformer": (lambda: transformer(32, 1), lambda: torch.randn(2, 8, 32))}
    return {"cnn": (lambda: cnn(64), lambda: torch.randn(32, 3, 224, 224)),
            "transformer": (lambda: transformer(512, 4), lambda: torch.randn(16, 256, 512))}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
        self.dtype = torch.float32 if args.cpu else torch.bfloat16

    def sync(self) -> None:
        if not self.args.cpu:
            torch.cuda.synchronize()

    def fresh(self, make: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        torch.manual_seed(0)
        return make().to(self.dev, self.dtype)

    def windows(self, step: Callable[[], None]) -> float:
        for _ in range(self.args.warmup):
            step()
        self.sync()
        times = []
        for _ in range(self.args.windows):
            t0 = time.perf_counter()
            for _ in range(self.args.steps):
                step()
            self.sync()
            times.append((time.perf_counter() - t0) / self.args.steps * 1e3)
        return statistics.median(times)

    def plain(self, model: torch.nn.Module, opt: Any, x: Any) -> Callable[[], None]:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            model(x).float().mean().backward()
            opt.step()
        return step


def run_model(b: Bench, name: str, make: Callable[[], torch.nn.Module],
              data: Callable[[], Any]) -> dict[str, float]:
    x = data().to(b.dev, b.dtype)
    out: dict[str, float] = {}
    model = b.fresh(make)
    out["compute"] = b.windows(b.plain(model, torch.optim.SGD(model.parameters(), lr=1e-4), x))
    ddp = torch.nn.parallel.DistributedDataParallel(b.fresh(make))
    out["ddp"] = b.windows(b.plain(ddp, torch.optim.SGD(ddp.parameters(), lr=1e-4), x))
    if b.args.api == "dropin":
        model = b.fresh(make)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-4),
                                       named_parameters=model.named_parameters())
        out["dropin"] = b.windows(b.plain(model, opt, x))
    else:
        out["async"] = anyio.run(run_async, b, make, data)
    return out


async def run_async(b: Bench, make: Callable[[], torch.nn.Module], data: Callable[[], Any]
                    ) -> float:
    x = data().to(b.dev, b.dtype)
    async with asynclock.start() as coord:
        model = b.fresh(make)
        step = coord.train_step(torch.optim.SGD(model.parameters(), lr=1e-4))

        async def one() -> None:
            async with step:
                await step.backward(model(x).float().mean())

        for _ in range(b.args.warmup):
            await one()
        b.sync()
        times = []
        for _ in range(b.args.windows):
            t0 = time.perf_counter()
            for _ in range(b.args.steps):
                await one()
            b.sync()
            times.append((time.perf_counter() - t0) / b.args.steps * 1e3)
        return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--api", choices=("dropin", "async"), default="dropin")
    p.add_argument("--cpu", action="store_true", help="dry run: tiny models on the CPU, gloo")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    b = Bench(args)
    if not args.cpu:
        cuda.set_device()
    with tempfile.TemporaryDirectory() as tmp:
        torch.distributed.init_process_group(
            "gloo" if args.cpu else "nccl", init_method=f"file://{os.path.join(tmp, 'pg')}",
            rank=0, world_size=1)
        if args.api == "dropin":
            hvd.init()
        for name, (make, data) in models(args.cpu).items():
            figures = run_model(b, name, make, data)
            ddp = figures["ddp"]
            parts = " ".join(f"{k} {v:.2f} ms ({v / ddp:.3f}x ddp)" for k, v in figures.items())
            print(f"SUMMARY step_{name}_{args.api}: {parts}", flush=True)
        print(cuda.describe(), flush=True)
        hvd.shutdown()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
