"""One rank per netrig host: a collective, a cross-host lock, a few training
steps, then (optionally) a link that heals and a link that stays cut.

    netrig_job.py WORKDIR [--heal] [--cut] [--trio] [--skip-train]

The test harness drives the faults; the ranks only keep traffic going and
say where they are (`RANK r OK label detail` lines):

* `pid` first (the harness checks afterwards that every rank is gone);
* `collective`, `lock`, `train`: each checked on every rank;
* `--heal`: ranks allreduce in a loop until rank 0 sees WORKDIR/healed
  (written by the harness after it cut a link and healed it again); the
  decision to stop travels in the allreduce itself, so every rank stops
  after the same iteration. `healed` reports the longest iteration (the
  stall the cut caused): the job must live through it.
* `--cut`: `armed`, then allreduces until the watchdog ends the job when the
  harness cuts a link for good. Bounded: `survived` after HOLD_S means the
  cut went unnoticed (the harness fails on it).
"""

from __future__ import annotations

import os
import socket
import sys
import time
import zlib
from pathlib import Path

import anyio
import numpy as np
from _common import report, run

import asynclock

HOLD_S = 45.0  # upper bound of every loop here
LOCK_ROUNDS = 4


def home_rank_name(prefix: str, home: int, size: int) -> str:
    """A lock name whose home rank (crc32 % size) is `home`: rank 0 must cross hosts."""
    return next(f"{prefix}{i}" for i in range(10_000)
                if zlib.crc32(f"{prefix}{i}".encode()) % size == home)


async def check_collective(c: asynclock.Coordinator) -> None:
    total = await c.allreduce(np.arange(4, dtype=np.float64) + c.rank)
    want = np.arange(4) * c.size + sum(range(c.size))
    assert (total == want).all(), f"allreduce gave {total}, want {want}"
    hosts = await c.allgather_object(socket.gethostname())
    assert len(set(hosts)) == c.size, f"ranks share hosts: {hosts}"
    assert c.local_size == 1, f"MPI puts {c.local_size} ranks on this host: shared memory"
    big = await c.allreduce(np.ones(1 << 20, np.float32))  # 4 MiB: a bulk data stage
    assert (big == c.size).all()
    huge = await c.allreduce(np.arange(1 << 22, dtype=np.float32) % 5 + c.rank)  # 16 MiB
    assert (huge == (np.arange(1 << 22) % 5) * c.size + sum(range(c.size))).all()
    bulk = getattr(c.backend, "bulk_choice", "")
    report(c.rank, "collective", ",".join(hosts) + f" | bulk {bulk} | gloo calls "
           f"{c.backend.gloo_calls() if bulk else 0}")


async def check_lock(c: asynclock.Coordinator, workdir: Path) -> None:
    """Every rank appends `in`/`out` pairs to one shared file under the lock."""
    lock = c.lock(home_rank_name("netrig-lock-", c.size - 1, c.size))
    path = workdir / "lock.log"
    for _ in range(LOCK_ROUNDS):
        async with lock:
            _append(path, f"{c.rank} in")
            await anyio.sleep(0.005)
            _append(path, f"{c.rank} out")
    await c.barrier()
    lines = path.read_text().split("\n")[:-1]
    assert len(lines) == 2 * LOCK_ROUNDS * c.size, lines
    for a, b in zip(lines[::2], lines[1::2], strict=True):
        assert a.endswith(" in") and b == a.replace(" in", " out"), f"overlap: {a!r}, {b!r}"
    report(c.rank, "lock", f"home rank {lock.statistics().home_rank}")


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


async def check_train(c: asynclock.Coordinator) -> None:
    """Three steps of the async train step; parameters equal on every host."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    step = c.train_step(torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(c.rank)
    for _ in range(3):
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        async with step:
            await step.backward(torch.nn.functional.cross_entropy(model(x), y))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = await c.allgather(flat[None])
    assert all(torch.equal(rows[0], rows[r]) for r in range(c.size)), "parameters differ"
    report(c.rank, "train", f"steps {step.statistics().steps}")


async def survive_heal(c: asynclock.Coordinator, workdir: Path) -> None:
    """Traffic across a link that goes down and comes back within the deadline."""
    report(c.rank, "heal_armed")
    flag, longest, t0 = workdir / "healed", 0.0, time.monotonic()
    while time.monotonic() - t0 < HOLD_S:
        t = time.monotonic()
        go = np.array([0.0 if c.rank == 0 and flag.exists() else 1.0])
        await c.allreduce(np.ones(1 << 16), name="heal-traffic")
        stop = (await c.allreduce(go, op="min"))[0] == 0.0
        longest = max(longest, time.monotonic() - t)
        if stop:
            report(c.rank, "healed", f"longest iteration {longest:.2f}s")
            return
    raise AssertionError(f"no {flag} after {HOLD_S} s")


async def wait_for_cut(c: asynclock.Coordinator) -> None:
    """Allreduce until the watchdog stops the job (it must, within the bound)."""
    report(c.rank, "armed")
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < HOLD_S:
        await c.allreduce(np.ones(1 << 16), name="step")
        n += 1
    report(c.rank, "survived", f"{n} allreduces")


async def main() -> None:
    if "--skip-train" not in sys.argv:
        import torch  # noqa: F401  - before start: then bulk allreduces may go over gloo
    workdir = Path(sys.argv[1])
    async with asynclock.start() as c:
        report(c.rank, "pid", f"{os.getpid()} {socket.gethostname()}")
        await check_collective(c)
        await check_lock(c, workdir)
        if "--skip-train" not in sys.argv:
            await check_train(c)
        if "--heal" in sys.argv:
            await survive_heal(c, workdir)
        if "--cut" in sys.argv:
            await wait_for_cut(c)
        await c.barrier()
        report(c.rank, "done")


run(main)
