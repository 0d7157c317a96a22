"""A rank that froze prints its own stacks before its peers give up on it.

The peers declare a rank dead after `dead_after_s` without a heartbeat
(`watchdog`). When the rank is alive but frozen (a thread holds the GIL in
a long C call, a lock cycle, a blocking call inside MPI), the peers' report
names it, but nothing says where it was stuck, and a frozen interpreter
cannot say so itself. `faulthandler`'s timer runs in a C thread that needs
no GIL: the heartbeat thread re-arms it on every beat, so it fires only if
that thread made no progress for `seconds`, and then dumps every thread's
Python stack to stderr (headed `Timeout (0:00:08)!`) while the process is
still there to read. The timer is process-wide: `ASYNCLOCK_FROZEN_DUMP=0`
leaves it to a program that uses `faulthandler.dump_traceback_later`.
"""

from __future__ import annotations

import faulthandler

from . import settings


def enabled() -> bool:
    return settings.flag("ASYNCLOCK_FROZEN_DUMP")


def arm(seconds: float) -> None:
    """Dump every thread's stack unless re-armed (or disarmed) within `seconds`."""
    if seconds > 0 and enabled():
        faulthandler.dump_traceback_later(seconds, exit=False)


def disarm() -> None:
    if enabled():
        faulthandler.cancel_dump_traceback_later()
