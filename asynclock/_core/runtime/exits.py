"""How a rank ends: the exit statuses every rank agrees on, and a way out that
neither atexit handlers nor MPI_Finalize can hold up."""

from __future__ import annotations

import contextlib
import os
import sys

EXIT_UNCAUGHT = 1  # this rank raised
EXIT_RANK_FAILED = 3  # another rank failed, died or shut down under us
EXIT_STALL = 4  # an operation waited past ASYNCLOCK_STALL_ABORT_S
EXIT_INTERRUPTED = 130


def write_stderr(text: str) -> None:
    """Straight to fd 2, after flushing Python's buffers: survives `os._exit`."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os.write(2, text.encode(errors="replace"))


def hard_exit(code: int) -> None:
    """Leave now: no atexit handlers, no MPI_Finalize (it could hang)."""
    write_stderr("")
    os._exit(code)
