"""The NCCL path's code on CPU tensors over gloo (ASYNCLOCK_CUDA_PATH=gloo-twin): what a
GPU job runs for CUDA tensors, with only the backend name changed (`engine.device_pg`).

Checks exact values for every op and dtype it takes, in place and not, broadcasts from
every root, allgathers whose dim 0 differs by rank (one rank's small enough to ride
inline, the others' not), reduce-scatters split unevenly, alltoalls with uneven and
empty splits, that the data went through the channel's process group (its call count),
that a mismatch or a bad argument is still refused by the header round on every rank,
that a cancelled caller leaves the ranks in step, and that a process set's channel has
a group of its own. `--hvd`: the drop-in's calls (broadcast_parameters and
broadcast_optimizer_state too) through the same group, then a reset as an elastic one
makes it: the old group aborted (rank 0's store no longer listening), a new one made
and exact. `--join`: ranks with less data join early (`join()`, `hvd.join()`, and a
DistributedOptimizer's uneven steps) while the others keep reducing through the group:
a joined rank's stand-ins go through the group too.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from typing import Any

if "--join" in sys.argv:
    os.environ["ASYNCLOCK_SHM"] = "0"  # gradient buckets through the group, not a window

import anyio
import torch
from _common import report, run

import asynclock
from asynclock import InvalidInputError, MismatchError, RemoteInputError, cuda
from asynclock._core.engine.device_pg import group_of

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


async def check_gather_scatter(c: asynclock.Coordinator) -> None:
    """Allgather, reduce-scatter and alltoall, sizes differing by rank, exact."""
    before = group_calls(c)
    r, n = c.rank, c.size
    for dtype in (torch.float32, torch.int16, torch.bfloat16):  # moved as bytes: any dtype
        got = await c.allgather(torch.full((r + 1, 3), r, dtype=dtype))
        want = torch.cat([torch.full((q + 1, 3), q, dtype=dtype) for q in range(n)])
        assert torch.equal(got, want), (dtype, got)
    # rank 0's is large, the others' would ride inline: every rank takes the group alike
    rows = (N if r == 0 else 1)
    got = await c.allgather(torch.full((rows,), float(r)))
    want = torch.cat([torch.full((N if q == 0 else 1,), float(q)) for q in range(n)])
    assert torch.equal(got, want), got[-4:]
    got = await c.allgather(torch.tensor(float(r)))  # a 0-d tensor: one row each
    assert torch.equal(got, torch.arange(n, dtype=torch.float32)), got
    calls = 3 + 2
    for d0 in (2 * n + 1, n, 1):  # uneven, even, fewer rows than ranks
        base = torch.arange(d0 * 5, dtype=torch.float64).reshape(d0, 5)
        full = n * base + sum(range(n))
        start = sum(split(d0, n)[:r])
        mine = full[start: start + split(d0, n)[r]]
        got = await c.reduce_scatter(base + r, asynclock.Sum)
        assert torch.equal(got, mine), (d0, got, mine)
        got = await c.reduce_scatter((base + r).float(), asynclock.Average)
        assert torch.allclose(got, (mine / n).float()), (d0, got)
        got = await c.reduce_scatter((base + r).long(), asynclock.Max)
        assert torch.equal(got, (base + n - 1).long()[start: start + split(d0, n)[r]]), got
        calls += 3
    splits = [r + q for q in range(n)]  # rank r sends r + q rows to rank q (0 to itself)
    send = torch.cat([torch.full((r + q, 2), 100 * r + q, dtype=torch.int64)
                      for q in range(n)])
    out, got_splits = await c.alltoall(send, splits)
    assert got_splits == [q + r for q in range(n)], got_splits
    want = torch.cat([torch.full((q + r, 2), 100 * q + r, dtype=torch.int64) for q in range(n)])
    assert torch.equal(out, want), out
    out, got_splits = await c.alltoall(torch.zeros(0, 3), [0] * n)  # nothing to move
    assert out.shape == (0, 3) and got_splits == [0] * n, (out.shape, got_splits)
    calls += 1  # an empty alltoall moves nothing through the group
    assert group_calls(c) - before == calls, (group_calls(c) - before, calls)
    report(r, "gather_scatter")


def split(d0: int, n: int) -> list[int]:
    base, extra = divmod(d0, n)
    return [base + (1 if q < extra else 0) for q in range(n)]


async def check_gather_errors(c: asynclock.Coordinator) -> None:
    """Mismatches and bad arguments fail on every rank; the group stays in step."""
    dtype = torch.float32 if c.rank == 0 else torch.float64
    try:
        await c.allgather(torch.ones(N, dtype=dtype))
    except MismatchError as exc:
        assert "float32" in str(exc) and "float64" in str(exc), exc
    else:
        raise AssertionError("an allgather of two dtypes went through")
    splits = [N + 1] + [N] * (c.size - 1) if c.rank == 0 else None  # rank 0's do not add up
    try:
        await c.alltoall(torch.ones(N * c.size), splits)
    except (InvalidInputError, RemoteInputError) as exc:
        assert "splits" in str(exc) or "rank 0" in str(exc), exc
    else:
        raise AssertionError("an alltoall with bad splits went through")
    try:
        await c.reduce_scatter(torch.ones(c.size * 4), "max" if c.rank == 0 else "sum")
    except MismatchError:
        pass
    else:
        raise AssertionError("a reduce-scatter of two ops went through")
    with anyio.CancelScope() as scope:  # cancelled at once: the engine still runs it
        scope.cancel()
        await c.allgather(torch.ones(N + c.rank))
    got = await c.allgather(torch.full((2,), float(c.rank)))
    assert torch.equal(got, torch.arange(c.size).repeat_interleave(2).float()), got
    report(c.rank, "gather_errors")


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
        got = await evens.api.allgather(torch.full((evens.rank + 1,), float(c.rank)))
        want = torch.cat([torch.full((i + 1,), float(q)) for i, q in enumerate(evens.ranks)])
        assert torch.equal(got, want), got
        out, _ = await evens.api.alltoall(torch.full((evens.size * 2,), float(c.rank)))
        assert torch.equal(out, torch.tensor(evens.ranks, dtype=torch.float32)
                           .repeat_interleave(2)), out
        assert lane.transport.device_group.calls == 3, lane.transport.device_group.calls
    await c.remove_process_set(evens)
    report(c.rank, "process_set")


def user_group(c: asynclock.Coordinator) -> Any:
    group = c.lowlevel.engine.lanes[0].transport.device_group
    assert group is not None and group.backend == "gloo", group
    return group


def hvd_calls(hvd: Any, c: asynclock.Coordinator) -> None:
    """The drop-in's collectives, and its parameter and optimizer broadcasts."""
    r, n = hvd.rank(), hvd.size()
    group = user_group(c)
    before = group.calls
    got = hvd.allgather(torch.full((r + 1, 2), float(r)))
    assert torch.equal(got, torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)]))
    got = hvd.reducescatter(torch.full((2 * n + 1, 2), float(r + 1)), op=hvd.Sum)
    assert torch.equal(got, torch.full((split(2 * n + 1, n)[r], 2), float(sum(range(1, n + 1)))))
    got = hvd.alltoall(torch.full((2 * n,), float(r)))
    assert torch.equal(got, torch.arange(n).repeat_interleave(2).float()), got
    torch.manual_seed(r)
    model = torch.nn.Linear(200, 100)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    torch.manual_seed(0)
    assert torch.equal(model.weight, torch.nn.Linear(200, 100).weight)
    opt = torch.optim.Adam(model.parameters())
    model(torch.full((4, 200), float(r))).sum().backward()
    opt.step()
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    avg = opt.state[model.weight]["exp_avg"]
    rows = hvd.allgather(avg.reshape(1, -1))
    assert all(torch.equal(rows[0], row) for row in rows), "optimizer state differs"
    evens = hvd.add_process_set(list(range(0, n, 2)))
    if r % 2 == 0:
        got = hvd.allgather(torch.full((N,), float(r)), process_set=evens)
        assert torch.equal(got, torch.arange(0, n, 2).repeat_interleave(N).float())
    hvd.remove_process_set(evens)
    # allgather, reducescatter, alltoall, the weight and bias, and the state's allgather
    assert group.calls - before >= 6, group.calls - before
    report(r, "hvd_calls")


