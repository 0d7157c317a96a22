"""torch state dicts through Checkpointer on real ranks: sharded and rank-0
sets, retention, fallback past a damaged file, and collective errors.

Usage: ckpt_roundtrip.py [--trio] WORKDIR
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import torch
from _common import expect_async, report
from sync_common import run_or_abort, workdir

import asynclock
from asynclock._tools.checkpoint import Checkpointer, CheckpointError, complete_sets, find_latest


def model_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 6)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "opt": opt.state_dict(), "seed": seed}


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["seed"] == b["seed"] and all(torch.equal(a["model"][k], b["model"][k])
                                          for k in a["model"])


async def check_sharded(c: asynclock.Coordinator, d: Path) -> None:
    ck = Checkpointer(c, d, keep=2, sharded=True)
    assert await ck.load() is None
    for step in range(4):
        await ck.save(step, model_state(100 * step + c.rank), metadata={"epoch": step})
    got = await ck.load()
    assert got is not None and got[0] == 3 and same(got[1], model_state(300 + c.rank))
    assert len(complete_sets(d)) == 2  # keep=2
    ref = find_latest(d)
    assert ref is not None and ref.manifest["metadata"] == {"epoch": 3}
    assert (d / "latest").read_text().strip() == ref.path.name


async def check_rank0(c: asynclock.Coordinator, d: Path) -> None:
    ck = Checkpointer(c, d, keep=1)
    await ck.save(7, model_state(7 if c.rank == 0 else 99))
    got = await ck.load()
    assert got is not None and got[0] == 7 and same(got[1], model_state(7))
    assert [p.name for p in (complete_sets(d)[0]).iterdir()] != []


async def check_damaged_fallback(c: asynclock.Coordinator, d: Path) -> None:
    """A flipped byte in one rank's shard of the newest set: every rank moves on
    to the previous set together."""
    ck = Checkpointer(c, d, keep=3, sharded=True)
    for step in (1, 2):
        await ck.save(step, model_state(step + 10 * c.rank))
    await c.barrier()
    if c.rank == c.size - 1:
        newest = complete_sets(d)[0]
        shard = sorted(newest.glob("rank-*"))[-1]
        raw = bytearray(shard.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        shard.write_bytes(bytes(raw))
    await c.barrier()
    got = await ck.load()
    assert got is not None and got[0] == 1 and same(got[1], model_state(1 + 10 * c.rank))


async def check_errors(c: asynclock.Coordinator, d: Path) -> None:
    ck = Checkpointer(c, d, sharded=True)
    await ck.save(5, model_state(c.rank))
    try:
        await ck.save(6 + c.rank, model_state(c.rank))
    except CheckpointError as exc:
        assert "disagree" in str(exc) and "rank 1: 7" in str(exc), exc
    else:
        raise AssertionError("step disagreement accepted")
    bad = {"x": lambda: 0} if c.rank == 1 else model_state(c.rank)  # not picklable
    try:
        await ck.save(6, bad)
    except CheckpointError as exc:
        assert "writing failed on rank 1" in str(exc), exc
    else:
        raise AssertionError("failed write accepted")
    got = await ck.load()
    assert got is not None and got[0] == 5 and same(got[1], model_state(c.rank))


async def check_restarted_steps(c: asynclock.Coordinator, d: Path) -> None:
    """A new run saving lower steps into the same folder: its save is the newest (it
    survives retention and is what `load` returns), not the highest step."""
    ck = Checkpointer(c, d, keep=2)
    for step in (100, 200, 10):
        path = await ck.save(step, model_state(step))
        assert path.is_dir(), f"save({step}) returned {path}, which retention removed"
    got = await ck.load()
    assert got is not None and got[0] == 10 and same(got[1], model_state(10)), got
    assert [int(p.name[5:17]) for p in complete_sets(d)] == [10, 200]
    assert (d / "latest").read_text().strip() == complete_sets(d)[0].name


async def check_unusable_raises(c: asynclock.Coordinator, d: Path) -> None:
    """An intact set this job cannot use raises CheckpointError on every rank rather
    than resuming silently from an older set or from nothing."""
    ck = Checkpointer(c, d / "objects", keep=2)
    await ck.save(1, model_state(1))
    await ck.save(2, {**model_state(2), "rng": object.__new__(Rng)})  # no weights_only
    exc = await expect_async(CheckpointError, "cannot be loaded", ck.load)
    assert "rank 0" in str(exc), exc
    got = await ck.load(weights_only=False)
    assert got is not None and got[0] == 2, got
    bigger = Checkpointer(c, d / "sharded", sharded=True)
    await bigger.save(3, model_state(c.rank))
    if c.rank == 0:  # this job's sharded set, as a job of another size wrote it
        manifest = complete_sets(d / "sharded")[0] / "MANIFEST.json"
        text = manifest.read_text().replace(f'"world_size": {c.size}',
                                            f'"world_size": {c.size + 1}')
        manifest.write_text(text)
    await c.barrier()
    await expect_async(CheckpointError, f"this job has {c.size} ranks", bigger.load)


class Rng:
    """A pickled object that torch.load(weights_only=True) refuses."""


async def check_cancel_and_bad_step(c: asynclock.Coordinator, d: Path) -> None:
    """A save cancelled on one rank still ends on every rank (the cancel waits for it),
    and a step that is no integer on one rank fails the save on every rank; the next
    save and load work everywhere."""
    ck = Checkpointer(c, d, keep=3)
    last = c.size - 1
    with anyio.move_on_after(0.0 if c.rank == last else 60) as scope:
        await ck.save(1, model_state(1))
    assert scope.cancel_called == (c.rank == last), scope.cancel_called
    assert [int(p.name[5:17]) for p in complete_sets(d)] == [1]  # it ended everywhere
    step: Any = "two" if c.rank == last else 2
    exc = await expect_async(CheckpointError, f"rank {last}: 'two'",
                             lambda: ck.save(step, model_state(2)))
    assert "integer" in str(exc), exc
    await ck.save(3, model_state(3))
    got = await ck.load()
    assert got is not None and got[0] == 3 and same(got[1], model_state(3)), got
    assert [int(p.name[5:17]) for p in complete_sets(d)] == [3, 1]


CHECKS: list[tuple[str, Callable[[asynclock.Coordinator, Path], Awaitable[None]]]] = [
    ("sharded", check_sharded), ("rank0", check_rank0),
    ("damaged_fallback", check_damaged_fallback), ("errors", check_errors),
    ("restarted_steps", check_restarted_steps), ("unusable_raises", check_unusable_raises),
    ("cancel_and_bad_step", check_cancel_and_bad_step)]


async def main() -> None:
    wd = workdir()
    async with asynclock.start() as c:
        for label, check in CHECKS:
            await check(c, wd / label)
            report(c.rank, label)
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
