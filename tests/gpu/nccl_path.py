"""Rank program for the NCCL path (`engine.device_pg`): run under mpiexec.

On a GPU (default): CUDA tensors. At 1 rank every allreduce and broadcast above the
header's inline size goes over NCCL on the channel's private group; at 2 ranks sharing
one GPU NCCL refuses, so every rank agrees on host staging and says why. With `--cpu`
(the dry run CI makes of the GPU check): CPU tensors through the same code over gloo
(`ASYNCLOCK_CUDA_PATH=gloo-twin`, set by the caller).

Checks, each printing `RANK r OK <label>`:

* path: `cuda.describe()` names the path every rank agreed on;
* values: allreduce (sum, average, max; float32, float16, bfloat16, int64), in place
  and not, broadcast from every root, against exact expectations;
* gather_scatter: allgather with dim 0 differing by rank (float32, bfloat16, int16 on
  the GPU: moved as bytes), reduce-scatter split unevenly (sum, average; float16 reduces
  natively), alltoall with uneven splits, each against exact expectations and each
  through the device group on the NCCL path; a mismatch fails on every rank and the
  next call is exact; broadcast_parameters and broadcast_optimizer_state of CUDA
  tensors (their data through the group too);
* race_gather: an allgather whose input is written after a ~80 ms spin kernel on a
  side stream, read by a kernel right after: the late value, gathered;
* race_producer: the tensor is written after a ~80 ms spin kernel on a side stream and
  the collective starts at once: it must reduce the late value (the call waits for the
  producer's stream, not the host);
* race_consumer: the result is read by a kernel right after the call returns, on
  the caller's stream: it must see the reduced value (consumers wait by stream);
* buckets: a model's gradients, reduced in buckets by `train_step` over the device
  group (CUDA parameters: NCCL, bucket ready and done by stream events), equal to the
  average of every rank's gradient, and the same parameters on every rank after 3 steps;
* reset: the coordinator is shut down (its groups aborted) and started again, as an
  elastic reset re-forms the world, and a collective on the new group is exact.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "programs"))
from _common import report  # noqa: E402

import asynclock  # noqa: E402
from asynclock import cuda  # noqa: E402

CPU = "--cpu" in sys.argv
N = 1 << 18  # past the inline size and the small-call sizes
SLOW_MS = 80.0


def device() -> torch.device:
    if CPU:
        return torch.device("cpu")
    cuda.set_device()
    return torch.device("cuda", torch.cuda.current_device())


def expected_path(size: int) -> str:
    if CPU:
        return "gloo-twin through a private process group"
    return "nccl through a private process group" if size == 1 else "host staging"


def group_calls(c: asynclock.Coordinator) -> int:
    group = getattr(c.lowlevel.engine.lanes[0].transport, "device_group", None)
    return 0 if group is None else int(group.calls)


async def check_values(c: asynclock.Coordinator, dev: torch.device) -> None:
    r, n = c.rank, c.size
    total = sum(range(1, n + 1))
    dtypes = [torch.float32, torch.int64] + ([] if CPU else [torch.float16, torch.bfloat16])
    for dtype in dtypes:
        x = torch.full((N,), r + 1, dtype=dtype, device=dev)
        got = await c.allreduce(x, asynclock.Sum)
        assert torch.equal(got.cpu(), torch.full((N,), total, dtype=dtype)), (dtype, got[:4])
        await c.allreduce_(x, asynclock.Max)
        assert torch.equal(x.cpu(), torch.full((N,), n, dtype=dtype)), (dtype, x[:4])
    avg = await c.allreduce(torch.full((N,), float(r), device=dev), asynclock.Average)
    assert torch.allclose(avg.cpu(), torch.full((N,), (n - 1) / 2)), avg[:4]
    for root in range(n):
        b = torch.full((N,), float(r), device=dev)
        await c.broadcast_(b, root)
        assert torch.equal(b.cpu(), torch.full((N,), float(root))), (root, b[:4])
    report(r, "values")


def split(d0: int, n: int) -> list[int]:
    base, extra = divmod(d0, n)
    return [base + (1 if q < extra else 0) for q in range(n)]


async def check_gather_scatter(c: asynclock.Coordinator, dev: torch.device) -> None:
    r, n = c.rank, c.size
    before = group_calls(c)
    dtypes = [torch.float32, torch.int16] + ([] if CPU else [torch.bfloat16, torch.float16])
    for dtype in dtypes:
        got = await c.allgather(torch.full((r + 1, 3), r, dtype=dtype, device=dev))
        want = torch.cat([torch.full((q + 1, 3), q, dtype=dtype) for q in range(n)])
        assert got.device == dev and torch.equal(got.cpu(), want), (dtype, got)
    scattered = [torch.float64] + ([] if CPU else [torch.float16])
    for dtype in scattered:
        d0 = 2 * n + 1
        base = torch.arange(d0 * 4, dtype=dtype).reshape(d0, 4)
        start = sum(split(d0, n)[:r])
        mine = (n * base + sum(range(n)))[start: start + split(d0, n)[r]]
        got = await c.reduce_scatter((base + r).to(dev), asynclock.Sum)
        assert got.device == dev and torch.equal(got.cpu(), mine), (dtype, got)
        got = await c.reduce_scatter((base + r).to(dev), asynclock.Average)
        assert torch.allclose(got.cpu().double(), mine.double() / n, rtol=1e-3), (dtype, got)
    splits = [r + q for q in range(n)]
    send = torch.cat([torch.full((r + q, 2), 100 * r + q, dtype=torch.int64) for q in range(n)])
    out, got_splits = await c.alltoall(send.to(dev), splits)
    want = torch.cat([torch.full((q + r, 2), 100 * q + r, dtype=torch.int64) for q in range(n)])
    assert got_splits == [q + r for q in range(n)] and torch.equal(out.cpu(), want), out
    # allgathers, reduce-scatters, and the alltoall where it moves anything (1 rank: no)
    moved = len(dtypes) + 2 * len(scattered) + (1 if n > 1 else 0)
    if n > 1:
        other = torch.float32 if r else torch.float64
        try:
            await c.allgather(torch.ones(N, device=dev, dtype=other))
        except asynclock.MismatchError:
            pass
        else:
            raise AssertionError("an allgather of two dtypes went through")
    got = await c.allgather(torch.full((N,), float(r), device=dev))
    assert torch.equal(got.cpu(), torch.arange(n).repeat_interleave(N).float()), got
    moved += 1
    if "through a private process group" in cuda.describe():
        assert group_calls(c) - before == moved, (group_calls(c) - before, moved)
    await check_broadcasts(c, dev)
    report(r, "gather_scatter")


async def check_broadcasts(c: asynclock.Coordinator, dev: torch.device) -> None:
    """broadcast_parameters and broadcast_optimizer_state (the async forms the drop-in's
    run) of CUDA parameters and state: rank 0's on every rank, on the device."""
    from asynclock.torch._hvd.params import (
        broadcast_optimizer_state_async,
        broadcast_parameters_async,
    )

    torch.manual_seed(c.rank)
    model = torch.nn.Linear(300, 200).to(dev)
    opt = torch.optim.Adam(model.parameters())
    model(torch.full((4, 300), float(c.rank), device=dev)).sum().backward()
    opt.step()
    before = group_calls(c)
    await broadcast_parameters_async(c, model.state_dict(), 0)
    await broadcast_optimizer_state_async(c, opt, 0)
    rows = await c.allgather(torch.cat([model.weight.detach().reshape(1, -1),
                                        opt.state[model.weight]["exp_avg"].reshape(1, -1)], 1))
    assert all(torch.equal(rows[0], row) for row in rows), "parameters or state differ"
    assert opt.state[model.weight]["exp_avg"].device == dev
    if "through a private process group" in cuda.describe():
        assert group_calls(c) - before >= 4, group_calls(c) - before  # weight, bias, 2 moments


