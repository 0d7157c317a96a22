"""Rank program: the staging gate keeps header order across ranks.

Rank 0 holds its first collective of each round behind an event that
completes only after some polls (the event protocol in plain Python: this
is how a GPU copy gates a collective), then starts a second one at once.
The other ranks start both at once. Without the gate, rank 0 would issue
the second header first and every rank would raise MismatchError.
`--detect` prints how CUDA tensors would travel in this MPI job.
"""

from __future__ import annotations

import sys

import numpy as np
from _common import report, run

import asynclock
from asynclock import cuda
from asynclock._core.base.header import Call
from asynclock._core.base.ops import Kind, ReduceOp
from asynclock._core.base.tensors import as_buffer
from asynclock._core.engine import staging
from asynclock._core.engine.collective_ops import AllreduceOp
from asynclock._core.runtime.coordinator import Coordinator


class FlipEvent:
    def __init__(self, n: int) -> None:
        self.left = n

    def query(self) -> bool:
        self.left -= 1
        return self.left < 0


def held_allreduce(c: Coordinator, x: np.ndarray, event: FlipEvent | None) -> AllreduceOp:
    lane = c.lowlevel.user_lane
    buf = as_buffer(x, writable=True)
    call = Call(Kind.ALLREDUCE, lane.next_seq(), op=int(ReduceOp.SUM), dtype=buf.code,
                shape=buf.shape, nbytes=buf.array.nbytes, name="held")
    op = AllreduceOp(lane, call, buf, buf.array, ReduceOp.SUM)
    staging.submit_after(c.lowlevel.engine, lane, op, event)
    return op


async def rounds(c: Coordinator) -> None:
    total = c.size * (c.size + 1) / 2
    for i in range(24):
        n = 5 if i % 2 else 40_000  # inline header payload, then a data stage
        event = FlipEvent(i * 7) if c.rank == 0 else None
        x = np.full(n, c.rank + 1.0)
        op = held_allreduce(c, x, event)
        later = c.allreduce_async(np.full(3, float(i)), name="later")
        assert (await later).tolist() == [i * c.size] * 3
        await c.lowlevel.engine.wait(op)
        assert (x == total).all(), f"round {i}: {x[:3]}"
    assert staging.held(c.lowlevel.user_lane) == 0


async def stage_fault(c: Coordinator) -> None:
    """Rank 0's CUDA copy fails (no CUDA here): everyone gets an error, then goes on."""
    import torch

    from asynclock._core.base.errors import InvalidInputError, RemoteInputError

    if c.rank == 0:
        host = torch.ones(64)
        buf = as_buffer(host)
        buf.wrap = staging.Staged(torch.ones(64), host, buf.wrap, None, None)
        call = Call(Kind.ALLREDUCE, c.lowlevel.user_lane.next_seq(), op=int(ReduceOp.SUM),
                    dtype=buf.code, shape=buf.shape, nbytes=buf.array.nbytes, name="cuda")
        op = AllreduceOp(c.lowlevel.user_lane, call, buf, buf.array, ReduceOp.SUM)
        try:
            staging.submit(c.lowlevel.engine, c.lowlevel.user_lane, op)
        except InvalidInputError as exc:
            assert "staging cpu tensor failed" in str(exc), exc
        else:
            raise AssertionError("staging without CUDA did not fail")
    else:
        try:
            await c.allreduce(torch.ones(64), name="cuda")
        except RemoteInputError as exc:
            assert "rank 0: tensor is on a device" in str(exc), exc
        else:
            raise AssertionError("rank 0's staging fault was not reported")
    assert (await c.allreduce(np.ones(2), name="after")).tolist() == [c.size] * 2


async def main() -> None:
    async with asynclock.start() as c:
        if "--detect" in sys.argv:
            report(c.rank, "detect", cuda.describe())
        else:
            await rounds(c)
            report(c.rank, "gate_order")
            if cuda.available():  # the copy would succeed: nothing to provoke
                report(c.rank, "stage_fault", "skipped: CUDA is present")
            else:
                await stage_fault(c)
                report(c.rank, "stage_fault")
    report(c.rank, "done")


if __name__ == "__main__":
    run(main)
