"""GPU checks of asynclock.cuda and staging (skipped without CUDA).

In-process tests use a world of one rank (the local backend), where every
collective still goes device → pinned host → device through the copy
streams, so stream ordering is fully exercised; the MPI jobs at the end run
tests/gpu/gpu_ranks.py on 1 and 2 ranks that share one GPU.

Race tests are built so that a missing wait shows up as a wrong value: the
producer writes the tensor after a ~100 ms spin kernel on a side stream,
and the collective is started right away. `test_race_control_is_real`
proves that a copy which does not wait really reads the stale value.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: mpijob
from gpu_util import gpu_sleep, late_fill  # noqa: E402
from mpijob import assert_all_ok, run_job  # noqa: E402

from asynclock import cuda
from asynclock._core.device.waiting import WaitPolicy  # noqa: E402
from asynclock._core.engine import staging  # noqa: E402
from asynclock._core.runtime.coordinator import Coordinator  # noqa: E402
from asynclock._core.transports.local import LocalBackend  # noqa: E402

if os.environ.get("ASYNCLOCK_REQUIRE_GPU") == "1" and not torch.cuda.is_available():
    raise RuntimeError("ASYNCLOCK_REQUIRE_GPU=1 but torch sees no CUDA device: "
                       f"torch {torch.__version__}, {sys.executable}")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SLOW_MS = 100.0
N = 1 << 20


def on_local(body: Callable[[Coordinator], Awaitable[None]], loop: str = "asyncio") -> None:
    async def main() -> None:
        async with Coordinator(LocalBackend()) as coord:
            with anyio.fail_after(60):
                await body(coord)
            assert staging.held(coord.lowlevel.user_lane) == 0

    anyio.run(main, backend=loop)


def fresh(n: int = N, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    t = torch.zeros(n, device="cuda", dtype=dtype)
    torch.cuda.synchronize()  # test setup only: start from an idle device
    return t


def test_race_control_is_real() -> None:
    """A copy on another stream that does not wait reads the stale zeros."""
    g, side, other = fresh(), torch.cuda.Stream(), torch.cuda.Stream()
    host = torch.empty(N, pin_memory=True)
    late_fill(g, 7.0, SLOW_MS, side)
    with torch.cuda.stream(other):
        host.copy_(g, non_blocking=True)
    other.synchronize()
    assert host[0].item() == 0.0, "the copy waited anyway: the race tests below prove nothing"
    side.synchronize()
    assert g[0].item() == 7.0


@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_allreduce_waits_for_side_stream_via_bucket_sync(loop: str) -> None:
    async def body(coord: Coordinator) -> None:
        g, side, sync = fresh(), torch.cuda.Stream(), cuda.BucketSync()
        late_fill(g, 3.0, SLOW_MS, side)
        with torch.cuda.stream(side):
            sync.mark_ready()  # as a gradient hook does: on the producer's stream
        with sync.comm():
            handle = coord.allreduce_async(g)
        assert not sync.ready.query(), "producer already done: the test would prove nothing"
        out = await handle
        assert out.is_cuda and out.device == g.device
        assert torch.equal(out, torch.full_like(g, 3.0)), "collective read before the producer"
        assert sync.done is not None and sync.device == g.device

    on_local(body, loop)


def test_allreduce_inside_side_stream_context_waits_for_it() -> None:
    async def body(coord: Coordinator) -> None:
        g, side = fresh(), torch.cuda.Stream()
        with torch.cuda.stream(side):
            late_fill(g, 4.0, SLOW_MS)
            handle = coord.allreduce_async(g)  # current stream = side: staged after it
        assert torch.equal(await handle, torch.full_like(g, 4.0))

    on_local(body)


def test_allreduce_after_default_stream_producer() -> None:
    async def body(coord: Coordinator) -> None:
        g = fresh()
        late_fill(g, 5.0, SLOW_MS)
        assert torch.equal(await coord.allreduce(g), torch.full_like(g, 5.0))

    on_local(body)


@pytest.mark.parametrize("mode", ["poll", "thread"])
def test_awaiting_an_event_does_not_block_other_tasks(mode: str) -> None:
    async def main() -> None:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            gpu_sleep(SLOW_MS)
        event = cuda.record(side)
        assert event is not None and not event.query()
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await anyio.sleep(0.001)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            with anyio.fail_after(30):
                await cuda.wait(event, policy=WaitPolicy(mode=mode))
            tg.cancel_scope.cancel()
        assert event.query() and ticks >= 5, f"only {ticks} ticks while waiting"

    anyio.run(main)


def test_wait_on_a_stream_covers_work_queued_so_far() -> None:
    async def main() -> None:
        side, t = torch.cuda.Stream(), fresh()
        late_fill(t, 9.0, SLOW_MS, side)
        await cuda.wait(side)
        assert side.query() and t[0].item() == 9.0

    anyio.run(main)


def test_stream_wait_orders_consumer_without_cpu_wait() -> None:
    g, side, consumer = fresh(), torch.cuda.Stream(), torch.cuda.Stream()
    late_fill(g, 2.0, SLOW_MS, side)
    ready = cuda.record(side)
    cuda.stream_wait(consumer, ready)
    assert not ready.query(), "stream_wait must not block the CPU"
    with torch.cuda.stream(consumer):
        total = g.sum()
    consumer.synchronize()
    assert total.item() == 2.0 * N


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [4, 100_003])
def test_every_collective_takes_cuda_tensors(dtype: torch.dtype, n: int) -> None:
    async def body(coord: Coordinator) -> None:
        x = (torch.arange(n, device="cuda") % 7).to(dtype)
        for result in (await coord.allreduce(x), await coord.broadcast(x),
                       await coord.reduce_scatter(x), (await coord.alltoall(x))[0]):
            assert result.device == x.device and torch.equal(result, x)
        gathered = await coord.allgather(x.view(-1, 1))
        assert gathered.shape == (n, 1) and torch.equal(gathered.view(-1), x)
        y = x.clone()
        assert await coord.allreduce_(y, "average") is y and torch.equal(y, x)
        z = torch.zeros_like(x)
        late_fill(z, 1, 20.0)
        await coord.broadcast_(z)
        assert torch.equal(z, torch.ones_like(x))

    on_local(body)


def test_consumer_stream_waits_for_done() -> None:
    async def body(coord: Coordinator) -> None:
        g, side, sync = fresh(), torch.cuda.Stream(), cuda.BucketSync()
        late_fill(g, 6.0, SLOW_MS, side)
        with torch.cuda.stream(side):
            sync.mark_ready()
        with sync.comm():
            h = coord.allreduce_async_(g, "sum")
        assert await h is g
        consumer = torch.cuda.Stream()
        sync.consume(consumer)
        with torch.cuda.stream(consumer):
            total = g.sum()
        await cuda.wait(consumer)
        assert total.item() == 6.0 * N

    on_local(body)


def test_many_buckets_in_flight_keep_order_and_values() -> None:
    async def body(coord: Coordinator) -> None:
        side = torch.cuda.Stream()
        grads = [fresh(1000 * (k + 1)) for k in range(16)]
        handles: list[Any] = []
        for k, g in enumerate(grads):
            sync = cuda.BucketSync()
            late_fill(g, float(k), 5.0, side)
            with torch.cuda.stream(side):
                sync.mark_ready()
            with sync.comm():
                handles.append(coord.allreduce_async(g, name=f"b{k}"))
        assert staging.held(coord.lowlevel.user_lane) >= 1, "nothing was held behind a copy"
        for k, h in enumerate(handles):
            assert torch.equal(await h, torch.full_like(grads[k], float(k))), f"bucket {k}"

    on_local(body)


def test_cancelled_waiter_does_not_cancel_the_staged_collective() -> None:
    async def body(coord: Coordinator) -> None:
        g = fresh()
        late_fill(g, 8.0, SLOW_MS)
        handle = coord.allreduce_async(g)
        with anyio.move_on_after(0.001):
            await handle
        assert not handle.done()
        await coord.drain()
        assert handle.done() and torch.equal(handle.result(), torch.full_like(g, 8.0))

    on_local(body)


def test_set_device_maps_local_rank_onto_gpus() -> None:
    count = torch.cuda.device_count()
    assert cuda.set_device(0) == 0
    assert cuda.set_device(count) == 0  # more ranks than GPUs: they share
    assert cuda.available()


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [1, 2])
def test_ranks_on_one_gpu(nranks: int) -> None:
    """1 rank, and 2 ranks sharing the GPU: races, collectives, mixed devices, buckets."""
    job = run_job("../gpu/gpu_ranks.py", nranks, timeout=240)
    assert_all_ok(job, nranks)
    for label in ("race_inplace", "collectives", "mixed_devices", "hooked_buckets", "direct"):
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"
