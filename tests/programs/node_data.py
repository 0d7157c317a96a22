"""Mid-size allreduces through the node's shared memory (`_fastpath.c`'s NodeData).

    node_data.py [--trio] [--off]

Every dtype and op it folds, against numpy's rank-order fold (bit-identical, on every
rank), in place and not, on the small path and the general one, many in flight (more
than the segment's depth), a late rank (the request is handed to the engine), and
sizes the channel leaves to MPI (an int16 sum, a size over the segment's slot).
`--off` (ASYNCLOCK_NODE_DATA_MAX_BYTES=0): the channel has none, the results are the same.
"""

from __future__ import annotations

import sys
import warnings

import anyio
import numpy as np
import torch
from _common import report, run

import asynclock

warnings.filterwarnings("ignore", "overflow", RuntimeWarning)  # wrapping is what we test

UFUNCS = {"sum": np.add, "product": np.multiply, "min": np.minimum, "max": np.maximum}
N = 5000  # 20-40 KiB: over the inline size, under the slot


def rows(size: int, n: int, dtype: type) -> list[np.ndarray]:
    """Each rank's input, different per rank; floats that round differently by order."""
    out = []
    for r in range(size):
        g = np.random.default_rng(r)
        if np.issubdtype(dtype, np.floating):
            out.append((g.standard_normal(n) * 10.0 ** g.integers(-3, 4, n)).astype(dtype))
        else:
            out.append(g.integers(-1000, 1000, n).astype(dtype))
    return out


def fold(parts: list[np.ndarray], op: str) -> np.ndarray:
    acc = parts[0].copy()
    for p in parts[1:]:
        acc = UFUNCS[op](acc, p)
    return acc


async def same_everywhere(c: asynclock.Coordinator, a: np.ndarray) -> None:
    """Every rank holds the same bits."""
    got = await c.allgather(a.view(np.uint8).reshape(1, -1))
    assert all((row == got[0]).all() for row in got), "ranks differ"


async def check_ops(c: asynclock.Coordinator) -> None:
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        for op in UFUNCS:
            parts = rows(c.size, N, dtype)
            want = fold(parts, op)
            mine = parts[c.rank].copy()
            got = await c.allreduce(mine, op)
            assert np.array_equal(got, want), (dtype, op)
            assert np.array_equal(mine, parts[c.rank])  # out of place leaves the input
            same = await c.allreduce_(mine, op)
            assert same is mine and np.array_equal(mine, want), (dtype, op)
            await same_everywhere(c, mine)
    parts = rows(c.size, N, np.float32)
    avg = await c.allreduce(parts[c.rank], "average")
    assert np.array_equal(avg, fold(parts, "sum") / np.float32(c.size))
    report(c.rank, "ops")


async def check_in_flight(c: asynclock.Coordinator) -> None:
    """More rounds in flight than the segment holds records; a late rank."""
    for late in range(c.size):
        ts = [torch.full((N,), float(i + c.rank)) for i in range(7)]
        if c.rank == late:
            await anyio.sleep(0.05)
        handles = [c.allreduce_async(t) for t in ts]
        for i, h in enumerate(handles):
            got = await h
            assert torch.equal(got, torch.full((N,), float(i * c.size + sum(range(c.size))))), i
        got = await c.allreduce(torch.full((N,), 1.0))
        assert torch.equal(got, torch.full((N,), float(c.size)))
    report(c.rank, "in_flight")


async def check_left_to_mpi(c: asynclock.Coordinator) -> None:
    """What the segment does not take still reduces (over MPI)."""
    node = c._lane.node_data
    before = node.rounds if node is not None else 0
    got = await c.allreduce(np.full(N, c.rank + 1, np.int16))
    assert (got == sum(range(1, c.size + 1))).all()
    big = 2 * int(node.slot) // 4 if node is not None else 1 << 17
    got = await c.allreduce(np.full(big, 1.0, np.float32))
    assert (got == c.size).all()
    after = node.rounds if node is not None else 0
    assert after == before, f"{after - before} of them went through the segment"
    report(c.rank, "left_to_mpi")


async def main() -> None:
    async with asynclock.start() as c:
        node = c._lane.node_data
        if "--off" in sys.argv:
            assert node is None, "the segment is made although switched off"
        else:
            assert node is not None, "no node data segment on one node"
        await check_ops(c)
        await check_in_flight(c)
        await check_left_to_mpi(c)
        if node is not None:
            assert node.rounds > 40, f"only {node.rounds} rounds went through the segment"
        report(c.rank, "done")


if __name__ == "__main__":
    run(main)
