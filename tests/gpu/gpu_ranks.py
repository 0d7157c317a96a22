"""Rank program for the GPU checks: run under mpiexec with 1 or more ranks.

All ranks may share one GPU (`cuda.set_device()` maps local_rank onto the
GPUs that exist). Each check prints `RANK r OK <label>`:

* race_inplace: every rank's gradient is written after a long spin kernel
  on a side stream; in-place allreduce must see every rank's value;
* collectives: every collective on CUDA tensors, small (header-inline) and
  large, several dtypes, against the CPU results of the same collective;
* mixed_devices: rank 0 passes CPU tensors, the others CUDA tensors;
* hooked_buckets: a small model trained on a side stream, one BucketSync
  per parameter marked from `register_post_accumulate_grad_hook`, reduced
  while backward still runs, consumed before the optimizer step; the
  parameters must stay identical on every rank;
* direct: device buffers straight to MPI when the MPI is CUDA-aware
  (reports which path it took).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "programs"))
from _common import report  # noqa: E402
from gpu_util import late_fill  # noqa: E402

import asynclock  # noqa: E402
from asynclock import cuda
from asynclock._core.base.from_thread import loop_caller  # noqa: E402
from asynclock._core.engine import staging  # noqa: E402
from asynclock._core.runtime.coordinator import Coordinator  # noqa: E402

SLOW_MS = 80.0


async def race_inplace(c: Coordinator, dev: torch.device) -> None:
    side = torch.cuda.Stream(dev)
    for n in (16, 1 << 20):
        g = torch.zeros(n, device=dev)
        torch.cuda.synchronize(dev)
        sync = cuda.BucketSync()
        late_fill(g, float(c.rank + 1), SLOW_MS, side)
        with torch.cuda.stream(side):
            sync.mark_ready()
        with sync.comm():
            handle = c.allreduce_async_(g, name=f"race{n}")
        await handle
        sync.consume()
        want = c.size * (c.size + 1) / 2
        assert torch.equal(g, torch.full_like(g, want)), f"n={n}: {g[:4].tolist()} != {want}"


def contribution(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    return ((torch.arange(n) + 3 * rank) % 11).to(dtype)


async def collectives(c: Coordinator, dev: torch.device) -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int32):
        for n in (6, 3 * 40_000):
            x = contribution(c.rank, n, dtype)
            xg = x.to(dev)
            for fn, args in ((c.allreduce, ()), (c.broadcast, (c.size - 1,)),
                             (c.reduce_scatter, ()), (c.allgather, ())):
                want = await fn(x, *args)
                got = await fn(xg, *args)
                assert got.is_cuda and torch.equal(got.cpu(), want), f"{fn.__name__} {dtype} {n}"
            (want, _), (got, _) = await c.alltoall(x), await c.alltoall(xg)
            assert torch.equal(got.cpu(), want), f"alltoall {dtype} {n}"
            y = xg.clone()
            await c.allreduce_(y, "average")
            assert torch.equal(y.cpu(), await c.allreduce(x, "average")), f"average {dtype} {n}"


async def mixed_devices(c: Coordinator, dev: torch.device) -> None:
    for n in (5, 200_000):
        x = torch.full((n,), float(c.rank + 1))
        mine = x if c.rank == 0 else x.to(dev)
        out = await c.allreduce(mine)
        assert out.is_cuda == (c.rank != 0)
        assert torch.equal(out.cpu(), torch.full((n,), c.size * (c.size + 1) / 2))


def model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 10)).to(dev)


def backward_on(stream: Any, loss: torch.Tensor) -> None:
    """In a worker thread (the loop stays free to launch buckets meanwhile)."""
    with torch.cuda.stream(stream):
        loss.backward()


async def hooked_buckets(c: Coordinator, dev: torch.device) -> None:
    net, grad = model(dev), c.lowlevel.on_lane(c.lowlevel.grad_lane)
    params = list(net.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    side, call = torch.cuda.Stream(dev), loop_caller()
    syncs = [cuda.BucketSync() for _ in params]
    handles: dict[int, Any] = {}

    def launch(i: int) -> None:  # on the loop, in hook order (same on every rank)
        with syncs[i].comm():
            handles[i] = grad.allreduce_async_(params[i].grad, "average", name=f"p{i}")

    def hook(i: int) -> Any:
        def fire(p: torch.Tensor) -> None:  # autograd thread, producer stream current
            syncs[i].mark_ready(p.grad)
            call(lambda: launch(i))
        return fire

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(hook(i))
    for step in range(5):
        torch.manual_seed(100 + 10 * step + c.rank)
        with torch.cuda.stream(side):  # the user's own compute stream
            x = torch.randn(128, 64, device=dev)
            loss = net(x).square().mean()
        with torch.cuda.stream(side):
            opt.zero_grad(set_to_none=False)
        handles.clear()
        await anyio.to_thread.run_sync(backward_on, side, loss)
        while len(handles) < len(params):
            await anyio.sleep(0.001)
        for i in range(len(params)):
            await handles[i]
            syncs[i].consume(side)
        with torch.cuda.stream(side):
            opt.step()
    with torch.cuda.stream(side):
        flat = torch.cat([p.detach().reshape(-1) for p in params]).cpu()
    sums = await c.allgather_object(flat.double().sum().item())
    assert len(set(sums)) == 1, f"parameters diverged across ranks: {sums}"
    everyone = await c.broadcast(flat, root=0)
    assert torch.equal(everyone, flat), "parameters differ from rank 0's"


async def direct(c: Coordinator, dev: torch.device) -> str:
    support = cuda.cuda_support()
    g = torch.full((1 << 18,), float(c.rank + 1), device=dev)
    await c.allreduce_(g)
    assert torch.equal(g.cpu(), torch.full((1 << 18,), c.size * (c.size + 1) / 2))
    return "device-direct" if support.direct else f"staged ({support.how})"


async def main() -> None:
    index = cuda.set_device()
    dev = torch.device("cuda", index if index is not None else 0)
    async with asynclock.start() as c:
        if c.rank == 0:
            print(cuda.describe(), f"local_size={c.local_size} gpus={torch.cuda.device_count()}",
                  flush=True)
        with anyio.fail_after(180):
            await race_inplace(c, dev)
            report(c.rank, "race_inplace")
            await collectives(c, dev)
            report(c.rank, "collectives")
            await mixed_devices(c, dev)
            report(c.rank, "mixed_devices")
            await hooked_buckets(c, dev)
            report(c.rank, "hooked_buckets")
            report(c.rank, "direct", await direct(c, dev))
        assert staging.held(c.lowlevel.user_lane) == 0 and staging.held(c.lowlevel.grad_lane) == 0
    report(c.rank, "done", f"device {dev}")


if __name__ == "__main__":
    anyio.run(main)
