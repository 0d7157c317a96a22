"""`await asynclock.cuda.wait(event)`: await GPU work without blocking the loop.

CUDA has no file descriptor to wait on either. Three policies
(ASYNCLOCK_CUDA_WAIT, default ``auto``):

* ``poll``: `event.query()` (cudaEventQuery, about a microsecond) with
  adaptive backoff, like the progress engine: bare `sleep(0)` yields for
  `busy_s` (other tasks run at every yield), then sleeps of 5% of the time
  already waited, clamped to [`min_sleep_s`, `max_sleep_s`]. Never strands
  a thread, never spins a core; but asyncio's epoll timeout has 1 ms
  granularity, so past the tight phase a wake-up comes ~1 ms late.
* ``thread``: a helper thread calls `event.synchronize()` (GIL released)
  and wakes the loop through `loop_caller()`: a thread hop on every wait,
  and on an event made without `blocking=True` CUDA spins the helper's core
  for the whole wait (cudaDeviceScheduleAuto spins while there are fewer
  contexts than cores). A cancelled waiter leaves the helper blocked until
  the GPU finishes, which is harmless.
* ``auto``: the tight phase of ``poll`` (short hand-overs finish within it,
  at microsecond latency and without a thread hop); then, for events known
  to be blocking-sync (`record()` makes them so and marks them with
  `asynclock_blocking = True`), the helper thread, which sleeps in the
  driver and wakes the loop at once; other events keep polling.

`tests/gpu/bench_wait_gpu.py` measures the policies (wake-up latency, CPU
per second of waiting, side-task progress; `--emulate` without a GPU):
``poll`` wakes soonest from short waits, ``thread`` from long ones and with
the least CPU, and ``auto`` comes close to the better of the two at both
ends (figures on the benchmarks page). Hence ``auto``.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import anyio

from ..base import settings
from ..base.backoff import Backoff
from ..base.errors import CollectiveTimeout
from ..base.from_thread import loop_caller
from .device import active_torch, blocking_event


@dataclass(frozen=True, slots=True)
class WaitPolicy:
    """How `wait` waits (env: ASYNCLOCK_CUDA_WAIT, _CUDA_BUSY_US, _CUDA_MAX_SLEEP_US).

    Attributes:
        mode: "auto", "poll" or "thread" (see the module's description).
        busy_s: seconds of bare yields between queries before sleeping.
        min_sleep_s: the shortest sleep between queries.
        max_sleep_s: the longest sleep between queries.
        sleep_fraction: past the busy phase, sleep this share of the time waited.
    """

    mode: str = "auto"
    busy_s: float = 1e-3
    min_sleep_s: float = 1e-4
    max_sleep_s: float = 2e-3
    sleep_fraction: float = 0.05

    @classmethod
    def from_env(cls) -> WaitPolicy:
        """The defaults, with the environment's settings applied.

        Returns:
            A policy with ASYNCLOCK_CUDA_WAIT, _CUDA_BUSY_US and _CUDA_MAX_SLEEP_US read.
        """
        return cls(mode=settings.text("ASYNCLOCK_CUDA_WAIT"),
                   busy_s=settings.number("ASYNCLOCK_CUDA_BUSY_US") * 1e-6,
                   max_sleep_s=settings.number("ASYNCLOCK_CUDA_MAX_SLEEP_US") * 1e-6)

    def backoff(self, start: float) -> Backoff:
        """The pauses of one wait.

        Args:
            start: when the wait began (`time.perf_counter()`).

        Returns:
            A fresh `Backoff` for that wait.
        """
        return Backoff(self.min_sleep_s, self.max_sleep_s, share=self.sleep_fraction,
                       busy_s=self.busy_s, since=start)

    def next_sleep(self, waited: float) -> float:
        """The pause after waiting `waited` seconds.

        Args:
            waited: seconds waited so far.

        Returns:
            0 (a bare yield) while busy, then a sleep growing with the wait.
        """
        return self.backoff(0.0).next_sleep(waited)


MODES = ("auto", "poll", "thread")


@dataclass(frozen=True, slots=True)
class WaitStatistics:
    """Process-wide counts of `wait`, for tests and tuning.

    Attributes:
        waits: calls of `wait`.
        immediate: calls that returned at once (no event, or already done).
        queries: event queries.
        thread_waits: waits handed to a helper thread.
        in_progress: waits in progress now.
    """

    waits: int
    immediate: int
    queries: int
    thread_waits: int
    in_progress: int


class _Counters:
    __slots__ = ("waits", "immediate", "queries", "thread_waits", "in_progress")

    def __init__(self) -> None:
        self.waits = self.immediate = self.queries = self.thread_waits = self.in_progress = 0


_COUNT = _Counters()
_POLICY: WaitPolicy | None = None


def statistics() -> WaitStatistics:
    """This process's `wait` counts so far: calls, those that returned at once, event
    queries, waits handed to a helper thread, and waits in progress now.

    Returns:
        The counts.
    """
    c = _COUNT
    return WaitStatistics(c.waits, c.immediate, c.queries, c.thread_waits, c.in_progress)


def default_policy() -> WaitPolicy:
    global _POLICY
    if _POLICY is None:
        _POLICY = WaitPolicy.from_env()
    return _POLICY


def as_event(target: Any) -> Any:
    """None, an event (anything with `query()`), or a stream: record on it now.

    A stream is turned into an event recorded *now*, so the wait covers the
    work queued so far and not work queued while we wait.
    """
    if target is None:
        return None
    if hasattr(target, "record_event"):
        torch = active_torch()
        if torch is None:
            raise RuntimeError("cuda.wait got a stream but CUDA is not initialised")
        return blocking_event(torch, target)
    if callable(getattr(target, "query", None)):
        return target
    raise TypeError(f"cuda.wait needs None, a CUDA event or a CUDA stream, "
                    f"got {type(target).__name__}")


async def wait(target: Any = None, *, timeout: float | None = None,
               policy: WaitPolicy | None = None) -> None:
    """Return once the GPU work behind `target` finished; the loop stays live.

    Args:
        target: None (returns at once), a `torch.cuda.Event` or anything with
            `query()`, or a `torch.cuda.Stream` (waits for the work queued on it so far).
        timeout: seconds to wait; None waits for ever.
        policy: how to wait (None: `WaitPolicy.from_env()`, read once).

    Raises:
        CollectiveTimeout: not done within `timeout`; the GPU work itself goes on.
        TypeError: `target` is no event or stream.
        RuntimeError: a stream is given but CUDA is not initialised.
    """
    event = as_event(target)
    _COUNT.waits += 1
    if event is None or _query(event):
        _COUNT.immediate += 1
        return
    pol = policy or default_policy()
    _COUNT.in_progress += 1
    try:
        with anyio.fail_after(timeout):
            await _wait_by_policy(event, pol)
    except TimeoutError as exc:
        raise CollectiveTimeout(f"cuda.wait({event!r}) passed its {timeout} s deadline; "
                                "the GPU work is still running") from exc
    finally:
        _COUNT.in_progress -= 1


def blocking_sync(event: Any) -> bool:
    """Whether a thread can `synchronize()` on `event` without spinning a core."""
    return bool(getattr(event, "asynclock_blocking", False)) and callable(
        getattr(event, "synchronize", None))


async def _wait_by_policy(event: Any, policy: WaitPolicy) -> None:
    if policy.mode == "thread" and callable(getattr(event, "synchronize", None)):
        await _wait_in_thread(event)
        return
    start = time.perf_counter()
    if policy.mode == "auto" and blocking_sync(event):
        if not await _poll(event, policy, start, policy.busy_s):
            await _wait_in_thread(event)
        return
    await _poll(event, policy, start, None)


def _query(event: Any) -> bool:
    _COUNT.queries += 1
    return bool(event.query())


async def _poll(event: Any, policy: WaitPolicy, start: float, limit_s: float | None) -> bool:
    """Poll with backoff; False if `limit_s` passed first."""
    backoff = policy.backoff(start)
    while True:
        now = time.perf_counter()
        if limit_s is not None and backoff.waited(now) >= limit_s:
            return False
        await anyio.sleep(backoff.next_sleep(now))
        if _query(event):
            return True


_EXECUTOR_LOCK = threading.Lock()
_EXECUTOR: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    """Helper threads shared by this process's thread waits, started on demand.

    Generous (32): a waiter queued behind threads blocked on long GPU work
    would wake late even though its own event completed.
    """
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = ThreadPoolExecutor(32, thread_name_prefix="asynclock-cuda-wait")
        return _EXECUTOR


async def _wait_in_thread(event: Any) -> None:
    """`event.synchronize()` in a helper thread; it wakes us via the loop."""
    _COUNT.thread_waits += 1
    call = loop_caller()
    woken = anyio.Event()
    failure: list[BaseException] = []

    def block() -> None:
        try:
            event.synchronize()
        except BaseException as exc:  # handed to the awaiting task
            failure.append(exc)
        call(woken.set)

    _executor().submit(block)
    await woken.wait()  # cancelled: the helper finishes later and wakes nobody
    if failure:
        raise failure[0]
