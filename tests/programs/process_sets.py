"""Process sets: collectives among a subset of ranks, beside the world's.

Default: the async API (`await coord.process_set(ranks)`); `--hvd`: Horovod's
API (`hvd.ProcessSet`, `hvd.init(process_sets=...)`, `process_set=`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from _common import report, run

import asynclock
from asynclock import InvalidInputError, MismatchError


async def check_async_api(c: asynclock.Coordinator) -> None:
    evens = await c.process_set(r for r in range(c.size) if r % 2 == 0)
    tail = await c.process_set(range(1, c.size)) if c.size > 1 else None
    stats = c.statistics()  # at once, before the poller reaps the sets' made calls
    assert stats.issued == stats.completed + stats.in_flight, stats
    assert evens.ranks == tuple(range(0, c.size, 2)) and evens.included == (c.rank % 2 == 0)
    if evens.included:
        got = await evens.api.allreduce(torch.full((3,), float(c.rank)))
        assert torch.equal(got, torch.full((3,), float(sum(evens.ranks)))), got
        root = evens.size - 1  # a set rank: the set's last member
        b = await evens.api.broadcast(torch.full((2,), float(c.rank)), root)
        assert torch.equal(b, torch.full((2,), float(evens.ranks[-1]))), b
        rows = await evens.api.allgather(torch.full((evens.rank + 1, 2), float(c.rank)))
        assert rows.shape[0] == sum(range(1, evens.size + 1)), rows.shape
        await evens.api.barrier()
    else:
        try:
            _ = evens.api
        except InvalidInputError as exc:
            assert f"rank {c.rank} is not in process set" in str(exc), exc
        else:
            raise AssertionError("a non-member got the set's API")
    if tail is not None and tail.included:
        big = await tail.api.allreduce(torch.ones(70_000))  # past the inline size
        assert torch.equal(big, torch.full((70_000,), float(tail.size)))
    world = await c.allreduce(torch.ones(1))  # the world's lanes are untouched
    assert torch.equal(world, torch.full((1,), float(c.size)))
    if evens.included and evens.size > 1:
        try:
            await evens.api.allreduce(torch.ones(2 + evens.rank))
        except MismatchError as exc:
            assert "float32[2]" in str(exc) and "float32[3]" in str(exc), exc
        else:
            raise AssertionError("mismatch inside a set was not detected")
    await c.remove_process_set(evens)
    try:
        _ = evens.api
    except InvalidInputError as exc:
        assert "removed" in str(exc) or "not in process set" in str(exc), exc
    else:
        raise AssertionError("a removed set still answered")
    assert torch.equal(await c.allreduce(torch.ones(1)), torch.full((1,), float(c.size)))
    report(c.rank, "async_api")


def check_hvd_api() -> None:
    import asynclock.torch as hvd

    firsts = hvd.ProcessSet([1, 0] if hvd_size_hint() > 1 else [0])
    hvd.init(process_sets=[firsts])  # made at init, on every rank
    rank, size = hvd.rank(), hvd.size()
    assert hvd.global_process_set.ranks == list(range(size)) and firsts.ranks == sorted(
        firsts.ranks) and firsts.process_set_id == 1, (hvd.global_process_set, firsts)
    if firsts.included():
        got = hvd.allreduce(torch.ones(3), op=hvd.Sum, process_set=firsts)
        assert torch.equal(got, torch.full((3,), float(firsts.size()))), got
    last = hvd.add_process_set([size - 1, 0])  # dynamic; sorted like Horovod's
    assert last.ranks == sorted({0, size - 1}) and last.size() == len(last.ranks)
    assert last.included() == (rank in last.ranks)
    assert last.rank() == (last.ranks.index(rank) if rank in last.ranks else -1)
    if rank in last.ranks:
        got = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum, process_set=last)
        assert torch.equal(got, torch.full((2,), float(sum(last.ranks)))), got
        avg = hvd.allreduce(torch.full((2,), float(rank)), process_set=last)  # Average
        assert torch.allclose(avg, torch.full((2,), sum(last.ranks) / len(last.ranks)))
        b = hvd.broadcast(torch.full((1,), float(rank)), root_rank=size - 1, process_set=last)
        assert torch.equal(b, torch.full((1,), float(size - 1))), b  # root: a world rank
        objs = hvd.allgather_object({"r": rank}, process_set=last)
        assert [o["r"] for o in objs] == last.ranks, objs
        hvd.barrier(process_set=last)
    else:
        try:
            hvd.allreduce(torch.ones(1), process_set=last)
        except ValueError as exc:
            assert "not in process set" in str(exc), exc
        else:
            raise AssertionError("a non-member's call went through")
    check_set_optimizer(hvd, last)
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(size)))
    assert hvd.remove_process_set(last) and last.ranks is None
    assert not hvd.remove_process_set(hvd.global_process_set)
    assert [p.process_set_id for p in hvd.process_sets()][0] == 0
    report(rank, "hvd_api")
    hvd.shutdown()
    report(rank, "done")


def check_set_optimizer(hvd: Any, ps: Any) -> None:
    """DistributedOptimizer(process_set=ps): members average over the set only (3 rounds:
    the first, the re-plan, shared memory after it); others step on their own
    gradients, as in Horovod."""
    rank = hvd.rank()
    model = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    sgd = torch.optim.SGD(model.parameters(), lr=0.0)
    if rank not in ps.ranks:
        local = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                         named_parameters=model.named_parameters(),
                                         process_set=ps)
        assert isinstance(local, torch.optim.SGD)
        local.zero_grad()
        model(torch.full((1, 4), 2.0)).sum().backward()
        local.synchronize()
        local.step()
        assert torch.equal(model.weight, torch.full((1, 4), -2.0)), model.weight  # own grad
        return
    opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(),
                                   process_set=ps)
    for step in range(3):
        opt.zero_grad()
        model(torch.full((1, 4), float(rank + step))).sum().backward()
        opt.step()
        want = sum(r + step for r in ps.ranks) / len(ps.ranks)
        assert torch.allclose(model.weight.grad, torch.full((1, 4), float(want))), (
            step, model.weight.grad, want)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                 named_parameters=model.named_parameters(), process_set=ps)
    except ValueError as exc:
        assert "already has a DistributedOptimizer" in str(exc), exc
    else:
        raise AssertionError("two optimizers shared a process set's gradient channel")


def hvd_size_hint() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


async def main() -> None:
    async with asynclock.start() as c:
        await check_async_api(c)
    report(c.rank, "done")


if "--hvd" in sys.argv:
    check_hvd_api()
else:
    run(main)
