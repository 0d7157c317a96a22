"""Helpers shared by the GPU tests, rank programs and benchmarks.

`gpu_sleep(ms)` keeps a stream busy for about `ms` milliseconds with
`torch.cuda._sleep` (a spin kernel), calibrated once per process, so that a
consumer that fails to wait for its producer reads stale data reliably.
"""

from __future__ import annotations

from typing import Any

import torch

_CYCLES_PER_MS: dict[int, float] = {}


def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond on the current device (measured once)."""
    dev = torch.cuda.current_device()
    if dev not in _CYCLES_PER_MS:
        torch.cuda._sleep(1000)  # warm-up: module load, clocks
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS[dev] = cycles / max(start.elapsed_time(end), 1e-3)
    return _CYCLES_PER_MS[dev]


def gpu_sleep(ms: float) -> None:
    """Occupy the current stream for about `ms` ms."""
    torch.cuda._sleep(max(1, int(cycles_per_ms() * ms)))


def late_fill(t: torch.Tensor, value: float, ms: float, stream: Any = None) -> None:
    """On `stream` (current if None): spin `ms`, then fill `t` — a slow producer."""
    with torch.cuda.stream(stream or torch.cuda.current_stream()):
        gpu_sleep(ms)
        t.fill_(value)
