"""The engine's sleep (`asynclock._core.base.wakeup.Wakeup`) on asyncio and trio: woken early,
timed out, cancelled, and a wake with nobody asleep dropped."""

from __future__ import annotations

import asyncio
import time

import anyio
import pytest

from asynclock._core.base.wakeup import Wakeup

BACKENDS = ["asyncio", "trio"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_wake_ends_the_sleep_before_its_timeout(backend: str) -> None:
    wakeup = Wakeup()
    seen: list[str] = []

    async def sleeper() -> None:
        await wakeup.sleep(30.0)
        seen.append("woke")

    async def main() -> float:
        t0 = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(sleeper)
            while not wakeup.sleeping:
                await anyio.sleep(0)
            wakeup.wake()
        return time.monotonic() - t0

    took = anyio.run(main, backend=backend)
    assert seen == ["woke"] and took < 5.0
    assert not wakeup.sleeping


@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_ends_the_sleep(backend: str) -> None:
    wakeup = Wakeup()

    async def main() -> float:
        t0 = time.monotonic()
        await wakeup.sleep(0.02)
        return time.monotonic() - t0

    took = anyio.run(main, backend=backend)
    assert 0.015 <= took < 5.0
    assert not wakeup.sleeping


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_wake_with_nobody_asleep_is_dropped(backend: str) -> None:
    wakeup = Wakeup()

    async def main() -> float:
        wakeup.wake()  # nobody sleeps: must not end the next sleep
        t0 = time.monotonic()
        await wakeup.sleep(0.02)
        return time.monotonic() - t0

    assert anyio.run(main, backend=backend) >= 0.015


@pytest.mark.parametrize("backend", BACKENDS)
def test_cancelled_sleep_leaves_no_sleeper_regression(backend: str) -> None:
    """A cancelled sleeper must not stay registered: a later wake() would then
    settle a dead future (asyncio) or set a stale event instead of waking the
    next sleep."""
    wakeup = Wakeup()

    async def main() -> bool:
        with anyio.move_on_after(0.01):
            await wakeup.sleep(None)
        cleared = not wakeup.sleeping
        wakeup.wake()  # harmless now
        t0 = time.monotonic()
        await wakeup.sleep(0.02)
        return cleared and time.monotonic() - t0 >= 0.015

    assert anyio.run(main, backend=backend)


def test_asyncio_sleep_leaves_no_live_timer() -> None:
    """On asyncio the timeout is a plain `call_later`; it is cancelled when the
    sleep ends early, so idle loops do not collect dead timers."""
    wakeup = Wakeup()

    async def main() -> int:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(wakeup.sleep(60.0))
        while not wakeup.sleeping:
            await asyncio.sleep(0)
        wakeup.wake()
        await task
        scheduled = getattr(loop, "_scheduled", [])
        return sum(1 for h in scheduled if not h.cancelled() and h.when() > loop.time() + 30)

    assert asyncio.run(main()) == 0