def late_filled(dev: torch.device, value: float) -> torch.Tensor:
    """N elements of `value`, filled by a kernel still running when this returns (on
    CPU: filled at once); the caller's stream orders after it."""
    x = torch.zeros(N, device=dev)
    if CPU:
        x.fill_(value)
    else:
        from gpu_util import late_fill

        side = torch.cuda.Stream()
        late_fill(x, value, SLOW_MS, side)
        torch.cuda.current_stream().wait_stream(side)
    return x


async def check_race_gather(c: asynclock.Coordinator, dev: torch.device) -> None:
    r, n = c.rank, c.size
    x = late_filled(dev, r + 1.0)
    got = await c.allgather(x)
    doubled = got * 2
    want = torch.arange(1, n + 1).repeat_interleave(N).float() * 2
    assert torch.equal(doubled.cpu(), want), doubled[:4]
    report(r, "race_gather")


async def check_races(c: asynclock.Coordinator, dev: torch.device) -> None:
    r, n = c.rank, c.size
    x = late_filled(dev, r + 1.0)  # the producer is still running...
    await c.allreduce_(x, asynclock.Sum)  # ...when the call is made
    doubled = x * 2  # a consumer kernel right after, on the caller's stream
    want = 2.0 * sum(range(1, n + 1))
    assert torch.equal(doubled.cpu(), torch.full((N,), want)), doubled[:4]
    report(r, "race_producer")
    y = torch.full((N,), float(r + 1), device=dev)
    out = await c.allreduce(y, asynclock.Sum)
    assert float(out.sum().item()) == N * sum(range(1, n + 1)), out[:4]
    report(r, "race_consumer")


