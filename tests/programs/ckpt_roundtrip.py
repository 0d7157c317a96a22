"""torch state dicts through Checkpointer on real ranks: sharded and rank-0
sets, retention, fallback past a damaged file, and collective errors.

Usage: ckpt_roundtrip.py [--trio] WORKDIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from _common import report
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


async def main() -> None:
    wd = workdir()
    async with asynclock.start() as c:
        await check_sharded(c, wd / "sharded")
        report(c.rank, "sharded")
        await check_rank0(c, wd / "rank0")
        report(c.rank, "rank0")
        await check_damaged_fallback(c, wd / "damaged")
        report(c.rank, "damaged_fallback")
        await check_errors(c, wd / "errors")
        report(c.rank, "errors")
        await c.barrier()
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
