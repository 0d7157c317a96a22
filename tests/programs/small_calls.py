"""The small-collective path (`asynclock._core.engine.small_calls`): same wire bytes as the general
path, hand-off to the engine when a rank is late, and what it caches.

Every rank runs the same sequence; each check reports its label.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Awaitable, Callable
from functools import partial
from typing import TypeVar

import anyio
import numpy as np
import torch
from _common import report, run

import asynclock
from asynclock import InvalidInputError, MismatchError
from asynclock._core.engine import fastpath

T = TypeVar("T")

warnings.filterwarnings("ignore", "overflow", RuntimeWarning)  # wrapping is what we test


def tri(size: int) -> float:
    return float(size * (size - 1) // 2)


async def check_mixed_paths(c: asynclock.Coordinator) -> None:
    """Ranks alternate between the general path and the small one: they must agree."""
    for i in range(40):
        t = torch.full((3,), float(c.rank + i))
        general = (c.rank + i) % 2 == 0
        got = await (c.allreduce_async(t) if general else c.allreduce(t))
        assert torch.equal(got, torch.full((3,), i * c.size + tri(c.size))), (i, got)
    report(c.rank, "mixed_paths")


async def check_broadcast_barrier(c: asynclock.Coordinator) -> None:
    """Broadcast and barrier on the small path next to the general one, then late."""
    for i in range(12):
        root, general = i % c.size, (c.rank + i) % 2 == 0
        t = torch.full((2,), float(c.rank * 10 + i))
        got = await (c.broadcast_async(t, root) if general else c.broadcast(t, root))
        assert torch.equal(got, torch.full((2,), float(root * 10 + i))), (i, got)
        a = np.full(3, c.rank, np.int64)
        same = await (c.broadcast_async_(a, root) if not general else c.broadcast_(a, root))
        assert same is a and (a == root).all(), (i, a)
        await (c.barrier_async() if general else c.barrier())
    before = c.lowlevel.small_path_statistics().handed_off
    for _ in range(2):
        if c.rank == 0:
            await anyio.sleep(0.03)
        await c.barrier(name="late")
        got = await c.broadcast(torch.full((1,), float(c.rank + 1)), root=0)
        assert torch.equal(got, torch.ones(1)), got
    handed = c.lowlevel.small_path_statistics().handed_off - before
    assert c.rank == 0 or handed >= 2, f"rank {c.rank} handed off {handed} of 4"
    report(c.rank, "broadcast_barrier")


async def check_mid_size(c: asynclock.Coordinator) -> None:
    """Above 128 B the data follows in its own allreduce from the same call; mixed
    with the general path, in place and not, sum/average/max, up to 900 KB."""
    before = c.lowlevel.small_path_statistics()
    for i, n in enumerate((33, 5000, 5000, 230_000)):
        for op in ("sum", "average", "max"):
            general = (c.rank + i) % 2 == 0
            t = torch.arange(n, dtype=torch.float32) + c.rank
            want = {"sum": torch.arange(n) * c.size + tri(c.size),
                    "average": torch.arange(n) + tri(c.size) / c.size,
                    "max": torch.arange(n) + c.size - 1.0}[op].float()
            got = await (c.allreduce_async(t, op) if general else c.allreduce(t, op))
            assert torch.allclose(got, want), (n, op, got[:3], want[:3])
            i64 = np.arange(n, dtype=np.int64) * (c.rank + 1)
            assert await c.allreduce_(i64, op) is i64
            want64 = {"sum": np.arange(n) * (c.size * (c.size + 1) // 2),
                      "average": np.arange(n) * (c.size * (c.size + 1) // 2) // c.size,
                      "max": np.arange(n) * c.size}[op]
            assert (i64 == want64).all(), (n, op, i64[:3], want64[:3])
    if "--short-spin" in sys.argv:  # ASYNCLOCK_SPIN_US=50: headers finish in the spin,
        for i in range(10):  # a 920 KB transfer does not: the engine finishes it
            t = torch.full((230_000,), float(c.rank + i))
            got = await c.allreduce(t)
            assert torch.equal(got, torch.full((230_000,), i * c.size + tri(c.size)))
    after = c.lowlevel.small_path_statistics()
    data = int((await c.allreduce(np.array([after.data_handed_off - before.data_handed_off])))[0])
    assert "--short-spin" not in sys.argv or data > 0, "no data stage went to the engine"
    report(c.rank, "mid_size", f"data_handed_off={data}")


async def check_hand_off(c: asynclock.Coordinator) -> None:
    """Rank 0 arrives 30 ms late: every other rank's spin ends and the engine finishes."""
    before = c.lowlevel.small_path_statistics().handed_off
    for i in range(4):
        if c.rank == 0:
            await anyio.sleep(0.03)
        got = await c.allreduce_(np.full(2, float(i + c.rank)))
        assert (got == i * c.size + tri(c.size)).all(), (i, got)
    handed = c.lowlevel.small_path_statistics().handed_off - before
    # rank 0 may hand off too: its round can need a peer that now polls with backoff
    assert c.rank == 0 or handed == 4, f"rank {c.rank} handed off {handed} of 4"
    got = await c.allreduce(torch.ones(5))  # fresh buffers after the hand-offs
    assert torch.equal(got, torch.full((5,), float(c.size)))
    report(c.rank, "hand_off")


