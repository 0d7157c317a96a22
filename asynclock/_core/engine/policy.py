"""The progress engine's knobs (see `engine.progress` for how they are used)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import settings


@dataclass(frozen=True, slots=True)
class ProgressPolicy:
    """Knobs of the progress engine (env: ASYNCLOCK_SPIN_US, _BUSY_US, _THREAD_MIN_BYTES)."""

    # 200 us: a 64 KiB allreduce at 2 ranks on one node finishes inside the spin, and
    # one caught by the spin completes far sooner than one left to the poller
    # (bench/collectives.py; figures on the benchmarks page).
    spin_s: float = 200e-6
    # Up to 1 ms when a channel's small ops typically take longer than `spin_s` but
    # finish within it (across hosts over TCP a 64 KiB allreduce outlasts `spin_s`).
    max_spin_s: float = 1e-3
    busy_s: float = 2e-3
    min_sleep_s: float = 1e-3
    max_sleep_s: float = 20e-3
    sleep_fraction: float = 0.05
    # While a synchronous caller's thread is blocked on the loop (Horovod-style
    # calls), no sleep is longer than this, Horovod's default cycle time: that
    # caller's latency is all its thread does, and a rank that noticed a
    # completion 20 ms after its peers would skew every timing measured across
    # ranks from it (a barrier after a long wait returns that much late).
    blocked_max_sleep_s: float = 1e-3
    thread_min_bytes: int = 1 << 20
    # A call some ranks issued and the others never did fails (UnmatchedError)
    # once every rank waits on such calls and each has waited this long.
    stray_s: float = 10.0

    @classmethod
    def from_env(cls) -> ProgressPolicy:
        return cls(spin_s=settings.number("ASYNCLOCK_SPIN_US") * 1e-6,
                   max_spin_s=settings.number("ASYNCLOCK_MAX_SPIN_US") * 1e-6,
                   busy_s=settings.number("ASYNCLOCK_BUSY_US") * 1e-6,
                   thread_min_bytes=int(settings.number("ASYNCLOCK_THREAD_MIN_BYTES")),
                   stray_s=settings.number("ASYNCLOCK_STRAY_S"))
