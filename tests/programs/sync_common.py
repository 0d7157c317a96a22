"""Helpers for the sync rank programs: names homed on a chosen rank, polling
with a deadline (never a timing assumption), and shared files."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from asynclock._core.sync._wire import home_rank


def homed(prefix: str, rank: int, size: int) -> str:
    """A primitive name whose home is `rank`, so a test knows where state lives."""
    i = 0
    while home_rank(f"{prefix}-{i}", size) != rank:
        i += 1
    return f"{prefix}-{i}"


# The lock-like primitives every lock check runs against, by the labels the tests expect.
LOCK_KINDS: dict[str, Callable[[Any, str], Any]] = {
    "lock": lambda c, name: c.lock(name),
    "sem1": lambda c, name: c.semaphore(name, 1),
    "cond": lambda c, name: c.condition(name),
}


def homed_lock(c: Any, kind: str, tag: str, home: int = 0) -> Any:
    """A `kind` primitive (`LOCK_KINDS`) for check `tag`, homed on rank `home`."""
    return LOCK_KINDS[kind](c, homed(f"{kind}-{tag}", home, c.size))


async def until(pred: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll `pred` (yielding to the loop) until true; fail loudly at the deadline."""
    with anyio.fail_after(timeout):
        while not pred():
            await anyio.sleep(0.001)
    assert pred(), what


async def until_async(pred: Callable[[], Awaitable[bool]], what: str,
                      timeout: float = 20.0) -> None:
    try:
        with anyio.fail_after(timeout):
            while not await pred():
                await anyio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for: {what}") from None


def workdir() -> Path:
    """The shared directory the test passes as the last argument."""
    return Path(sys.argv[-1])


def base(lk: Any) -> Any:
    """The Lock/Semaphore behind a lock-like object (a Condition's lock)."""
    return getattr(lk, "lock", lk)


async def settle(lk: Any, holders: int = 0, waiters: int = 0) -> None:
    """Wait until the home rank shows exactly this many holders and waiters."""
    async def ok() -> bool:
        info = await lk.info()
        if len(info.waiters) != waiters:
            return False
        if holders == 0:  # an idle lease cached on a rank counts as free
            return set(info.holders) <= set(info.leased)
        return len(info.holders) == holders
    await until_async(ok, f"{base(lk).name}: {holders} holders, {waiters} waiters")


def append(path: Path, line: str) -> None:
    """One O_APPEND write: atomic for short lines, so concurrent writers interleave
    whole lines only."""
    with open(path, "a") as f:
        f.write(line + "\n")


def lines(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def run_or_abort(main: Callable[[], Awaitable[Any]]) -> None:
    """Run `main`; on any failure print it and abort the whole job at once, so a
    failing rank cannot leave the others waiting until the test's timeout."""
    import traceback

    from _common import run

    try:
        run(main)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)
