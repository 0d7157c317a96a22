"""Timing helpers the bench scripts share, so that every figure they print is computed
one way: a median, a percentile, seconds per call over a batch, the calls that make a
batch of a given length, and a wall-and-CPU stopwatch.

The scripts run as `python bench/NAME.py`, which puts bench/ on `sys.path`, so they
`import timing`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Awaitable, Callable, Iterable
from types import TracebackType
from typing import Any


def median(values: Iterable[float]) -> float:
    return float(statistics.median(values))


def percentile(values: Iterable[float], q: float) -> float:
    """The `q` quantile (0 to 1) by the nearest rank below: the sorted values' element
    at `int(q * (n - 1))`, a value that was measured (no interpolation)."""
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def per_call(fn: Callable[[], Any], calls: int,
             before: Callable[[], Any] | None = None) -> float:
    """Seconds per call of `calls` calls in a row; `before` (a barrier, say) runs first,
    untimed, so that the ranks of a job start the batch together."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


async def per_call_async(fn: Callable[[], Awaitable[Any]], calls: int,
                         before: Callable[[], Any] | None = None) -> float:
    """`per_call` for a call that is awaited."""
    if before is not None:
        before()
    t0 = time.perf_counter()
    for _ in range(calls):
        await fn()
    return (time.perf_counter() - t0) / calls


def batch_size(seconds_per_call: float, batch_s: float) -> int:
    """Calls that fill a batch of about `batch_s` seconds: at least 3, so a slow call
    still gives a batch, and at most 20000, so a fast one does not run for ever when
    its warm-up was too quick to time."""
    return max(3, min(20000, int(batch_s / max(seconds_per_call, 1e-7))))


class Stopwatch:
    """`with Stopwatch() as sw:`, then `sw.wall` (perf_counter) and `sw.cpu` (this
    process's CPU time, every thread) in seconds; an `await` inside is timed too."""

    wall: float
    cpu: float

    def __enter__(self) -> Stopwatch:
        self._wall0, self._cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.wall = time.perf_counter() - self._wall0
        self.cpu = time.process_time() - self._cpu0
