"""What only the Horovod backend does: widened dtypes, fallbacks, and errors.

Usage: hvd_backend.py [--trio]   (run with ASYNCLOCK_BACKEND=horovod, or under horovodrun)

0. `widened`: int8/uint8/int16, which Horovod cannot reduce, go as int64 and
   wrap back exactly like MPI's narrow arithmetic; reduce_scatter with ops
   Horovod's reducescatter lacks (min/max/product) or fewer rows than ranks.

`cancel_detaches`: cancelling a task awaiting a Horovod data stage leaves the
op running to completion on every rank (no desync).

Horovod failures reach the caller as asynclock's BackendError on every rank:

1. `mismatch_poll` / `mismatch_wait`: a data stage whose shapes differ across
   ranks (as many elements, another shape) reaches Horovod. The header check
   would stop this before any data moves, so the program issues on the grad
   lane's channel directly, as a buggy transport user would. Horovod's
   coordinator fails the op on every rank; asynclock raises BackendError
   naming the Horovod op, both through the engine's poller (`Test`) and
   through a blocking `Wait` in a thread.
2. `alive`: Horovod and asynclock keep working after that error.
3. `small_never_horovod`: small collectives never touch Horovod (headers go
   over MPI, or the TCP mesh under gloo): after 50 of them the next Horovod
   op on the lane is still the lane's first, which the test also finds in
   Horovod's own timeline (HOROVOD_TIMELINE passes through) under its name.
4. `horovod_down`: Horovod shut down under asynclock: a collective that needs
   a Horovod data stage raises BackendError on every rank, while small
   collectives and barriers still complete.
"""

from __future__ import annotations

import anyio
import horovod.torch as hvd
import numpy as np
import torch
from _common import report, run

import asynclock
from asynclock import BackendError
from asynclock._core.base.ops import ReduceOp


def expect_backend_error(exc: BaseException | None, *needles: str) -> None:
    assert isinstance(exc, BackendError), f"expected BackendError, got {exc!r}"
    for needle in needles:
        assert needle in str(exc), f"{needle!r} not in {exc}"


def rows(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values near the top of int8's range, so int8 sums overflow and wrap."""
    return ((torch.arange(n) * 3 + rank * 7) % 50 + 80).to(dtype)


async def check_widened(c: asynclock.Coordinator) -> None:
    for dtype in (torch.int8, torch.uint8, torch.int16):
        everyone = [rows(r, 300, dtype).long() for r in range(c.size)]
        for op, ref in (("sum", sum(everyone)), ("max", torch.stack(everyone).amax(0)),
                        ("min", torch.stack(everyone).amin(0)),
                        ("product", torch.stack(everyone).prod(0))):
            got = await c.allreduce(rows(c.rank, 300, dtype), op)
            want = ref.to(dtype)  # int64 -> narrow wraps, as MPI's narrow sums do
            assert got.dtype == dtype and torch.equal(got, want), f"{op} {dtype}: {got[:4]}"
    full = torch.stack([rows(r, 4 * (2 * c.size + 1), torch.float32).reshape(-1, 4)
                        for r in range(c.size)])
    split = [2 + (r < 1) for r in range(c.size)]
    start = sum(split[: c.rank])
    for op, ref in (("min", full.amin(0)), ("max", full.amax(0)), ("product", full.prod(0))):
        got = await c.reduce_scatter(full[c.rank], op)
        assert torch.equal(got, ref[start: start + split[c.rank]]), f"reduce_scatter {op}"
    one = await c.reduce_scatter(torch.full((1, 40), float(c.rank + 1)), "sum")
    want_rows = 1 if c.rank == 0 else 0
    assert one.shape == (want_rows, 40) and torch.all(one == c.size * (c.size + 1) / 2), one
    report(c.rank, "widened")


async def check_cancel_detaches(c: asynclock.Coordinator) -> None:
    """Regression: cancelling the task awaiting a Horovod data stage detaches it;
    the op still completes on every rank, so the next collective is correct.

    Ordered, not timed: the other ranks issue the allreduce only after rank 0's
    waiter was cancelled (an asynclock event; under `horovodrun --gloo` there is
    no MPI world to signal through), so the op cannot have completed under the
    waiter. (Left to timing, it once did, in CI.)"""
    go = c.event("cancel-detaches-go")
    big = torch.ones(400_000) * (c.rank + 1)
    if c.rank != 0:
        await go.wait()
    handle = c.allreduce_async(big)  # issued on every rank in this order

    async def waiter() -> None:
        await handle
        raise AssertionError("the awaiting task was not cancelled")

    if c.rank == 0:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0)
            assert not handle.done(), "completed before the other ranks issued it"
            tg.cancel_scope.cancel()
        go.set()
    await c.drain()
    assert c.rank != 0 or c.statistics().detached >= 1, c.statistics()
    assert torch.all((await handle) == c.size * (c.size + 1) / 2)
    got = await c.allreduce(torch.full((1000,), 2.0))
    assert torch.all(got == 2.0 * c.size), got[:4]
    report(c.rank, "cancel_detaches")