def steps_of(rank: int) -> int:
    return 2 + rank  # rank 0 joins first, the last rank last


async def check_join(c: asynclock.Coordinator) -> None:
    """Rank r runs 2 + r steps of allreduces through the group, then joins: every
    rank, joined or not, takes part in every round through the group, and the
    results are the live ranks' (an average divides by the full size)."""
    before = group_calls(c)
    r, n = c.rank, c.size
    for step in range(steps_of(r)):
        live = [q + 1.0 + step for q in range(n) if step < steps_of(q)]
        x = float(r + 1 + step)
        got = await c.allreduce(torch.full((N,), x), asynclock.Sum)
        assert torch.equal(got, torch.full((N,), sum(live))), (step, got[:3])
        got = await c.allreduce(torch.full((N, 2), x), asynclock.Average)
        assert torch.allclose(got, torch.full((N, 2), sum(live) / n)), (step, got[0])
        ints = torch.full((N,), int(x), dtype=torch.int64)
        await c.allreduce_(ints, asynclock.Min)
        assert torch.equal(ints, torch.full((N,), int(min(live)), dtype=torch.int64)), ints[:2]
        await c.barrier()
    last = await c.join()
    assert last == n - 1, (r, last)
    rounds = 3 * steps_of(n - 1)  # the last rank's steps: every rank is in each of them
    assert group_calls(c) - before == rounds, (r, group_calls(c) - before, rounds)
    got = await c.allreduce(torch.ones(N))  # every rank back in step
    assert torch.equal(got, torch.full((N,), float(n))), got[:3]
    report(r, "join")


