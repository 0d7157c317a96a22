"""Uneven data with join semantics, and per-epoch sharding, on real ranks.

Rank r has `2 + 2r` batches in epoch 0 (reversed in epoch 1); after each
batch it allreduces; ranks that ran out wait in `coord.join()` and answer
with the op's identity, so every result equals the reduction over the
ranks still active in that round. Usage: sync_join.py [--trio]
"""

from __future__ import annotations

import numpy as np
import torch
from _common import report
from sync_common import run_or_abort

import asynclock
from asynclock._tools.data import ShardSampler


def batches(rank: int, size: int, epoch: int) -> int:
    r = rank if epoch == 0 else size - 1 - rank
    return 2 + 2 * r


def active_ranks(step: int, size: int, epoch: int) -> list[int]:
    return [r for r in range(size) if batches(r, size, epoch) > step]


async def run_epoch(c: asynclock.Coordinator, epoch: int) -> int:
    for step in range(batches(c.rank, c.size, epoch)):
        live = active_ranks(step, c.size, epoch)
        g = torch.full((3, 4), float(c.rank + 1))
        total = await c.allreduce(g, name="grad")
        assert total.shape == (3, 4) and torch.equal(total, torch.full((3, 4), float(
            sum(r + 1 for r in live)))), (step, total)
        avg = await c.allreduce(torch.ones(5, dtype=torch.bfloat16), "average")
        assert torch.allclose(avg.float(), torch.full((5,), len(live) / c.size), atol=1e-2), avg
        low = np.full(2, 10 + c.rank, np.int32)
        await c.allreduce_(low, "min")
        assert (low == 10 + min(live)).all(), low
        high = await c.allreduce(np.full(2, -c.rank, np.float64), "max")
        assert (high == -min(live)).all(), high
    return await c.join()


async def check_mismatch(c: asynclock.Coordinator) -> None:
    try:
        await c.allreduce(torch.zeros(3 + c.rank))
    except asynclock.MismatchError as exc:
        assert "float32[3]" in str(exc) and "float32[4]" in str(exc), exc
    else:
        raise AssertionError("mismatched join allreduce accepted")


async def check_sampler(c: asynclock.Coordinator) -> None:
    """Shards of one epoch are disjoint and cover the dataset; epochs differ."""
    n = 23
    shards = []
    for epoch in (0, 1):
        s = ShardSampler.for_coordinator(c, n, seed=5)
        s.set_epoch(epoch)
        got = await c.allgather_object(list(s))
        assert {len(x) for x in got} == {len(s)}
        flat = [i for x in got for i in x]
        assert set(flat) == set(range(n)) and len(flat) == len(s) * c.size
        shards.append(got)
    assert shards[0] != shards[1]


async def main() -> None:
    async with asynclock.start() as c:
        last = await run_epoch(c, 0)
        assert last == c.size - 1, last
        report(c.rank, "join_epoch0", str(last))
        last = await run_epoch(c, 1)
        assert last == 0, last
        report(c.rank, "join_epoch1", str(last))
        assert await c.join() == c.size - 1  # nobody had data: all join in round 0
        report(c.rank, "join_empty")
        await check_mismatch(c)
        report(c.rank, "join_mismatch")
        await check_sampler(c)
        report(c.rank, "sampler")
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