async def check_mismatch(c: asynclock.Coordinator) -> None:
    chan = c.lowlevel.grad_lane.transport
    prefix = chan._prefix  # type: ignore[attr-defined]
    req = chan.iallreduce(None, np.ones((6,) if c.rank else (2, 3), np.float32), ReduceOp.SUM)
    error: BaseException | None = None
    try:
        await c.lowlevel.engine.wait(c.lowlevel.engine.track(req, "direct horovod allreduce"))
    except BaseException as exc:  # noqa: BLE001 - inspected below
        error = exc
    expect_backend_error(error, "Mismatched ALLREDUCE tensor shapes",
                         f"{prefix}.allreduce.sum.float32.6.s0")
    report(c.rank, "mismatch_poll")
    req = chan.iallreduce(None, np.ones((1000,) if c.rank else (10, 100)), ReduceOp.MAX)
    error = None
    try:
        await anyio.to_thread.run_sync(req.Wait)
    except BaseException as exc:  # noqa: BLE001
        error = exc
    expect_backend_error(error, "Mismatched ALLREDUCE tensor shapes",
                         f"{prefix}.allreduce.max.float64.1000.s0")
    report(c.rank, "mismatch_wait")


async def check_alive(c: asynclock.Coordinator) -> None:
    got = await c.allreduce(torch.ones(10_000) * (c.rank + 1))
    assert torch.all(got == c.size * (c.size + 1) / 2), got[:4]
    report(c.rank, "alive")


async def check_small_never_horovod(c: asynclock.Coordinator) -> None:
    lane = c.lowlevel.on_lane(c.lowlevel.sync_lane)
    for i in range(50):
        got = await lane.allreduce(torch.full((8,), float(i + c.rank)))
        assert torch.all(got == i * c.size + c.size * (c.size - 1) / 2)
    chan = c.lowlevel.sync_lane.transport
    assert chan._issued == 0, chan._issued  # type: ignore[attr-defined]
    await lane.allreduce(torch.ones(1000))
    assert chan._issued == 1, chan._issued  # type: ignore[attr-defined]
    report(c.rank, "small_never_horovod",
           f"{chan._prefix}.allreduce.sum.float32.1000.s0")  # type: ignore[attr-defined]


async def check_horovod_down(c: asynclock.Coordinator) -> None:
    hvd.shutdown()
    error: BaseException | None = None
    try:
        await c.allreduce(torch.ones(1000))
    except BaseException as exc:  # noqa: BLE001
        error = exc
    expect_backend_error(error, "Horovod has not been initialized")
    got = await c.allreduce(torch.full((4,), float(c.rank)))
    assert torch.all(got == c.size * (c.size - 1) / 2), got
    await c.barrier()
    report(c.rank, "horovod_down", c.backend.controller)  # type: ignore[attr-defined]


async def main() -> None:
    async with asynclock.start() as c:
        assert c.backend.name == "horovod", c.backend.describe()
        await check_widened(c)
        await check_cancel_detaches(c)
        await check_mismatch(c)
        await check_small_never_horovod(c)
        # after it: Horovod writes its timeline from a queue and drops what is still
        # queued when it is shut down (check_horovod_down); the ops of check_alive
        # push the sync lane's one op out to the file, which the test reads
        await check_alive(c)
        await check_horovod_down(c)
        report(c.rank, "done", c.backend.describe())


run(main)
