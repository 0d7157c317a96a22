"""The progress engine's knobs (see `engine.progress` for how they are used)."""

from __future__ import annotations

from dataclasses import dataclass

from ..base import settings


@dataclass(frozen=True, slots=True)
class ProgressPolicy:
    """Knobs of the progress engine (env: ASYNCLOCK_SPIN_US, _BUSY_US, _THREAD_MIN_BYTES).

    Pass one to `init(policy=)` or `start(policy=)`; `from_env()` is the default.

    Attributes:
        spin_s: seconds a caller spins on a small collective right after issuing it,
            before the poller takes it over.
        max_spin_s: ceiling of the spin the engine adapts per lane from the latencies
            it sees.
        busy_s: seconds the poller keeps testing with bare yields after the last
            progress, before it sleeps.
        min_sleep_s: the poller's shortest sleep past the busy phase.
        max_sleep_s: the poller's longest sleep.
        sleep_fraction: past the busy phase the poller sleeps this share of the time
            already waited (between `min_sleep_s` and `max_sleep_s`).
        blocked_max_sleep_s: the longest sleep while a synchronous (Horovod-style)
            caller's thread is blocked on the loop.
        thread_min_bytes: data stages of at least this many bytes are waited for in
            the lane's wait thread, on the bulk communicator.
        stray_s: seconds a call may wait to be matched by name before the rank
            reports it cannot proceed (UnmatchedError once every rank is stuck).
    """

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

    def waits_in_thread(self, nbytes: int, loop_band: tuple[int, int] = (0, 0)) -> bool:
        """Whether a data stage goes to the lane's wait thread.

        Args:
            nbytes: the stage's size in bytes.
            loop_band: [lo, hi) sizes its channel keeps on the loop however large
                (`Channel.loop_band`); (0, 0): none.

        Returns:
            True from `thread_min_bytes` on, outside `loop_band`.
        """
        return nbytes >= self.thread_min_bytes and not loop_band[0] <= nbytes < loop_band[1]

    @classmethod
    def from_env(cls) -> ProgressPolicy:
        """The defaults, with the `ASYNCLOCK_*` variables of the environment applied.

        Returns:
            A policy with ASYNCLOCK_SPIN_US, _MAX_SPIN_US, _BUSY_US, _THREAD_MIN_BYTES
            and _STRAY_S read.
        """
        return cls(spin_s=settings.number("ASYNCLOCK_SPIN_US") * 1e-6,
                   max_spin_s=settings.number("ASYNCLOCK_MAX_SPIN_US") * 1e-6,
                   busy_s=settings.number("ASYNCLOCK_BUSY_US") * 1e-6,
                   thread_min_bytes=int(settings.number("ASYNCLOCK_THREAD_MIN_BYTES")),
                   stray_s=settings.number("ASYNCLOCK_STRAY_S"))