def grad_lane_calls(c: asynclock.Coordinator) -> int:
    group = getattr(c.lowlevel.grad_lane.transport, "device_group", None)
    return 0 if group is None else int(group.calls)


def small_model(dev: torch.device) -> torch.nn.Module:
    torch.manual_seed(7)  # the same model on every rank
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 8)).to(dev)


async def check_buckets(c: asynclock.Coordinator, dev: torch.device) -> None:
    model, ref = small_model(dev), small_model(dev)
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.01))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    before = grad_lane_calls(c)

    def data(n: int, r: int) -> torch.Tensor:
        return torch.full((4, 64), float(r + n) / 4, device=dev)

    for n in range(3):
        async with step:
            await step.backward(model(data(n, c.rank)).sum())
        ref_opt.zero_grad()  # one process: the average of every rank's loss
        (sum(ref(data(n, r)).sum() for r in range(c.size)) / c.size).backward()
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=1e-4, atol=1e-5), (p - q).abs().max()
    calls = grad_lane_calls(c) - before
    if "through a private process group" in cuda.describe():
        assert calls > 0, "no bucket went through the device group"
    report(c.rank, "buckets", f"{calls} bucket allreduces over the device group")


async def one_world(reset: bool) -> None:
    async with asynclock.start() as c:
        dev = device()
        text = cuda.describe()
        assert expected_path(c.size) in text, text
        print(f"rank {c.rank}: {text}", flush=True)
        if not reset:
            report(c.rank, "path")
            await check_values(c, dev)
            await check_gather_scatter(c, dev)
            await check_race_gather(c, dev)
            await check_races(c, dev)
            await check_buckets(c, dev)
            if "through a private process group" in text:
                assert group_calls(c) > 0, "nothing went through the device group"
        else:
            got = await c.allreduce(torch.ones(N, device=dev), asynclock.Sum)
            assert torch.equal(got.cpu(), torch.full((N,), float(c.size))), got[:4]
            report(c.rank, "reset")


def main() -> None:
    os.environ.setdefault("ASYNCLOCK_CUDA_PATH", "gloo-twin" if CPU else "auto")
    anyio.run(one_world, False)
    anyio.run(one_world, True)  # a new coordinator: new store, new groups
    report(int(os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))), "done")


if __name__ == "__main__":
    main()