async def check_path_mismatch(c: asynclock.Coordinator) -> None:
    """Rank 0's numpy array goes over MPI, the others' tensors through the group: the
    header round refuses the call on every rank instead of each waiting on its own
    transport."""
    import numpy as np

    data: Any = np.ones(N, np.float32) if c.rank == 0 else torch.ones(N)
    try:
        await c.allreduce(data)
    except MismatchError as exc:
        assert "via process group" in str(exc), exc
    else:
        raise AssertionError("an allreduce over two transports went through")
    got = await c.allreduce(torch.ones(N))
    assert torch.equal(got, torch.full((N,), float(c.size))), got[:3]
    report(c.rank, "path_mismatch")


async def join_async() -> None:
    async with asynclock.start() as c:
        await check_join(c)
        if c.size > 1:
            await check_path_mismatch(c)


def hvd_join() -> None:
    """Horovod's join test, through the group (others average, the first rank joined),
    then a DistributedOptimizer whose ranks run different step counts, its buckets
    through the group."""
    import asynclock.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    group = user_group(hvd_coordinator())
    before = group.calls
    a = torch.arange(float(N)) + 1
    if rank == 0:
        last = hvd.join()
    else:
        got = hvd.synchronize(hvd.allreduce_async(a, name="tensor_a"))
        assert torch.allclose(got, a * (size - 1) / size), got[:3]
        last = hvd.join()
    assert last == size - 1 and group.calls - before == 1, (last, group.calls - before)
    report(rank, "hvd_join")
    model = torch.nn.Linear(200, 100, bias=False)
    torch.nn.init.zeros_(model.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters())
    steps = [steps_of(q) for q in range(size)]
    for step in range(steps[rank]):
        opt.zero_grad()
        model(torch.full((1, 200), float(rank + 1 + step))).sum().backward()
        opt.step()
        want = sum(q + 1.0 + step for q in range(size) if step < steps[q]) / size
        assert torch.allclose(model.weight.grad, torch.full((100, 200), want)), (step, want)
    assert hvd.join() == size - 1
    assert group_of(opt._reducer.grad_lane) is not None, "the buckets went over MPI"
    report(rank, "hvd_join_optimizer")
    hvd.shutdown()
    report(rank, "done")


def hvd_coordinator() -> asynclock.Coordinator:
    from asynclock._core.runtime import coordinator as runtime

    return runtime.coordinator()


def still_listening(where: tuple[str, int]) -> bool:
    """Whether a store still accepts connections at `where`, 2 s after it was let go
    (its own thread closes the socket)."""
    for _ in range(100):
        try:
            socket.create_connection(where, timeout=5).close()
        except ConnectionRefusedError:
            return False
        time.sleep(0.02)
    return True


def hvd_main() -> None:
    """The drop-in, then a reset as Horovod's elastic launcher makes one (`reform`):
    the old group is aborted, the new world makes a new one on a new store."""
    import asynclock.torch as hvd
    from asynclock._core.runtime import coordinator as runtime
    from asynclock._core.runtime.elastic import reform

    hvd.init()
    old = runtime.coordinator()
    hvd_calls(hvd, old)
    group = user_group(old)
    assert group.pg is not None
    where = (group.store.store.host, group.store.store.port)
    os.environ["HOROVOD_ELASTIC"] = "1"  # what reform() asks of the launcher
    new = reform()
    assert group.pg is None, "the old world's group was not aborted"
    assert group.store.store is None, "the old world's store was not closed"
    if old.rank == 0 and where != (user_group(new).store.store.host,
                                   user_group(new).store.store.port):
        assert not still_listening(where), f"the old world's store still listens on {where}"
    fresh = user_group(new)
    assert fresh is not group and fresh.store is not group.store and fresh.pg is None
    got = hvd.allreduce(torch.ones(N), op=hvd.Sum)
    assert torch.equal(got, torch.full((N,), float(new.size))), got[:4]
    assert fresh.calls == 1 and fresh.pg is not None and group.pg is None, fresh.calls
    report(new.rank, "reset")
    hvd.shutdown()
    report(new.rank, "done")


async def describe_only() -> None:
    async with asynclock.start() as c:
        print(f"rank {c.rank}: {cuda.describe()}", flush=True)
        report(c.rank, "describe")


async def main() -> None:
    async with asynclock.start() as c:
        text = cuda.describe()
        assert "gloo-twin through a private process group" in text, text
        await check_values(c)
        await check_gather_scatter(c)
        await check_gather_errors(c)
        await check_mismatch_and_cancel(c)
        await check_process_set(c)
        report(c.rank, "done")


if __name__ == "__main__":
    if "--join" in sys.argv:
        run(join_async)
        hvd_join()
    elif "--hvd" in sys.argv:
        hvd_main()
    else:
        run(describe_only if "--describe" in sys.argv else main)
