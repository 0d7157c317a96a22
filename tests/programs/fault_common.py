"""Helpers shared by the fault-injection rank programs (tests/test_faults.py)."""

from __future__ import annotations

import os
import sys

from _common import report


def arg(name: str, default: str) -> str:
    """`--name value` from the command line, else `default`."""
    if name in sys.argv:
        return sys.argv[sys.argv.index(name) + 1]
    return default


def announce_pid(rank: int) -> None:
    """Tests check afterwards that no rank process outlived the job."""
    report(rank, "pid", str(os.getpid()))
