"""Bad input on one or all ranks: a clear error on every rank, never a hang.

After each failure the ranks must still agree, proven by a correct
allreduce, so no error path leaves the ranks out of step.
"""

from __future__ import annotations

import torch
from _common import report, run

import asynclock
from asynclock import InvalidInputError, MismatchError, RemoteInputError


async def expect(c: asynclock.Coordinator, label: str, coro_fn, local: type, remote: type,
                 bad_ranks: set[int], *needles: str) -> None:
    """Run a call that must fail; check type and message, then prove sync."""
    try:
        await coro_fn()
    except (InvalidInputError, MismatchError, RemoteInputError) as exc:
        want = local if c.rank in bad_ranks else remote
        assert isinstance(exc, want), f"{label}: rank {c.rank} got {type(exc).__name__}: {exc}"
        for needle in needles if c.rank not in bad_ranks or want is remote else ():
            assert needle in str(exc), f"{label}: {needle!r} not in {exc}"
    else:
        raise AssertionError(f"{label}: rank {c.rank} raised nothing")
    total = await c.allreduce(torch.ones(2))
    assert torch.equal(total, torch.full((2,), float(c.size))), f"{label}: desync after error"
    report(c.rank, label)


async def main() -> None:
    async with asynclock.start() as c:
        last = c.size - 1
        all_ranks = set(range(c.size))
        if c.size > 1:
            t = torch.ones(4, 4)
            bad = t.t() if c.rank == last else t
            await expect(c, "noncontiguous", lambda: c.allreduce(bad), InvalidInputError,
                         RemoteInputError, {last}, f"rank {last}", "not contiguous")
            await expect(c, "shape", lambda: c.allreduce(torch.ones(3 + (c.rank == last))),
                         MismatchError, MismatchError, all_ranks, "float32[3]", "float32[4]",
                         f"rank {last}")
            big = torch.ones(100_000 + (c.rank == last))
            await expect(c, "shape_big", lambda: c.allreduce(big),
                         MismatchError, MismatchError, all_ranks, "float32[100000]")
            dt = torch.float64 if c.rank == last else torch.float32
            await expect(c, "dtype", lambda: c.allreduce(torch.ones(8, dtype=dt)), MismatchError,
                         MismatchError, all_ranks, "float64", "float32")
            op = "max" if c.rank == 0 else "sum"
            await expect(c, "op", lambda: c.allreduce(torch.ones(2), op), MismatchError,
                         MismatchError, all_ranks, "allreduce(max)", "allreduce(sum)")
            bogus = "bogus" if c.rank == last else "sum"
            await expect(c, "op_name", lambda: c.allreduce(torch.ones(2), bogus),
                         InvalidInputError, RemoteInputError, {last}, f"rank {last}",
                         "invalid argument")
            kind = (lambda: c.broadcast(torch.ones(2))) if c.rank == 0 else (
                lambda: c.allreduce(torch.ones(2)))
            await expect(c, "kind", kind, MismatchError, MismatchError, all_ranks,
                         "broadcast(root=0)", "allreduce(sum)")
            await expect(c, "name", lambda: c.allreduce(torch.ones(2), name=f"grad{c.rank}"),
                         MismatchError, MismatchError, all_ranks, "name='grad0'", "name='grad1'")
            obj = (lambda: 1) if c.rank == last else 1  # a lambda does not pickle
            await expect(c, "unpicklable", lambda: c.allgather_object(obj), InvalidInputError,
                         RemoteInputError, {last}, f"rank {last}", "cannot be pickled")
            root_obj = (lambda: 1) if c.rank == 0 else None  # only root's is pickled
            await expect(c, "unpicklable_root", lambda: c.broadcast_object(root_obj),
                         InvalidInputError, RemoteInputError, {0}, "rank 0",
                         "cannot be pickled")
            meta = torch.empty(3, device="meta") if c.rank == 0 else torch.ones(3)
            await expect(c, "device", lambda: c.allreduce(meta), InvalidInputError,
                         RemoteInputError, {0}, "rank 0", "device")
        await expect(c, "dtype_unsupported", lambda: c.allreduce(torch.ones(2, dtype=torch.bool)),
                     InvalidInputError, RemoteInputError, all_ranks, "dtype")
        await expect(c, "root", lambda: c.broadcast(torch.ones(2), root=c.size),
                     InvalidInputError, RemoteInputError, all_ranks, "root")
        await expect(c, "not_tensor", lambda: c.allreduce([1.0, 2.0]), InvalidInputError,
                     RemoteInputError, all_ranks, "not a torch tensor")
        await c.drain(timeout=10)  # a rejecting rank's announcement may finish last
        stats = c.statistics()
        assert stats.in_flight == 0 and stats.issued == stats.completed, stats
    try:
        await c.allreduce(torch.ones(1))
    except asynclock.ShutdownError as exc:
        assert "shut down" in str(exc)
        report(c.rank, "after_shutdown")
    try:
        asynclock.coordinator()
    except asynclock.NotInitializedError:
        report(c.rank, "not_initialized")
    report(c.rank, "done")


run(main)
