"""Training throughput on a GPU: asynclock staging vs blocking mpi4py vs no communication.

A 5-layer MLP (about 15 M parameters, 59 MB of fp32 gradients) on synthetic
data, same seed and batches on every variant:

* local: forward, backward, step; no communication (the compute floor);
* asynclock: one BucketSync per parameter marked from
  `register_post_accumulate_grad_hook`, its allreduce launched on the loop
  while backward still runs (D2H on a copy stream after the producer's
  event, MPI on pinned host memory, H2D landing), the optimizer's stream
  waits for each bucket's `done` event;
* blocking: backward, `torch.cuda.synchronize()`, one flat host copy,
  mpi4py `Allreduce`, copy back, step (the naive baseline).

Every step ends with a device synchronize so the wall time is the step's.
Reported: median step ms over `--steps` after `--warmup`, samples/s per
rank, the exposed communication (variant minus local), and whether the
parameters are identical on every rank afterwards.

    mpiexec -n 2 python tests/gpu/bench_train_gpu.py --steps 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import anyio
import torch

import asynclock
from asynclock import cuda
from asynclock._core.base.from_thread import loop_caller
from asynclock._core.runtime.coordinator import Coordinator

BATCH, DIM_IN, HIDDEN, CLASSES = 256, 1024, 2048, 10


def make_model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(DIM_IN, HIDDEN), torch.nn.ReLU()]
    for _ in range(3):
        layers += [torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(HIDDEN, CLASSES)).to(dev)


def batch(step: int, rank: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=dev).manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, DIM_IN, device=dev, generator=g)
    y = torch.randint(0, CLASSES, (BATCH,), device=dev, generator=g)
    return x, y


class Trainer:
    """One variant's model, optimizer and per-step routine."""

    def __init__(self, coord: Coordinator, dev: torch.device, variant: str) -> None:
        self.coord, self.dev, self.variant = coord, dev, variant
        self.net = make_model(dev)
        self.params = list(self.net.parameters())
        self.opt = torch.optim.SGD(self.params, lr=0.01, momentum=0.9)
        self.syncs = [cuda.BucketSync() for _ in self.params]
        self.handles: dict[int, Any] = {}
        if variant == "asynclock":
            self.grad = coord.lowlevel.on_lane(coord.lowlevel.grad_lane)
            self.call = loop_caller()
            for i, p in enumerate(self.params):
                p.register_post_accumulate_grad_hook(self._hook(i))

    def _hook(self, i: int) -> Any:
        def fire(p: torch.Tensor) -> None:  # autograd thread; producer stream is current
            self.syncs[i].mark_ready(p.grad)
            self.call(lambda: self._launch(i))
        return fire

    def _launch(self, i: int) -> None:
        with self.syncs[i].comm():
            self.handles[i] = self.grad.allreduce_async_(self.params[i].grad, "average",
                                                         name=f"g{i}")

    def _loss(self, step: int) -> torch.Tensor:
        x, y = batch(step, self.coord.rank, self.dev)
        self.opt.zero_grad(set_to_none=False)
        return torch.nn.functional.cross_entropy(self.net(x), y)

    async def step(self, step: int) -> None:
        loss = self._loss(step)
        if self.variant == "asynclock":
            await self._step_async(loss)
        elif self.variant == "blocking":
            self._step_blocking(loss)
        else:
            loss.backward()
            self.opt.step()
        torch.cuda.synchronize(self.dev)

    async def _step_async(self, loss: torch.Tensor) -> None:
        self.handles.clear()
        await anyio.to_thread.run_sync(loss.backward)  # the loop launches buckets meanwhile
        while len(self.handles) < len(self.params):
            await anyio.sleep(0)
        for i in range(len(self.params)):
            await self.handles[i]
            self.syncs[i].consume()
        self.opt.step()

    def _step_blocking(self, loss: torch.Tensor) -> None:
        from mpi4py import MPI

        loss.backward()
        torch.cuda.synchronize(self.dev)
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads]).cpu()
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, flat.numpy())
        flat /= self.coord.size
        pos = 0
        for g in grads:
            g.copy_(flat[pos: pos + g.numel()].view_as(g))
            pos += g.numel()
        self.opt.step()

    async def checksum_agrees(self) -> bool:
        flat = torch.cat([p.detach().reshape(-1) for p in self.params]).double().sum().item()
        return len(set(await self.coord.allgather_object(flat))) == 1


async def run_variant(coord: Coordinator, dev: torch.device, variant: str,
                      steps: int, warmup: int) -> tuple[float, bool]:
    trainer = Trainer(coord, dev, variant)
    times = []
    await coord.barrier()
    for s in range(warmup + steps):
        t0 = time.perf_counter()
        await trainer.step(s)
        if s >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, await trainer.checksum_agrees()


async def main(args: argparse.Namespace) -> None:
    index = cuda.set_device()
    dev = torch.device("cuda", index if index is not None else 0)
    async with asynclock.start() as coord:
        if coord.rank == 0:
            nparams = sum(p.numel() for p in make_model(dev).parameters())
            print(f"{torch.cuda.get_device_name(dev)}; ranks={coord.size} "
                  f"gpus={torch.cuda.device_count()}; params={nparams / 1e6:.1f} M; "
                  f"{cuda.describe()}", flush=True)
        results = {}
        for variant in ("local", "asynclock", "blocking"):
            ms, same = await run_variant(coord, dev, variant, args.steps, args.warmup)
            worst = max(await coord.allgather_object(ms))
            results[variant] = (worst, same)
        if coord.rank == 0:
            report(coord.size, results)


def report(size: int, results: dict[str, tuple[float, bool]]) -> None:
    base = results["local"][0]
    print(f"{'variant':<10} {'step_ms':>8} {'samples/s/rank':>15} {'exposed_ms':>11} "
          f"{'params_equal':>13}")
    for variant, (ms, same) in results.items():
        exposed = ms - base if variant != "local" else 0.0
        equal = "yes" if same else ("n/a" if variant == "local" and size > 1 else "NO")
        print(f"{variant:<10} {ms:>8.2f} {BATCH / ms * 1e3:>15.0f} {exposed:>11.2f} {equal:>13}")
        print(f"SUMMARY bench_train ranks={size} variant={variant} median_ms={ms:.2f} "
              f"samples_per_s={BATCH / ms * 1e3:.0f} exposed_ms={exposed:.2f} "
              f"params_equal={equal}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    anyio.run(main, parser.parse_args())
