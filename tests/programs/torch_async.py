"""The async train step on real ranks (asyncio, or trio with --trio).

Checks the loop stays live during backward (deterministically: backward
cannot finish unless a side task runs), the three update modes agree bit
for bit, `no_sync()` accumulation, and cancellation in the middle of
backward leaving every rank consistent.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
from _common import expect, report, run
from torch_common import (
    BagOfTokens,
    assert_close,
    batch,
    flat,
    hooked,
    loss_fn,
    mlp,
    reference_grads,
    shard,
    token_loss,
)

import asynclock
from asynclock.torch import Tuning, broadcast_parameters_async

MiB = 1 << 20


def local(step: int, rank: int, size: int) -> Callable[..., torch.Tensor]:
    def loss(model: torch.nn.Module, r: int = rank) -> torch.Tensor:
        x, y = batch(step, size)
        return loss_fn(model, shard(x, r, size), shard(y, r, size))

    return loss


async def same_everywhere(c: asynclock.Coordinator, model: torch.nn.Module, what: str) -> None:
    rows = await c.allgather(flat(model)[None])
    for r in range(1, c.size):
        assert torch.equal(rows[0], rows[r]), f"{what}: rank {r} differs from rank 0"


async def check_basic(c: asynclock.Coordinator) -> None:
    """Four steps match single-process training on the global batch."""
    model, ref = mlp(seed=c.rank + 20), mlp(seed=20)  # ranks start apart: broadcast fixes it
    await broadcast_parameters_async(c, model.state_dict(), 0)
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for n in range(4):
        async with step:
            await step.backward(local(n, c.rank, c.size)(model))
        ref_opt.zero_grad()
        (sum(local(n, c.rank, c.size)(ref, r) for r in range(c.size)) / c.size).backward()
        ref_opt.step()
    assert torch.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6), "drifted"
    await same_everywhere(c, model, "basic")
    stats = step.statistics()
    assert stats.steps == 4 and stats.rounds == 4 and stats.plan_generation == 1, stats
    report(c.rank, "basic", f"{stats}")
    report(c.rank, "transport_" + {"ShmTransport": "shm", "GlooRounds": "gloo"}.get(
        type(step.reducer.transport).__name__, "allreduce"))


async def check_loop_live_during_backward(c: asynclock.Coordinator) -> None:
    """Backward blocks until a side task on the loop runs: a blocked loop fails here."""
    model = mlp(seed=21)
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.1))
    in_backward, side_ran = threading.Event(), threading.Event()
    waited: list[bool] = []

    def gate(grad: torch.Tensor) -> torch.Tensor:
        in_backward.set()
        waited.append(side_ran.wait(60))
        return grad

    async def side_task() -> None:
        while not in_backward.is_set():
            await anyio.sleep(0.001)
        side_ran.set()
        total = await c.allreduce(torch.ones(3))  # user traffic during the step
        assert torch.equal(total, torch.full((3,), float(c.size)))

    async with anyio.create_task_group() as tg:
        tg.start_soon(side_task)
        async with step:
            x, y = batch(0, c.size)
            h = model[0](shard(x, c.rank, c.size))
            h.register_hook(gate)
            out = model[2:](torch.tanh(h))
            await step.backward(torch.nn.functional.cross_entropy(out, shard(y, c.rank, c.size)))
    assert waited == [True], f"the side task did not run during backward: {waited}"
    await same_everywhere(c, model, "loop live")
    report(c.rank, "loop_live_during_backward")


async def check_modes_bit_identical(c: asynclock.Coordinator) -> None:
    tuning = Tuning(bucket_cap_mb=160 / MiB, first_bucket_mb=48 / MiB)
    models = [mlp(seed=22, hidden=12) for _ in range(3)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    steps = [c.train_step(opt, tuning=tuning, **kw)
             for opt, kw in zip(opts, [{}, {"per_bucket_step": True},
                                       {"gate_forward": True, "model": models[2]}], strict=True)]
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]
    for n in range(5):
        for m, step, sched in zip(models, steps, scheds, strict=True):
            async with step:
                loss = await step.forward(local(n, c.rank, c.size), m)
                await step.backward(loss)
            sched.step()  # a deferred update still applies the rate of its own step
    assert steps[2].statistics().deferred_pending, "the gated step did not defer its update"
    try:
        models[2](torch.zeros(1, 6))
    except RuntimeError as exc:
        assert "event loop thread" in str(exc), exc  # deterministic: updates are deferred
    else:
        raise AssertionError("a gated forward on the loop thread was allowed")
    await steps[2].flush()
    for label, m in (("per_bucket", models[1]), ("gated", models[2])):
        assert torch.equal(flat(models[0]), flat(m)), f"{label} differs from plain"
    await same_everywhere(c, models[2], "modes")
    report(c.rank, "modes_bit_identical")


async def check_no_sync(c: asynclock.Coordinator) -> None:
    model = mlp(seed=23)
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.0), zero_grad=False)
    micro = [local(30 + m, c.rank, c.size) for m in range(3)]
    want = reference_grads(model, c.size, lambda mdl, r: sum(f(mdl, r) for f in micro))
    async with step:
        with step.no_sync():
            await step.backward(micro[0](model))
            await step.backward(micro[1](model))
        await step.backward(micro[2](model))
    for (name, p), w in zip(model.named_parameters(), want, strict=True):
        assert_close(p.grad, w, f"no_sync {name}", 1e-5, 3e-6)
    report(c.rank, "no_sync")


async def check_cancel_during_backward(c: asynclock.Coordinator) -> None:
    """Rank 0's step task is cancelled mid-backward; the round still completes."""
    model, ref = mlp(seed=24), mlp(seed=24)
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.1))
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    in_backward, cancel_sent = threading.Event(), threading.Event()
    scope = anyio.CancelScope()

    def hold(grad: torch.Tensor) -> torch.Tensor:
        in_backward.set()
        assert cancel_sent.wait(60), "cancel never sent"
        return grad

    async def canceller() -> None:
        while not in_backward.is_set():
            await anyio.sleep(0.001)
        scope.cancel()
        cancel_sent.set()

    for n in range(2):
        async with anyio.create_task_group() as tg:
            if c.rank == 0 and n == 0:
                tg.start_soon(canceller)
            with scope if c.rank == 0 and n == 0 else anyio.CancelScope():
                async with step:
                    x, y = batch(n, c.size)
                    h = model[0](shard(x, c.rank, c.size))
                    if c.rank == 0 and n == 0:
                        h.register_hook(hold)
                    out = model[2:](torch.tanh(h))
                    loss = torch.nn.functional.cross_entropy(out, shard(y, c.rank, c.size))
                    await step.backward(loss)
                    await anyio.sleep(0)  # a cancelled rank would stop here
        ref_opt.zero_grad()
        (sum(local(n, c.rank, c.size)(ref, r) for r in range(c.size)) / c.size).backward()
        ref_opt.step()
    if c.rank == 0:
        assert scope.cancelled_caught, "the cancellation did not arrive"
    assert step.statistics().steps == 2, step.statistics()
    await same_everywhere(c, model, "cancel")
    assert torch.allclose(flat(model), flat(ref), rtol=1e-5, atol=1e-6), "cancel lost an update"
    report(c.rank, "cancel_during_backward")


