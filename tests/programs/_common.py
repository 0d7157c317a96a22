"""Helpers shared by rank programs: reporting and backend selection."""

from __future__ import annotations

import os
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import anyio


def report(rank: int, label: str, detail: str = "") -> None:
    """The line tests look for; flushed so a later crash cannot hide it."""
    sys.stdout.flush()
    os.write(1, (f"RANK {rank} OK {label} {detail}".rstrip() + "\n").encode())


def loop_backend() -> str:
    """`--trio` on the command line runs the program on trio."""
    return "trio" if "--trio" in sys.argv else "asyncio"


def run(main: Callable[[], Awaitable[Any]]) -> None:
    anyio.run(main, backend=loop_backend())
