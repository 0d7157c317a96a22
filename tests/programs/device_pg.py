"""The NCCL path's code on CPU tensors over gloo (ASYNCLOCK_CUDA_PATH=gloo-twin): what a
GPU job runs for CUDA tensors, with only the backend name changed (`engine.device_pg`).

Checks exact values for every op and dtype it takes, in place and not, broadcasts from
every root, that the data went through the channel's process group (its call count),
that a mismatch is still refused by the header round on every rank, that a cancelled
caller leaves the ranks in step, and that a process set's channel has a group of its own.
"""

from __future__ import annotations

import sys

import anyio
import torch
from _common import report, run

import asynclock
from asynclock import MismatchError, cuda

N = 70_000  # past the header's inline payload and the small-call sizes alike


def group_calls(c: asynclock.Coordinator) -> int:
    group = c.lowlevel.engine.lanes[0].transport.device_group
    assert group is not None and group.backend == "gloo", group
    return int(group.calls)


async def check_values(c: asynclock.Coordinator) -> None:
    before = group_calls(c)
    r, n = c.rank, c.size
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
        x = torch.full((N,), r + 1, dtype=dtype)
        got = await c.allreduce(x, asynclock.Sum)
        assert torch.equal(got, torch.full((N,), sum(range(1, n + 1)), dtype=dtype)), got[:4]
        assert torch.equal(x, torch.full((N,), r + 1, dtype=dtype)), "out of place wrote x"
        y = torch.full((N,), float(r), dtype=dtype)
        await c.allreduce_(y, asynclock.Max)
        assert torch.equal(y, torch.full((N,), n - 1, dtype=dtype)), y[:4]
    avg = await c.allreduce(torch.full((N, 3), float(r)), asynclock.Average)
    assert torch.allclose(avg, torch.full((N, 3), (n - 1) / 2)), avg[0]
    for root in range(n):
        b = torch.full((N,), float(r))
        await c.broadcast_(b, root)
        assert torch.equal(b, torch.full((N,), float(root))), (root, b[:4])
    assert group_calls(c) - before == 4 * 2 + 1 + n, (group_calls(c), before)
    report(r, "values")


async def check_mismatch_and_cancel(c: asynclock.Coordinator) -> None:
    try:
        await c.allreduce(torch.ones(N + c.rank))
    except MismatchError as exc:
        assert f"float32[{N}]" in str(exc) and f"float32[{N + 1}]" in str(exc), exc
    else:
        raise AssertionError("a shape mismatch went through")
    with anyio.CancelScope() as scope:  # cancelled at once: the engine still runs it
        scope.cancel()
        await c.allreduce(torch.ones(N))
    got = await c.allreduce(torch.ones(N), asynclock.Sum)
    assert torch.equal(got, torch.full((N,), float(c.size))), got[:4]
    report(c.rank, "mismatch_cancel")


async def check_process_set(c: asynclock.Coordinator) -> None:
    evens = await c.process_set(range(0, c.size, 2))
    if evens.included:
        lane = evens.lane
        assert lane is not None and lane.transport.device_group is not None
        got = await evens.api.allreduce(torch.full((N,), 1.0), asynclock.Sum)
        assert torch.equal(got, torch.full((N,), float(evens.size))), got[:4]
        assert lane.transport.device_group.calls == 1, lane.transport.device_group.calls
    await c.remove_process_set(evens)
    report(c.rank, "process_set")


async def describe_only() -> None:
    async with asynclock.start() as c:
        print(f"rank {c.rank}: {cuda.describe()}", flush=True)
        report(c.rank, "describe")


async def main() -> None:
    async with asynclock.start() as c:
        text = cuda.describe()
        assert "gloo-twin through a private process group" in text, text
        await check_values(c)
        await check_mismatch_and_cancel(c)
        await check_process_set(c)
        report(c.rank, "done")


if __name__ == "__main__":
    run(describe_only if "--describe" in sys.argv else main)