async def check_sparse_gated_and_refused_gate(c: asynclock.Coordinator) -> None:
    """A sparse embedding trains under a gated train step like a dense one in one
    process; a gate that misses some of the optimizer's parameters is refused on
    entry, on every rank, and leaves no hook behind."""
    model, ref = BagOfTokens(seed=31), BagOfTokens(seed=31, sparse=False)
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model=model,
                        gate_forward=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for n in range(3):
        async with step:
            loss = await step.forward(token_loss(n, c.rank), model)
            await step.backward(loss)
        ref_opt.zero_grad()
        (sum(token_loss(n, r)(ref) for r in range(c.size)) / c.size).backward()
        ref_opt.step()
    await step.flush()
    assert_close(flat(model), flat(ref), "sparse, gated train step", rtol=1e-5, atol=1e-6)
    await same_everywhere(c, model, "sparse, gated")
    other = mlp(seed=23)
    bad = c.train_step(torch.optim.SGD(other.parameters(), lr=0.1), model=other[0],
                       gate_forward=True)
    try:
        async with bad:
            raise AssertionError("entered a gated step that misses parameters")
    except ValueError as exc:
        assert "are not in the gated model" in str(exc), exc
    assert not hooked(other), f"the refused step left hooks on {hooked(other)}"
    report(c.rank, "sparse_gated_refused_gate")