async def expect_shape_mismatch(c: asynclock.Coordinator) -> None:
    """Rank 0 reduces 3 floats, the others 2: the same error everywhere, then the
    next allreduce works."""
    try:
        await c.allreduce(torch.ones(2 + (c.rank == 0)))
    except MismatchError as exc:
        assert "float32[3]" in str(exc) and "float32[2]" in str(exc), exc
    else:
        raise AssertionError("no mismatch error")
    assert torch.equal(await c.allreduce(torch.ones(1)), torch.full((1,), float(c.size)))


async def check_rows_only_when_asked(c: asynclock.Coordinator) -> None:
    """On MPI, agreeing calls cost the compact round alone; a mismatch costs one rows
    round (the error names every rank's call), and the next call is compact again."""
    before = c.lowlevel.small_path_statistics().rows_rounds
    t = torch.ones(3)
    for _ in range(20):
        await c.allreduce(t)
        await c.allreduce(torch.ones(1000))  # its data follows the header round
        await c.broadcast(t, root=c.size - 1)
        await c.barrier()
    agreed = c.lowlevel.small_path_statistics().rows_rounds - before
    compact = c.lowlevel.user_lane.header_rounds.compact
    assert agreed == (0 if compact else 80), agreed
    await expect_shape_mismatch(c)
    mismatch = c.lowlevel.small_path_statistics().rows_rounds - before - agreed
    assert mismatch == 1, mismatch
    report(c.rank, "rows_only_when_asked")


async def check_mismatch_after_hand_off(c: asynclock.Coordinator) -> None:
    """A shape mismatch that the engine (not the spin) detects: same error everywhere."""
    if c.rank == 0:
        await anyio.sleep(0.03)
    await expect_shape_mismatch(c)
    report(c.rank, "mismatch_after_hand_off")


async def check_mismatch_in_the_spin(c: asynclock.Coordinator) -> None:
    """Ranks on time, shapes differ: the small path's own round sees the headers
    differ (a round that skipped the compare would fold rows of different shapes)."""
    for _ in range(3):
        await c.barrier()
        await expect_shape_mismatch(c)
    report(c.rank, "mismatch_in_the_spin")


async def check_cancel_after_hand_off(c: asynclock.Coordinator) -> None:
    """Cancelling an await of a handed-off round detaches; the round still completes."""
    t = torch.full((2,), float(c.rank))
    if c.rank == 0:
        await anyio.sleep(0.05)
        await c.allreduce_(t)
    else:
        with anyio.move_on_after(0.005) as scope:
            await c.allreduce_(t)
        assert scope.cancelled_caught, "the round should still have been waiting"
    await c.drain(timeout=10)
    assert torch.equal(t, torch.full((2,), tri(c.size))), t  # completed in the background
    assert torch.equal(await c.allreduce(torch.ones(1)), torch.full((1,), float(c.size)))
    report(c.rank, "cancel_after_hand_off")


