"""CPU per wake-up of the ways an event loop can sleep, and an idle coordinator's cost.

Run: python bench/wakeups.py            (the sleep kinds, one process)
     mpiexec -n 2 python bench/wakeups.py --idle 5   (plus an idle coordinator)

Why: on the small VMs this project runs on, a thread that wakes from a timed
sleep pays hundreds of microseconds of CPU (cold caches, timer interrupts),
and the Python around the wake multiplies it. The progress engine and the
sync pump sleep and wake all the time, on the cores that train, so their
idle cost is worth a number. Prints CPU us per wake (thread time) for each
kind and period, and with --idle the loop thread's CPU ms per second while
a coordinator (Horovod-style `init`) sits idle.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
from timing import median

from asynclock._core.base.wakeup import Wakeup

Sleep = Callable[[float], Awaitable[None]]


def kinds() -> dict[str, Sleep]:
    """The spellings compared: bare asyncio, anyio's Event in a cancel scope, Wakeup."""
    wakeup = Wakeup()

    async def asyncio_sleep(p: float) -> None:
        await asyncio.sleep(p)

    async def anyio_event_scope(p: float) -> None:
        event = anyio.Event()
        with anyio.move_on_after(p):
            await event.wait()

    async def asynclock_wakeup(p: float) -> None:
        await wakeup.sleep(p)

    return {"asyncio.sleep": asyncio_sleep, "anyio Event+move_on_after": anyio_event_scope,
            "asynclock Wakeup": asynclock_wakeup}


async def per_wake(sleep: Sleep, period: float, seconds: float) -> float:
    """Median over 3 windows of thread CPU microseconds per timed-out sleep."""
    results = []
    for _ in range(3):
        n, t0 = 0, time.thread_time()
        end = time.monotonic() + seconds / 3
        while time.monotonic() < end:
            await sleep(period)
            n += 1
        results.append((time.thread_time() - t0) / n * 1e6)
    return median(results)


def sleep_table(seconds: float) -> None:
    print(f"{'kind':28} {'period':>7} {'us CPU/wake':>12}")
    for period in (0.001, 0.02):
        for name, sleep in kinds().items():
            us = asyncio.run(per_wake(sleep, period, seconds))
            print(f"{name:28} {period * 1e3:5.0f}ms {us:12.1f}")


def idle_coordinator(seconds: float) -> None:
    """Loop-thread CPU per second of an idle Horovod-style coordinator."""
    import asynclock.torch as hvd
    from asynclock._core.runtime import coordinator as runtime

    hvd.init()
    runtime.coordinator().lowlevel.run_sync(_touch)  # start the loop thread
    time.sleep(0.5)
    threads = [t for t in threading.enumerate() if t is not threading.current_thread()]

    def cpu() -> float:
        return sum(time.clock_gettime(time.pthread_getcpuclockid(t.ident or 0))
                   for t in threads if t.is_alive())

    a = cpu()
    time.sleep(seconds)
    b = cpu()
    if hvd.rank() == 0:
        print(f"idle coordinator, {hvd.size()} ranks, pid {os.getpid()}: "
              f"{(b - a) / seconds * 1e3:.1f} ms CPU per second in asynclock's threads")
    hvd.shutdown()


async def _touch() -> None:
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per kind and period")
    p.add_argument("--idle", type=float, default=0.0,
                   help="also time an idle coordinator for this many seconds")
    args = p.parse_args()
    if os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")) == "0":
        sleep_table(args.seconds)
    if args.idle:
        idle_coordinator(args.idle)


if __name__ == "__main__":
    main()
