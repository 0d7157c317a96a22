"""How every poll loop of asynclock waits: tight at first, then sleeps that grow.

MPI requests, CUDA events, Horovod handles and peers' messages have no file
descriptor to wait on, so the code that awaits them polls. Each such loop
asks one `Backoff` how long to sleep before its next test:

* during a tight phase (`busy_s` since the last progress) 0, a bare yield or
  an immediate retest: a hand-over that finishes within microseconds is not
  made to wait for a timer;
* then `share` of the time waited so far, so the added latency stays a small
  fraction of the wait, never under a floor and never over `max_s`, so an
  idle rank costs almost no CPU and still notices a late peer soon;
* the floor starts at `min_s` and is multiplied by `growth` after each sleep
  (1, the default: a fixed floor; 2: the floor doubles with every fruitless
  try, for loops that count tries rather than time).

`reset()` on progress starts the tight phase again and puts the floor back.
`Backoff.every(s)` is the degenerate case, a fixed interval.

`poll_until` (blocking: threads, and start-up before any event loop runs) and
`wait_until` (on the event loop) are the two loops built on it. A Backoff
holds the state of one wait: each loop owns its own, never shared between
threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

__all__ = ["Backoff", "Deadline", "poll_until", "wait_until"]

Clock = Callable[[], float]


class Backoff:
    """How long a poll loop sleeps next, from how long it has made no progress."""

    __slots__ = ("min_s", "max_s", "share", "growth", "busy_s", "since", "_floor", "clock")

    def __init__(self, min_s: float, max_s: float | None = None, *, share: float = 0.0,
                 growth: float = 1.0, busy_s: float = 0.0, since: float | None = None,
                 clock: Clock = time.perf_counter) -> None:
        if min_s < 0 or (max_s is not None and max_s < min_s) or share < 0 or growth < 1:
            raise ValueError(f"Backoff(min_s={min_s}, max_s={max_s}, share={share}, "
                             f"growth={growth}): need 0 <= min_s <= max_s, share >= 0, growth >= 1")
        self.min_s = min_s
        self.max_s = min_s if max_s is None else max_s
        self.share = share  # past the tight phase, sleep this share of the time waited
        self.growth = growth  # the floor's factor after each sleep
        self.busy_s = busy_s  # the tight phase after each progress
        self.clock = clock
        self.since = clock() if since is None else since  # the last progress
        self._floor = min_s

    @classmethod
    def every(cls, interval_s: float, *, clock: Clock = time.perf_counter) -> Backoff:
        """A fixed interval (0: retest at once, or a bare yield on the loop)."""
        return cls(interval_s, interval_s, clock=clock)

    def reset(self, now: float | None = None) -> None:
        """Progress at `now` (default: the clock's now): tight again, floor back to `min_s`."""
        self.since = self.clock() if now is None else now
        self._floor = self.min_s

    def waited(self, now: float | None = None) -> float:
        """Seconds since the last progress."""
        return (self.clock() if now is None else now) - self.since

    def busy(self, now: float | None = None) -> bool:
        """Still in the tight phase."""
        return self.waited(now) < self.busy_s

    def next_sleep(self, now: float | None = None, *, tight: bool = True,
                   max_s: float | None = None) -> float:
        """The next pause in seconds; 0.0 in the tight phase (`tight=False` skips it).

        `max_s` replaces the usual cap for this one sleep. Past the tight phase
        each call counts as one fruitless try: the floor grows by `growth`.
        """
        waited = self.waited(now)
        if tight and waited < self.busy_s:
            return 0.0
        floor = self._floor
        if floor < self.max_s:
            self._floor = min(self.max_s, floor * self.growth)
        return min(self.max_s if max_s is None else max_s, max(floor, self.share * waited))


class Deadline:
    """A point in time after `timeout` seconds (None: never)."""

    __slots__ = ("at", "clock")

    def __init__(self, timeout: float | None, *, now: float | None = None,
                 clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        start = clock() if now is None else now
        self.at = None if timeout is None else start + timeout

    def passed(self, now: float | None = None) -> bool:
        return self.at is not None and (self.clock() if now is None else now) >= self.at

    def left(self, now: float | None = None) -> float | None:
        """Seconds left, at least 0 (None: no deadline)."""
        if self.at is None:
            return None
        return max(0.0, self.at - (self.clock() if now is None else now))


def poll_until(ready: Callable[[], bool], backoff: Backoff, timeout: float | None = None, *,
               sleep: Callable[[float], object] = time.sleep) -> bool:
    """Blocking: call `ready()` until it returns True, pausing between calls as
    `backoff` says (a pause of 0 retests at once). False once `timeout` passed.

    `ready()` is called first, so a wait that is already over never sleeps;
    the time comes from the backoff's clock.
    """
    clock = backoff.clock
    deadline = Deadline(timeout, clock=clock)
    while not ready():
        now = clock()
        if deadline.passed(now):
            return False
        pause = backoff.next_sleep(now)
        if pause > 0:
            sleep(pause)
    return True


async def wait_until(ready: Callable[[], bool], backoff: Backoff) -> None:
    """On the event loop: await until `ready()` returns True, sleeping as
    `backoff` says (0: a bare checkpoint). A deadline is the caller's cancel
    scope (`anyio.fail_after`)."""
    while not ready():
        await anyio.sleep(backoff.next_sleep())