async def check_changed_tensor(c: asynclock.Coordinator) -> None:
    """The cached numpy view of the last tensor must follow set_, .data= and t_()."""
    t = torch.ones(2)
    await c.allreduce_(t)
    old = t.data
    t.set_(torch.full((2,), 3.0))
    await c.allreduce_(t)
    assert torch.equal(t, torch.full((2,), 3.0 * c.size)) and torch.equal(
        old, torch.full((2,), float(c.size))), (t, old)
    t.data = torch.ones(2, dtype=torch.float64)
    await c.allreduce_(t)
    assert t.dtype == torch.float64 and torch.equal(t, torch.full((2,), float(c.size)).double())
    t.set_(torch.ones(3, dtype=torch.float64))  # new shape
    await c.allreduce_(t)
    assert torch.equal(t, torch.full((3,), float(c.size)).double()), t
    sq = torch.ones(2, 2)
    await c.allreduce_(sq)
    sq.t_()  # same pointer, shape and dtype; no longer contiguous
    try:
        await c.allreduce_(sq)
    except InvalidInputError as exc:
        assert "contiguous" in str(exc), exc
    else:
        raise AssertionError("transposed tensor was accepted")
    report(c.rank, "changed_tensor")


async def check_hot_call(c: asynclock.Coordinator) -> None:
    """An in-place allreduce whose signature (input type, op, dtype, shape) was seen
    before runs whole in C (`_fastpath.c`'s HotAllreduce, where the round is C's),
    new tensor or not; a change of memory, dtype, shape, contiguity or writability
    is seen there, and a shape changed on one rank only is still a mismatch on every
    rank."""
    n = float(c.size)

    def hot_calls() -> int:
        hot = c._small._hot  # remade when a round is handed off
        return -1 if hot is None else int(hot.calls)

    hot_seen = 0  # calls the C hot call ran, counted call by call: a hand-off remakes it

    async def counted(call: Callable[[], Awaitable[T]]) -> T:
        nonlocal hot_seen
        before = hot_calls()  # read before the call: a hot call runs whole when it is made
        out = await call()
        hot_seen += int(hot_calls() > before)
        return out

    async def reduce(t: torch.Tensor, value: float, times: int = 3) -> None:
        for _ in range(times):
            t.fill_(value)
            await counted(partial(c.allreduce_, t))
            assert torch.equal(t, torch.full_like(t, value * n)), (t, value)

    t = torch.ones(2)
    await reduce(t, 1.0)
    # Each kind of call below runs whole in C at least once; a round handed off on a late
    # rank (a loaded machine hands off many) runs in Python.
    hot_seen = 0
    await reduce(t, 2.0, 8)
    runs_hot = hot_seen >= 1
    t.set_(torch.ones(2))  # new memory
    await reduce(t, 3.0)
    hot_seen = 0
    for i in range(4):  # a new tensor each call, as a loop's loss
        fresh = torch.full((2,), float(i))
        assert await counted(partial(c.allreduce_, fresh)) is fresh
        assert torch.equal(fresh, torch.full((2,), i * n))
    runs_hot = runs_hot and hot_seen >= 1
    t.data = t.view(torch.int32)  # same memory, another dtype
    await reduce(t, 1 << 24)  # as float32 bits, 2**-125: summed as floats, not 2 << 24
    t.set_(torch.zeros(3, dtype=torch.int32))  # new memory, another shape
    await reduce(t, 5)
    u = torch.ones(4)
    await reduce(u, 1.0)
    if c.size > 1:
        if c.rank == 0:
            u.resize_(2)  # same memory, a shape the other ranks do not have
        try:
            await c.allreduce_(u)
        except MismatchError:
            pass
        else:
            raise AssertionError("a shape changed on rank 0 only was not a mismatch")
    # out of place and averages, new tensors each call: a new result, the input kept.
    # The hot call holds one signature, so each kind runs several calls in a row.
    hot_seen = 0
    for i in range(4):
        src = torch.full((3,), float(c.rank + i))
        got = await counted(partial(c.allreduce, src))
        assert got is not src and torch.equal(src, torch.full((3,), float(c.rank + i)))
        assert torch.equal(got, torch.full((3,), i * n + tri(c.size))), (i, got)
    for i in range(4):
        avg = await c.allreduce(torch.full((2,), float(c.rank) + 0.1 * i, dtype=torch.float64),
                                "average")
        want = np.full(2, sum(r + 0.1 * i for r in range(c.size)) / c.size)
        np.testing.assert_allclose(avg.numpy(), want, rtol=1e-12)
        np.testing.assert_array_equal(avg.numpy(), (await c.allreduce(avg, "max")).numpy())
    for i in range(4):
        arr = np.full(2, float(c.rank + i), np.float32)
        out = await c.allreduce(arr, "average")
        assert out is not arr and (arr == c.rank + i).all(), arr
        assert (out == np.float32(i * n + tri(c.size)) / np.float32(n)).all(), out
    runs_hot = runs_hot and hot_seen >= 1
    for i in range(3):  # integer averages stay in Python: rounding toward zero
        ints = torch.full((2,), -c.rank - 2 * i - 1, dtype=torch.int32)
        await c.allreduce_(ints, "average")
        total = sum(-r - 2 * i - 1 for r in range(c.size))
        assert (ints == int(total / c.size)).all(), (ints, total)

    # numpy arrays: the hot call checks their buffer (pointer, format, shape, writable)
    x = np.ones((2, 2), np.float32)

    async def reduce_array(value: float, times: int = 3) -> None:
        for _ in range(times):
            x[...] = value
            assert await counted(partial(c.allreduce_, x)) is x
            assert (x == value * n).all(), (x, value)

    await reduce_array(1.0)
    hot_seen = 0
    await reduce_array(2.0, 4)
    runs_hot = runs_hot and hot_seen >= 1
    x.dtype = np.int32  # same memory, another dtype
    await reduce_array(1 << 24)
    x.dtype = np.float32
    await reduce_array(1.0)
    x.flags.writeable = False
    try:
        await c.allreduce_(x)
    except InvalidInputError:
        pass
    else:
        raise AssertionError("a read-only array was reduced in place")
    x.flags.writeable = True
    await reduce_array(1.0)
    if c.size > 1:
        if c.rank == 0:
            x.shape = (1, 4)  # same memory and rank, a shape the other ranks do not have
        try:
            await c.allreduce_(x)
        except MismatchError:
            pass
        else:
            raise AssertionError("an array reshaped on rank 0 only was not a mismatch")
    report(c.rank, f"hot_call {'C' if runs_hot else 'python'}")


