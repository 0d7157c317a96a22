"""Sleep on a word of shared memory until another process changes it.

The shared-memory gradient pipeline (`torch._grad.shm_pipeline`) and the
node window's allreduces (`transports.node_window`) wait for other ranks'
progress counters. Polling them costs a wake-up (and, on a busy core, a
cold cache) every few hundred microseconds; a Linux futex on a word in the
shared window costs nothing while it waits and wakes as soon as a peer
rings. The futex is process-shared (no FUTEX_PRIVATE_FLAG) because the
word lives in an MPI shared window that every rank maps. Elsewhere (no
Linux, no libc) `wait` degrades to a short sleep, so callers re-check their
condition either way: a wake-up is a hint, never a promise.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys
import time
from typing import Any

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYSCALL_NUMBERS = {"x86_64": 202, "aarch64": 98, "ppc64le": 221}
_FALLBACK_SLEEP_S = 200e-6


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load() -> tuple[ctypes.CDLL, int] | None:
    """libc's `syscall` and this machine's futex number, or None (no futex here)."""
    number = _SYSCALL_NUMBERS.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    return libc, number


_LIBC = _load()
available = _LIBC is not None


def wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the 32-bit word at `address` still holds `expected` (ctypes drops
    the GIL for the call), at most `timeout_s`; returns early on any wake."""
    if _LIBC is None:
        time.sleep(min(timeout_s, _FALLBACK_SLEEP_S))
        return
    libc, number = _LIBC
    secs = int(timeout_s)
    ts = _Timespec(secs, int((timeout_s - secs) * 1e9))
    libc.syscall(number, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_uint32(expected),
                 ctypes.byref(ts), None, 0)


def wake(address: int) -> None:
    """Wake every waiter on the word at `address`, in any process that maps it."""
    if _LIBC is None:
        return
    libc, number = _LIBC
    libc.syscall(number, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int(2**31 - 1),
                 None, None, 0)


def stamp(word: Any, writer: int, count: int) -> None:
    """Write a value nobody wrote before into the bell `word` (a one-element uint32
    array); the caller wakes its sleepers (`wake`). Several ranks may stamp one bell
    at once and a plain store is no atomic increment, so each value carries its writer
    (7 bits) and that writer's count (24 bits): whichever store lands last, the bell
    differs from what a sleeper read before it went to sleep."""
    word[0] = ((writer & 0x7F) << 24) | (count & 0xFFFFFF)
