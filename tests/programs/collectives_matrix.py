"""Every collective x dtype x op against numpy references, on this job's ranks.

Each rank builds the same deterministic inputs for every rank, so it can
compute the expected result of any collective locally.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from _common import report, run

import asynclock

DTYPES = [torch.float16, torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64]
SIZES = [1, 7, 40, 5000, 300_000]  # inline, inline, inline/over, medium, threaded-size (>1 MiB f32)


def contribution(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers so every reduction is exact in every dtype."""
    base = (torch.arange(n) * 3 + rank * 5) % 7 + 1
    return base.to(dtype)


def reference(op: str, n: int, dtype: torch.dtype, size: int) -> torch.Tensor:
    rows = torch.stack([contribution(r, n, torch.float64) for r in range(size)])
    ref = {"sum": rows.sum(0), "min": rows.min(0).values, "max": rows.max(0).values,
           "product": rows.prod(0), "average": rows.sum(0) / size}[op]
    if op == "average" and not dtype.is_floating_point:
        ref = torch.trunc(rows.sum(0) / size)  # Horovod rounds toward zero
    return ref.to(dtype)


async def check_allreduce(c: asynclock.Coordinator) -> int:
    count = 0
    for dtype in DTYPES:
        for n in SIZES:
            for op in ("sum", "average", "min", "max", "product"):
                if op == "product" and n > 40:
                    continue  # products of 300k small ints overflow every dtype
                t = contribution(c.rank, n, dtype)
                exp = reference(op, n, dtype, c.size)
                got = await c.allreduce(t, op)
                assert got.dtype == dtype and got.shape == t.shape, (got.dtype, got.shape)
                assert torch.equal(got, exp), (
                    f"allreduce {op} {dtype} n={n}: {got[:5]} != {exp[:5]}")
                assert torch.equal(t, contribution(c.rank, n, dtype)), "out-of-place changed input"
                inplace = contribution(c.rank, n, dtype)
                same = await c.allreduce_(inplace, op)
                assert same is inplace and torch.equal(inplace, exp), (
                    f"allreduce_ {op} {dtype} n={n}")
                count += 2
    return count


async def check_mixed_in_place(c: asynclock.Coordinator) -> int:
    """Rank 0 reduces in place (`allreduce_`), the others into a new tensor: inline,
    a data stage, and a bulk stage. MPI wants its in-place form at every rank or
    none, and Open MPI's non-blocking allreduce at 4 ranks truncates if they mix."""
    count = 0
    for n in (16, 70_000, 300_000):
        t = contribution(c.rank, n, torch.float32)
        exp = reference("sum", n, torch.float32, c.size)
        got = await (c.allreduce_(t) if c.rank == 0 else c.allreduce(t))
        assert torch.equal(got, exp), f"mixed in place n={n}: {got[:5]} != {exp[:5]}"
        count += 1
    return count


async def check_half_bulk(c: asynclock.Coordinator) -> int:
    """16-bit floats past the bulk threshold (1 MiB): on MPI they are summed by a
    16-bit ring (one rounding per add); every rank must hold the same bits."""
    count = 0
    n = 700_000  # 1.4 MB of 16-bit values
    for dtype in (torch.float16, torch.bfloat16):
        for op in ("sum", "average"):
            exact = await c.allreduce(contribution(c.rank, n, dtype), op)
            assert torch.equal(exact, reference(op, n, dtype, c.size)), f"{op} {dtype} small ints"
            gen = torch.Generator().manual_seed(c.rank)
            mine = torch.randn(n, generator=gen).to(dtype)
            got = await c.allreduce(mine, op)
            rows = torch.stack([torch.randn(n, generator=torch.Generator().manual_seed(r))
                                .to(dtype).double() for r in range(c.size)])
            want = rows.sum(0) / (c.size if op == "average" else 1)
            ulp = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
            err = (got.double() - want).abs() / (want.abs() + 1.0)
            assert err.max() <= 2 * (c.size - 1) * ulp, f"{op} {dtype}: max rel err {err.max()}"
            everyone = await c.allgather_object(got.view(torch.int16).numpy().tobytes())
            assert all(b == everyone[0] for b in everyone), f"{op} {dtype}: ranks differ"
            inplace = mine.clone()
            assert torch.equal(await c.allreduce_(inplace, op), got), f"{op} {dtype} in place"
            count += 4
    return count


async def check_numpy(c: asynclock.Coordinator) -> int:
    for n in (3, 100_000):
        a = np.full(n, c.rank + 1, np.float32)
        got = await c.allreduce(a, "max")
        assert isinstance(got, np.ndarray) and (got == c.size).all()
        await c.allreduce_(a)
        assert (a == c.size * (c.size + 1) / 2).all()
        b = await c.broadcast(np.arange(n, dtype=np.int64) * (c.rank + 1), root=c.size - 1)
        assert (b == np.arange(n) * c.size).all()
    return 5