async def check_cancelled_scope_still_issues(c: asynclock.Coordinator) -> None:
    """Regression: the periodic yield once came before the issue, as a cancellation
    point, so every 64th call made in a cancelled scope was never issued on this
    rank while the others issued theirs. A call is issued whatever its scope."""
    kept = []
    for i in range(130):  # past two multiples of 64, wherever the count stands
        t = torch.full((1,), float(i))
        with anyio.CancelScope() as scope:
            scope.cancel()
            await c.allreduce_(t)
        kept.append(t)
    await c.drain(timeout=10)  # a handed-off round finishes in the background
    for i, t in enumerate(kept):
        assert torch.equal(t, torch.full((1,), float(i * c.size))), (i, t)
    assert torch.equal(await c.allreduce(torch.ones(1)), torch.full((1,), float(c.size)))
    report(c.rank, "cancelled_scope_still_issues")


async def check_yields(c: asynclock.Coordinator) -> None:
    """Calls that all finish inside the spin still let other tasks run."""
    runs = 0
    stop = False

    async def side() -> None:
        nonlocal runs
        while not stop:
            runs += 1
            await anyio.sleep(0)

    x = torch.ones(1)
    async with anyio.create_task_group() as tg:
        tg.start_soon(side)
        await anyio.sleep(0)
        start = runs
        for _ in range(640):
            await c.allreduce_(x, "max")
        stop = True
    assert runs - start >= 9, f"side task ran {runs - start} times during 640 calls"
    report(c.rank, "yields")


def _same_fold(got: np.ndarray, want: np.ndarray, exact: bool, what: object) -> None:
    if exact:
        assert got.tobytes() == want.tobytes(), (what, got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=str(what))


