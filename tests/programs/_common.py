"""Helpers shared by rank programs: reporting, expected errors and backend selection."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any

import anyio


def report(rank: int, label: str, detail: str = "") -> None:
    """The line tests look for; flushed so a later crash cannot hide it."""
    sys.stdout.flush()
    os.write(1, (f"RANK {rank} OK {label} {detail}".rstrip() + "\n").encode())


def expect(kind: type[BaseException], text: str, call: Callable[[], object]) -> BaseException:
    """`call()` raises `kind` with `text` in its message; the error, for more checks."""
    try:
        call()
    except kind as exc:
        assert text in str(exc), f"{text!r} not in {exc}"
        return exc
    raise AssertionError(f"no {kind.__name__} ({text})")


async def expect_async(kind: type[BaseException], text: str,
                       call: Callable[[], Awaitable[object]]) -> BaseException:
    """`await call()` raises `kind` with `text` in its message; the error."""
    try:
        await call()
    except kind as exc:
        assert text in str(exc), f"{text!r} not in {exc}"
        return exc
    raise AssertionError(f"no {kind.__name__} ({text})")


def loop_backend() -> str:
    """`--trio` on the command line runs the program on trio."""
    return "trio" if "--trio" in sys.argv else "asyncio"


def run(main: Callable[[], Awaitable[Any]]) -> None:
    anyio.run(main, backend=loop_backend())


def run_or_abort(main: Callable[[], None]) -> None:
    """Run a plain mpi4py program's `main`; on any error print it and abort the job:
    peers waiting on this rank in shared memory would otherwise wait out its timeout."""
    from mpi4py import MPI

    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
