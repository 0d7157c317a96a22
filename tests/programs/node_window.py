"""Large allreduces through the node window, against numpy's rank-order fold.

    node_window.py [--off] [--trio]

Run with ASYNCLOCK_THREAD_MIN_BYTES and ASYNCLOCK_WINDOW_MIN_BYTES lowered
(tests/test_node_window.py), so that small, odd sizes take the window and the
job stays short. Every rank builds every rank's input, so it knows the
expected result: on one node the window folds in rank order, so float
results must equal numpy's rank-order fold bit for bit, and every rank must
hold the same bits. `--off`: ASYNCLOCK_NODE_WINDOW=0 is set, the same checks hold
over MPI (floats within a tolerance: MPI sums in its own order) and no
allreduce may go through a window.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import torch
from _common import report, run
from mpi4py import MPI

import asynclock
from asynclock._core.engine import fastpath
from asynclock._core.transports.mpi import WINDOW_LOOP_HI

OFF = "--off" in sys.argv
DTYPES = [np.float32, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64]
OPS = ["sum", "average", "min", "max", "product"]
SIZES = [4099, 70_001]  # odd: slices of unequal length; the second grows the window
FOLD: dict[str, Callable[..., Any]] = {"sum": np.add, "average": np.add, "min": np.minimum,
                                       "max": np.maximum, "product": np.multiply}
Array = np.ndarray[Any, Any]


def contribution(rank: int, n: int, dtype: Any, op: str) -> Array:
    """Seeded by rank; integers small enough that no sum or product of 4 ranks
    overflows (an overflowing average is no question for the window)."""
    rng = np.random.default_rng(1000 + rank)
    if np.issubdtype(dtype, np.floating):
        scale = 1.0 if op == "product" else 1000.0
        return (rng.standard_normal(n) * scale).astype(dtype)
    high = 3 if op == "product" else 30 if np.dtype(dtype).itemsize == 1 else 1000
    low = 0 if np.issubdtype(dtype, np.unsignedinteger) else -high
    return rng.integers(low, high, n).astype(dtype)


def reference(op: str, n: int, dtype: Any, size: int) -> Array:
    """numpy's fold in rank order, in the dtype (wrapping as MPI's integers do)."""
    acc = contribution(0, n, dtype, op)
    for r in range(1, size):
        acc = FOLD[op](acc, contribution(r, n, dtype, op))
    if op != "average":
        return acc
    if np.issubdtype(dtype, np.floating):
        return acc / dtype(size)
    negative = acc < 0  # Horovod's integer average rounds toward zero
    out = np.abs(acc.astype(np.int64)) // size
    return np.where(negative, -out, out).astype(dtype)


def same_everywhere(results: list[Array]) -> None:
    digest = hashlib.sha256(b"".join(r.tobytes() for r in results)).hexdigest()
    digests = MPI.COMM_WORLD.allgather(digest)
    assert len(set(digests)) == 1, f"ranks hold different bits: {digests}"


def check(got: Array, exp: Array, what: str) -> None:
    if OFF and np.issubdtype(exp.dtype, np.floating):  # MPI's own summation order
        np.testing.assert_allclose(got, exp, rtol=1e-5 if exp.dtype == np.float32 else 1e-12,
                                   atol=1e-3, err_msg=what)
    else:
        assert np.array_equal(got, exp), f"{what}: {got[:4]} != {exp[:4]}"


async def check_ops(c: asynclock.Coordinator) -> int:
    results, count = [], 0
    for n in SIZES:
        for dtype in DTYPES:
            for op in OPS:
                exp = reference(op, n, dtype, c.size)
                mine = contribution(c.rank, n, dtype, op)
                got = await c.allreduce(mine, op)
                check(got, exp, f"allreduce {op} {np.dtype(dtype).name} n={n}")
                assert np.array_equal(mine, contribution(c.rank, n, dtype, op)), "input changed"
                inplace = torch.from_numpy(contribution(c.rank, n, dtype, op))
                same = await c.allreduce_(inplace, op)
                assert same is inplace
                check(inplace.numpy(), exp, f"allreduce_ {op} {np.dtype(dtype).name} n={n}")
                results += [got, inplace.numpy()]
                count += 2
    same_everywhere(results)
    return count


async def check_small_path(c: asynclock.Coordinator) -> int:
    """Where the window would run an awaited allreduce on the loop now, the small-call
    path takes it whole (`engine.small_calls`): its header round, then the window's
    steps, with no operation for the engine. A peer late past the spin (a loaded
    machine) hands the round to the engine instead, so this looks for one allreduce
    among many that the engine never saw; every result must be right either way.
    Every rank runs the same number of rounds: the last tells whether to go on.
    Returns how many window allreduces it made."""
    engine, n = c.lowlevel.engine, 50_001
    want = reference("sum", n, np.float32, c.size)
    for i in range(100):
        general = engine._issued  # operations of the general path (`Engine._begin`)
        t = torch.from_numpy(contribution(c.rank, n, np.float32, "sum"))
        await c.allreduce_(t)
        check(t.numpy(), want, f"small path {i}")
        if await c.allreduce(np.array([engine._issued == general], np.int32), "max"):
            return i + 1
    raise AssertionError("100 window allreduces in a row took the general path")


async def check_cancelled(c: asynclock.Coordinator) -> None:
    """A task awaiting a window allreduce is cancelled on every rank: the allreduce
    still runs to its end (its tensor holds the sum), and the next one is right."""
    n = 50_001
    first = torch.from_numpy(contribution(c.rank, n, np.float64, "sum"))
    with anyio.move_on_after(0):
        await c.allreduce_(first)
    after = await c.allreduce(contribution(c.rank, n, np.int32, "sum"))
    check(after, reference("sum", n, np.int32, c.size), "after a cancelled await")
    check(first.numpy(), reference("sum", n, np.float64, c.size), "the cancelled allreduce")


async def check_in_flight_together(c: asynclock.Coordinator) -> None:
    """Allreduces in flight together, the loop's and the wait thread's (from
    WINDOW_LOOP_HI on) in turn: each path waits for the other's allreduce of the window
    before its own, so every rank runs them in issue order whichever path it takes."""
    sizes = [70_001, WINDOW_LOOP_HI // 8 + 3, 4099, 50_001, WINDOW_LOOP_HI // 4 + 1, 20_003]
    inputs = [contribution(c.rank, n, np.float64 if i % 2 else np.int32, "sum")
              for i, n in enumerate(sizes)]
    handles = [c.allreduce_async(a) for a in inputs]
    results = [await h for h in handles]
    for i, (n, got) in enumerate(zip(sizes, results, strict=True)):
        check(got, reference("sum", n, np.float64 if i % 2 else np.int32, c.size),
              f"allreduce {i} of {len(sizes)} in flight together")
    same_everywhere(results)


async def check_mismatch(c: asynclock.Coordinator) -> None:
    """Sizes that differ by rank fail in the header round, on every rank, before the
    window sees them; the window serves the next allreduce as before."""
    try:
        await c.allreduce(np.ones(20_000 + 8 * c.rank, np.float32))
    except asynclock.MismatchError:
        pass
    else:
        raise AssertionError("sizes that differ across ranks were not refused")
    n = 20_003
    got = await c.allreduce(contribution(c.rank, n, np.float32, "max"), "max")
    check(got, reference("max", n, np.float32, c.size), "after a mismatch")


async def check_process_set(c: asynclock.Coordinator) -> None:
    """A process set's channel has a window of its own."""
    subset = await c.process_set(range(c.size))
    n = 30_001
    got = await subset.api.allreduce(contribution(c.rank, n, np.int64, "sum"))
    check(got, reference("sum", n, np.int64, c.size), "process set")
    await c.remove_process_set(subset)