async def check_folds(c: asynclock.Coordinator) -> None:
    """Every (dtype, op) the compact round folds, and ones it leaves to the rows round,
    against numpy's rank-order fold of the gathered inputs: bit for bit (integer
    wrap-around included) where the order of the fold cannot matter, within float
    rounding where MPI may group a rank-order float fold differently; and always
    bit-identical on every rank."""
    from asynclock._core.base.header import FOLDS
    from asynclock._core.base.ops import NUMPY_OF_CODE, ReduceOp

    rng = np.random.default_rng(100 + c.rank)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.PRODUCT: np.multiply, ReduceOp.MIN: np.minimum,
             ReduceOp.MAX: np.maximum}
    cases = list(FOLDS) + [(code, op) for code, op in ((2, ReduceOp.MIN), (3, ReduceOp.MAX))]
    for code, op in cases:
        dtype = NUMPY_OF_CODE[code]
        if dtype.kind == "f":
            x = (rng.standard_normal(7) * 1e3).astype(dtype)
        else:  # near the top of the range: sums and products wrap
            x = rng.integers(np.iinfo(dtype).max // 2, np.iinfo(dtype).max, 7, dtype=dtype)
        rows = await c.allgather(x.reshape(1, -1))
        want = rows[0].copy()
        for r in range(1, c.size):
            want = ufunc[op](want, rows[r])
        exact = c.size <= 2 or dtype.kind != "f" or op in (ReduceOp.MIN, ReduceOp.MAX)
        for inplace in (False, True):
            got = x.copy() if inplace else x
            got = await (c.allreduce_(got, op.name.lower()) if inplace
                         else c.allreduce(got, op.name.lower()))
            _same_fold(got, want, exact, (dtype, op, inplace))
            everyone = await c.allgather(got.reshape(1, -1))
            assert all(row.tobytes() == got.tobytes() for row in everyone), (dtype, op, everyone)
        t = await c.allreduce(torch.from_numpy(x.copy()), op.name.lower())
        _same_fold(t.numpy(), want, exact, (dtype, op, "torch"))
    fast = c.lowlevel.user_lane.header_rounds.in_c
    report(c.rank, "folds", "C" if fast else "python")


async def check_node_round(c: asynclock.Coordinator) -> None:
    """Which compact round this lane runs (the test compares it with the setup), and
    three times as many rounds in flight as a node round has records: rank 0 starts
    them all before any other rank starts one (they wait for its message), so its
    later ones wait, unwritten, for their records, and all finish with the right sums."""
    from mpi4py import MPI

    lane = c.lowlevel.user_lane
    report(c.rank, f"round_{lane.header_rounds.kind}")
    n = fastpath.NODE_DEPTH * 3
    world = MPI.COMM_WORLD
    if c.rank > 0:
        world.recv(source=0, tag=77)  # blocks the loop on purpose: rank 0 runs alone
    handles = [c.allreduce_async(torch.full((2,), float(c.rank + i))) for i in range(n)]
    if c.rank == 0:
        for peer in range(1, c.size):
            world.send(None, dest=peer, tag=77)
    for i, handle in enumerate(handles):
        got = await handle
        assert torch.equal(got, torch.full((2,), i * c.size + tri(c.size))), (i, got)
    report(c.rank, "deep_rounds")


async def main() -> None:
    async with asynclock.start() as c:
        before = c.lowlevel.small_path_statistics().calls
        await check_folds(c)
        await check_mixed_paths(c)
        await check_node_round(c)
        await check_broadcast_barrier(c)
        await check_mid_size(c)
        if c.size > 1:
            await check_hand_off(c)
            await check_mismatch_after_hand_off(c)
            await check_rows_only_when_asked(c)
            await check_mismatch_in_the_spin(c)
            await check_cancel_after_hand_off(c)
        await check_changed_tensor(c)
        await check_hot_call(c)
        await check_cancelled_scope_still_issues(c)
        await check_yields(c)
        assert c.lowlevel.small_path_statistics().calls > before + 640
        await c.drain(timeout=10)
        stats = c.statistics()
        assert stats.in_flight == 0 and stats.issued == stats.completed, stats
    report(c.rank, "done")


run(main)
