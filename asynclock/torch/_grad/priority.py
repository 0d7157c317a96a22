"""Priority as an agreed launch order (ByteScheduler / P3 without negotiation).

Backward produces the last layers' gradients first, but the next forward
needs the first layers first. With MPI every rank must launch collectives in
the same order, so "pick the most urgent ready bucket now" cannot be a local
decision. Instead rank 0 replays its observed timeline once: a simulated
link serves, whenever it is free, the most urgent bucket that is ready by
then. The resulting order is broadcast and followed by every rank; if a
rank is late with an urgent bucket, it simply waits for it (never a
different choice), so ranks cannot diverge.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def priority_launch(ready_s: Sequence[float], nbytes: Sequence[int], *,
                    seconds_per_byte: float, latency_s: float = 1e-4) -> tuple[int, ...]:
    """Launch order of buckets laid out in gradient-ready order.

    Urgency grows with the bucket index: a later-ready bucket holds layers
    nearer the input, which the next forward pass needs first.
    """
    n = len(ready_s)
    by_time = sorted(range(n), key=lambda k: (ready_s[k], k))
    candidates: list[int] = []
    out: list[int] = []
    t, j = 0.0, 0
    while len(out) < n:
        while j < n and ready_s[by_time[j]] <= t:
            heapq.heappush(candidates, -by_time[j])
            j += 1
        if not candidates:
            t = ready_s[by_time[j]]
            continue
        k = -heapq.heappop(candidates)
        out.append(k)
        t += latency_s + nbytes[k] * seconds_per_byte
    return tuple(out)


def busy_seconds(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: how long the link was busy."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def link_speed(intervals: Sequence[tuple[float, float]], nbytes: int,
               optimism: float = 0.8) -> float:
    """Seconds per byte observed, shaded optimistic so the plan reorders only
    where the link really was the bottleneck."""
    busy = busy_seconds(intervals)
    return optimism * busy / nbytes if nbytes > 0 and busy > 0 else 0.0
