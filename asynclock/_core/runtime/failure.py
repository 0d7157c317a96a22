"""What the whole job does when one rank fails.

MPI cannot survive the loss of a rank: the other ranks block forever in the
next collective, and even a rank that exits normally can hang in
MPI_Finalize (Open MPI fences every rank there). So by default an exception
that escapes `async with asynclock.start()` (or reaches the top of a
synchronous program after `asynclock.init()`) stops every rank:

1. the failing rank prints its traceback once, every line tagged with its
   rank, so interleaved output from many ranks stays readable;
2. its watchdog tells every peer at once (`Watchdog.announce_failure`); each
   peer prints one line naming the failed rank and what it was waiting in,
   fails its in-flight operations with `RankFailedError` and exits non-zero
   after a short grace;
3. the failing rank leaves with `os._exit`, skipping MPI_Finalize.

Why `os._exit` rather than MPI_Abort: MPI_Abort goes through the launcher
and can block when a peer is unreachable (the case we most need to handle),
it prints launcher-specific noise, and it kills the others at once, without
the grace in which they say what they were waiting for. Every rank exiting
non-zero on its own works with any launcher, and launchers that clean up
(hydra, Open MPI's mpirun) then only speed it up.

`sys.exit(n)` with n != 0 stops every rank too, quietly: no traceback, and
every rank exits with n (`_deliberate_exit`).

`ASYNCLOCK_ON_ERROR=raise` turns this off (the exception propagates as in a
single process); world size 1 never needs it.

In an elastic job (`ASYNCLOCK_ON_ERROR=reform`, the default under Horovod's
elastic launcher) the failing rank still leaves this way, but its peers do not
follow it: they re-form a world without it (`runtime.elastic`).
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ..base import settings
from .exits import EXIT_INTERRUPTED, EXIT_UNCAUGHT, hard_exit, write_stderr

if TYPE_CHECKING:
    from .watchdog import Watchdog

# The live coordinator's (rank, size, watchdog), or None: registered by the coordinator,
# which imports this module (`install_excepthook`).
LiveRank = Callable[[], "tuple[int, int, Watchdog | None] | None"]


_hook_lock = threading.Lock()
_previous_hook: Any = None
_world: tuple[int, int] | None = None  # (rank, size) of the last coordinator
_pid = os.getpid()  # a forked child (e.g. a data-loader worker) is not the rank
_live: LiveRank | None = None
# `horovodrun --min-np/--max-np` (or --host-discovery-script) sets it for every worker
ELASTIC_LAUNCHER_ENV = "HOROVOD_ELASTIC"


def policy() -> str:
    """`abort` (one failing rank stops the job), `raise`, or `reform` (a lost rank
    ends the world, not the job: `runtime.elastic`). `auto` is `reform` where
    Horovod's elastic launcher started the rank, else `abort`."""
    value = settings.text("ASYNCLOCK_ON_ERROR")
    if value == "auto":
        return "reform" if os.environ.get(ELASTIC_LAUNCHER_ENV) == "1" else "abort"
    return value


def is_failure(exc: BaseException) -> bool:
    """Clean exits and cancellation from an enclosing scope are not failures."""
    if isinstance(exc, SystemExit):
        return exc.code not in (None, 0)
    if isinstance(exc, GeneratorExit):
        return False
    return not _is_cancellation(exc)


def _is_cancellation(exc: BaseException) -> bool:
    import asyncio

    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


def exit_code(exc: BaseException) -> int:
    if isinstance(exc, SystemExit) and isinstance(exc.code, int):
        return exc.code
    return EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else EXIT_UNCAUGHT


def tagged(rank: int, text: str) -> str:
    """Prefix every line with `[rank r]`."""
    return "".join(f"[rank {rank}] {line}\n" for line in text.rstrip("\n").splitlines())


def traceback_text(rank: int, size: int, exc: BaseException) -> str:
    ending = ("leaving the job; the others re-form without it" if policy() == "reform"
              else f"stopping all {size} ranks")
    head = f"asynclock[rank {rank}]: uncaught {type(exc).__name__}; {ending}\n"
    return head + tagged(rank, "".join(traceback.format_exception(exc)))


def summary(exc: BaseException) -> str:
    """One line for the peers: type and the first line of the message."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    return text[:300]


def on_uncaught(rank: int, size: int, watchdog: Watchdog | None, exc: BaseException) -> None:
    """Apply the policy to `exc` escaping this rank's asynclock scope.

    Returns only when the exception should simply propagate.
    """
    if size <= 1 or not is_failure(exc) or policy() == "raise":
        return
    if isinstance(exc, SystemExit):
        _deliberate_exit(rank, watchdog, exc)
    if watchdog is not None and watchdog.stopping is not None:
        hard_exit(watchdog.exit_code)  # a consequence of a failure already reported
    write_stderr(traceback_text(rank, size, exc))
    if watchdog is not None:
        watchdog.announce_failure(summary(exc))
    hard_exit(exit_code(exc))


def _deliberate_exit(rank: int, watchdog: Watchdog | None, exc: SystemExit) -> None:
    """`sys.exit(n)`, n != 0: the job ends with status n, with no traceback, as a
    single Python process does (a non-integer code is printed and gives 1).

    Still a stop of the whole job: the peers cannot finish without this rank,
    and a rank that sat in MPI_Finalize while they wait would hang (hydra) or
    take the runner down (Open MPI). So the peers hear it at once and exit
    with the same status; this rank leaves with `os._exit`, like a failed one.
    """
    code = exc.code if isinstance(exc.code, int) else EXIT_UNCAUGHT
    if not isinstance(exc.code, int):
        write_stderr(f"{exc.code}\n")
    if watchdog is not None and watchdog.stopping is None:
        watchdog.announce_exit(code)
    hard_exit(code)


def install_excepthook(rank: int, size: int, live: LiveRank) -> None:
    """Chain `sys.excepthook` once, for synchronous (Horovod-style) programs.

    The world is remembered: a program that shut asynclock down in a
    `finally` and then dies must still not reach MPI_Finalize while its
    peers wait for it.
    """
    global _previous_hook, _world, _pid, _live
    with _hook_lock:
        _world, _pid, _live = (rank, size), os.getpid(), live
        if _previous_hook is None:
            _previous_hook = sys.excepthook
            sys.excepthook = _excepthook


def _excepthook(tp: type[BaseException], value: BaseException,
                tb: TracebackType | None) -> None:
    live = _live() if _live is not None else None
    if os.getpid() == _pid and live is not None:
        on_uncaught(*live, value)
    elif os.getpid() == _pid and _world is not None:
        on_uncaught(*_world, None, value)
    _previous_hook(tp, value, tb)
