"""Communicators and windows are made as agreed calls (`engine.making`): ranks out of step
get an error on every rank, never a hang inside MPI, and the next calls work.

Run with ASYNCLOCK_STRAY_S small (the test sets 2 s) and at 3 ranks:

- `desync`: Horovod's test_torch.py at 3 ranks left rank 1 in one more reduce-scatter
  than the others (an assertion failed on some ranks only inside a loop of them) while
  ranks 0 and 2 went on to `add_process_set`. Here rank 1 issues one more allreduce and
  the others make a process set: both calls fail with `UnmatchedError` on their ranks,
  then every rank makes the set and uses it.
- `differ`: ranks make different process sets: the same `MismatchError` on every rank,
  naming each rank's call.
- `takeover`: ranks that stopped waiting for a process set (a timeout) and ask for it
  again get the one that pairs with the late rank's.
- `--hvd`: rank 0 makes one `DistributedOptimizer` more than the others while they run
  an allreduce; both fail, then the job goes on.
"""

from __future__ import annotations

import sys
import time

import anyio
import torch
from _common import report, run

import asynclock
from asynclock import MismatchError, UnmatchedError


async def check_desync(c: asynclock.Coordinator) -> None:
    start = time.monotonic()
    try:
        if c.rank == 1:
            await c.allreduce(torch.ones(4))  # the others never issue this one
        else:
            await c.process_set([0, 2])
    except UnmatchedError as exc:
        text = str(exc)
        assert "make" in text and "allreduce" in text, text
    else:
        raise AssertionError("an out-of-step call went through")
    waited = time.monotonic() - start
    await c.barrier()  # the next call every rank issues works
    evens = await c.process_set([0, 2])
    if evens.included:
        got = await evens.api.allreduce(torch.full((3,), float(c.rank)))
        assert torch.equal(got, torch.full((3,), 2.0)), got
    assert torch.equal(await c.allreduce(torch.ones(1)), torch.full((1,), float(c.size)))
    await c.remove_process_set(evens)
    report(c.rank, "desync", f"{waited:.1f}s")


async def check_differ(c: asynclock.Coordinator) -> None:
    try:
        await c.process_set([0, 1] if c.rank == 0 else [0, 2])
    except MismatchError as exc:
        text = str(exc)
        assert "make process set" in text and "[0, 1]" in text and "[0, 2]" in text, text
    else:
        raise AssertionError("ranks made different process sets")
    tail = await c.process_set(range(1, c.size))
    if tail.included:
        got = await tail.api.allreduce(torch.ones(2))
        assert torch.equal(got, torch.full((2,), float(c.size - 1))), got
    report(c.rank, "differ")


async def check_takeover(c: asynclock.Coordinator) -> None:
    """A rank that stopped waiting for a make (a timeout) and makes the same thing
    again takes the make in flight over: it pairs with the late rank's."""
    if c.rank == 1:
        await anyio.sleep(1.0)  # late, outside any collective
    else:
        with anyio.move_on_after(0.2) as scope:
            await c.process_set([0, 2])
        assert scope.cancelled_caught, "the late rank was not waited for"
    evens = await c.process_set([0, 2])
    if evens.included:
        got = await evens.api.allreduce(torch.full((2,), float(c.rank)))
        assert torch.equal(got, torch.full((2,), 2.0)), got
    await c.remove_process_set(evens)
    report(c.rank, "takeover")


async def main() -> None:
    async with asynclock.start() as c:
        assert c.size == 3, "run at 3 ranks"
        await check_desync(c)
        await check_differ(c)
        await check_takeover(c)
        report(c.rank, "done")


def check_hvd() -> None:
    import asynclock.torch as hvd

    hvd.init()
    rank = hvd.rank()
    model = torch.nn.Linear(4, 1)
    first = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
    start = time.monotonic()
    try:
        if rank == 0:  # one optimizer more than the others: a gradient channel of its own
            hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
        else:
            hvd.allreduce(torch.ones(2))
    except UnmatchedError as exc:
        assert "make" in str(exc), exc
    else:
        raise AssertionError("an out-of-step optimizer went through")
    report(rank, "optimizer_desync", f"{time.monotonic() - start:.1f}s")
    got = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    assert torch.equal(got, torch.full((2,), float(hvd.size()))), got
    other = torch.nn.Linear(4, 1)
    second = hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                      named_parameters=other.named_parameters())
    for opt, net in ((first, model), (second, other)):
        opt.zero_grad()
        net(torch.full((2, 4), float(rank))).sum().backward()
        opt.step()
        assert torch.allclose(net.weight.grad, torch.full((1, 4), 2.0)), net.weight.grad
    report(rank, "optimizer_after")
    hvd.shutdown()
    report(rank, "done")


if __name__ == "__main__":
    if "--hvd" in sys.argv:
        check_hvd()
    else:
        run(main)
