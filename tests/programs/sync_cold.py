"""A rank that never used a sync primitive idles at the cold cadence; the first
request that reaches a primitive homed there is still served, and from then on
that rank polls at the usual cadence.

Asserts on the sleeps the pump asks for (values, not observed timing): cold,
after 1.5 s idle, some exceed the warm cap (20 ms) and none the cold one; warm,
none exceeds the warm cap. Usage: sync_cold.py [--trio]
"""

from __future__ import annotations

import time

import anyio
from _common import report
from sync_common import homed, run_or_abort

import asynclock

HOME = 1


def record_sleeps(svc: object) -> list[float]:
    """Wrap the pump's wakeup so every timeout it asks for is kept."""
    wakeup = svc._wakeup  # type: ignore[attr-defined]
    asked: list[float] = []
    sleep = wakeup.sleep

    async def recording(timeout: float | None) -> None:
        asked.append(-1.0 if timeout is None else timeout)
        await sleep(timeout)

    wakeup.sleep = recording
    return asked


async def idle_sleeps(c: asynclock.Coordinator, asked: list[float]) -> list[float]:
    await c.barrier()
    asked.clear()
    await anyio.sleep(1.5)
    return list(asked)


async def main() -> None:
    async with asynclock.start() as c:
        svc = c.lowlevel.sync
        warm_cap = c.lowlevel.engine.policy.max_sleep_s
        asked = record_sleeps(svc)
        assert svc._cold(), "a fresh coordinator has used no primitive"
        cold = await idle_sleeps(c, asked)
        assert max(cold) > warm_cap and max(cold) <= svc.cold_max_sleep_s, cold
        report(c.rank, "cold_cadence", f"longest sleep {max(cold) * 1e3:.0f} ms")
        name = homed("cold", HOME, c.size)
        if c.rank == 0:  # first contact with a primitive homed on a cold rank
            t0 = time.monotonic()
            async with c.lock(name):
                pass
            report(c.rank, "first_contact", f"{time.monotonic() - t0:.3f}s")
        await c.barrier()
        if c.rank == HOME:
            assert not svc._cold(), "serving a primitive warms the home rank"
            warm = await idle_sleeps(c, asked)
            assert max(warm) <= warm_cap, warm
            report(c.rank, "warm_cadence", f"longest sleep {max(warm) * 1e3:.0f} ms")
        else:
            await idle_sleeps(c, asked)
    report(c.rank, "done")


if __name__ == "__main__":
    run_or_abort(main)