async def check_sharded(c: asynclock.Coordinator) -> None:
    """`shard_optimizer=True`: plain and gated train steps give the unsharded bits (Adam,
    a scheduler stepped between blocks); where no shared window exists (other backend,
    ASYNCLOCK_NODE_WINDOW=0) the first block raises the same ValueError on every rank."""
    tuning = Tuning(bucket_cap_mb=160 / MiB, first_bucket_mb=48 / MiB)
    models = [mlp(seed=23, hidden=12) for _ in range(3)]
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    kws: list[dict[str, Any]] = [{}, {"shard_optimizer": True},
                                 {"shard_optimizer": True, "gate_forward": True,
                                  "model": models[2]}]
    steps = [c.train_step(opt, tuning=tuning, **kw) for opt, kw in zip(opts, kws, strict=True)]
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]
    if not shared_window(c):
        try:
            async with steps[1]:
                pass
        except ValueError as exc:
            assert "shared-memory window" in str(exc), exc
            report(c.rank, "sharded_refused")
            return
        raise AssertionError("shard_optimizer accepted without a shared window")
    for n in range(5):
        for m, step, sched in zip(models, steps, scheds, strict=True):
            async with step:
                loss = await step.forward(local(n, c.rank, c.size), m)
                await step.backward(loss)
            sched.step()
    await steps[2].flush()
    for label, m in (("sharded", models[1]), ("sharded gated", models[2])):
        assert torch.equal(flat(models[0]), flat(m)), f"{label} differs from unsharded"
    assert opts[1].state_dict()["state"].keys() == opts[0].state_dict()["state"].keys()
    for step in steps[1:]:
        step.close()  # private parameters again
    assert all(p.data_ptr() != q.data_ptr() for p in models[1].parameters()
               for q in models[2].parameters())
    report(c.rank, "sharded_train_step")


async def check_horovod_calls_from_a_worker_thread(c: asynclock.Coordinator) -> None:
    """Inside the async API, Horovod-style calls work from a worker thread (they go
    through the loop that runs the engine, sync and async forms alike), and on the
    loop's own thread they raise, naming the worker thread."""
    import asynclock.torch as hvd

    def horovod_style() -> tuple[torch.Tensor, torch.Tensor]:
        total = hvd.allreduce(torch.full((4,), float(c.rank)), op=hvd.Sum)
        handle = hvd.allreduce_async(torch.ones(2), op=hvd.Sum)
        return total, hvd.synchronize(handle)

    total, ones = await anyio.to_thread.run_sync(horovod_style)
    assert torch.equal(total, torch.full((4,), float(sum(range(c.size))))), total
    assert torch.equal(ones, torch.full((2,), float(c.size))), ones
    expect(RuntimeError, "worker thread", lambda: hvd.allreduce(torch.ones(2)))
    total = await c.allreduce(torch.ones(1))
    assert torch.equal(total, torch.full((1,), float(c.size))), total
    report(c.rank, "horovod_calls_from_a_thread")


def shared_window(c: asynclock.Coordinator) -> bool:
    return os.environ.get("ASYNCLOCK_NODE_WINDOW", "1") != "0" and c.backend.name == "mpi"


async def main() -> None:
    torch.set_num_threads(1)
    async with asynclock.start() as c:
        checks: list[Callable[[asynclock.Coordinator], Awaitable[None]]] = [
            check_basic, check_loop_live_during_backward, check_modes_bit_identical,
            check_no_sync, check_cancel_during_backward, check_sparse_gated_and_refused_gate,
            check_sharded, check_horovod_calls_from_a_worker_thread]
        for check in checks:
            await check(c)
        report(c.rank, "done")


if __name__ == "__main__":
    run(main)