async def check_broadcast(c: asynclock.Coordinator) -> int:
    count = 0
    for dtype in DTYPES:
        for n in SIZES:
            for root in range(c.size):
                t = contribution(c.rank, n, dtype)
                got = await c.broadcast(t, root=root)
                want = contribution(root, n, dtype)
                assert torch.equal(got, want), f"broadcast {dtype} {n} {root}"
                await c.broadcast_(t, root=root)
                assert torch.equal(t, contribution(root, n, dtype))
                count += 2
    return count


async def check_allgather(c: asynclock.Coordinator) -> int:
    count = 0
    for dtype in DTYPES:
        for rows in (1, 3, 20_000):
            mine = torch.stack([contribution(c.rank, 5, dtype)] * (rows + c.rank))
            got = await c.allgather(mine)
            exp = torch.cat([torch.stack([contribution(r, 5, dtype)] * (rows + r))
                             for r in range(c.size)])
            assert torch.equal(got, exp), f"allgather {dtype} rows={rows}"
            count += 1
    return count


async def check_reduce_scatter_alltoall(c: asynclock.Coordinator) -> int:
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        t = torch.stack([contribution(c.rank, 4, dtype)] * (2 * c.size + 1))
        full = sum(torch.stack([contribution(r, 4, torch.float64)] * (2 * c.size + 1))
                   for r in range(c.size))
        got = await c.reduce_scatter(t, "sum")
        start = sum(2 + (1 if r < 1 else 0) for r in range(c.rank))
        rows = 2 + (1 if c.rank < 1 else 0)
        assert torch.equal(got, full[start:start + rows].to(dtype)), f"reduce_scatter {dtype}"
    splits = [r + 1 for r in range(c.size)]
    send = torch.arange(sum(splits), dtype=torch.float32) + 100 * c.rank
    out, rsplits = await c.alltoall(send, splits)
    assert rsplits == [c.rank + 1] * c.size, rsplits
    offset = sum(splits[: c.rank])
    exp = torch.cat([torch.arange(offset, offset + c.rank + 1, dtype=torch.float32) + 100 * r
                     for r in range(c.size)])
    assert torch.equal(out, exp), (out, exp)
    return 4


async def check_objects_and_barrier(c: asynclock.Coordinator) -> int:
    small = await c.allgather_object(("r", c.rank))
    assert small == [("r", r) for r in range(c.size)]
    big = await c.allgather_object({"blob": "x" * (1000 * (c.rank + 1))})
    assert [len(b["blob"]) for b in big] == [1000 * (r + 1) for r in range(c.size)]
    for root in range(c.size):
        got = await c.broadcast_object({"from": root, "pad": list(range(500))} if c.rank == root
                                       else None, root=root)
        assert got == {"from": root, "pad": list(range(500))}
    await c.barrier()
    return 3


async def check_many_in_flight(c: asynclock.Coordinator) -> int:
    handles = [c.allreduce_async(torch.full((i % 50 + 1,), float(i + c.rank))) for i in range(300)]
    handles += [c.allgather_async(torch.full((2,), float(i))) for i in range(50)]
    big = [c.allreduce_async(torch.full((400_000,), float(i))) for i in range(4)]
    for i, h in enumerate(handles[:300]):
        exp = i * c.size + c.size * (c.size - 1) / 2
        assert torch.all((await h) == exp), f"in-flight allreduce {i}"
    for i, h in enumerate(handles[300:]):
        assert torch.all((await h) == float(i))
    for i, h in enumerate(big):
        assert torch.all((await h) == float(i * c.size))
    stats = c.statistics()
    assert stats.in_flight == 0, stats
    return len(handles) + len(big)


def expected_backend() -> str | None:
    """`--expect-backend NAME`: fail unless the job really runs on that backend."""
    if "--expect-backend" not in sys.argv:
        return None
    return sys.argv[sys.argv.index("--expect-backend") + 1]


async def main() -> None:
    async with asynclock.start() as c:
        want = expected_backend()
        assert want in (None, c.backend.name), f"backend {c.backend.describe()}, want {want}"
        report(c.rank, "backend", c.backend.describe())
        total = 0
        for check in (check_allreduce, check_mixed_in_place, check_half_bulk, check_numpy,
                      check_broadcast, check_allgather,
                      check_reduce_scatter_alltoall, check_objects_and_barrier,
                      check_many_in_flight):
            total += await check(c)
            report(c.rank, check.__name__)
        report(c.rank, "done", f"{total} checks, size {c.size}")


run(main)