async def main() -> None:
    async with asynclock.start() as c:
        count, small = await check_ops(c), 0
        report(c.rank, "ops", f"{count} allreduces")
        if not OFF:
            small = await check_small_path(c)
            report(c.rank, "small_path", f"after {small} allreduces")
        await check_cancelled(c)
        report(c.rank, "cancelled")
        await check_in_flight_together(c)
        report(c.rank, "together")
        await check_mismatch(c)
        report(c.rank, "mismatch")
        await check_process_set(c)
        report(c.rank, "process_set")
        windows = c.backend.window_calls()  # type: ignore[attr-defined]
        if OFF:
            assert windows == 0, f"{windows} allreduces went through a window switched off"
        else:  # all but those of the removed set, whose channel is gone
            expected = count + 9 + (0 if OFF else small)
            assert windows >= expected, f"only {windows} of {expected} through the window"
            # once the window is made, an awaited allreduce runs on the loop, step by step
            polled = c.backend.window_loop_calls()  # type: ignore[attr-defined]
            assert polled >= count // 2, f"only {polled} of {count} run on the loop"
            # of them, those whose dtype and op have a C fold run C steps where it is built
            in_c = c.backend.window_c_calls()  # type: ignore[attr-defined]
            assert (in_c > count // 4) == (fastpath.module() is not None), (
                f"{in_c} of {polled} in C, C steps {'' if fastpath.module() else 'not '}built")
        report(c.rank, "done", f"{windows} through the window")


if __name__ == "__main__":
    run(main)
