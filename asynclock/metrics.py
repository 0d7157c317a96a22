"""Per-step metrics: how much communication a step could not hide behind compute.

    rec = metrics.recorder()
    for batch in metrics.progress(loader, coord):     # one step per item; bar on rank 0
        with rec.compute("forward"): loss = model(batch)
        with rec.comm("allreduce", nbytes=n): await coord.allreduce_(grad)
    rec.last  # StepMetrics(step_time_s=..., exposed_comm_s=..., overlap_pct=...)

Why intervals and not counters: "exposed communication" is the time spent
communicating while nothing computes, i.e. |comm − compute| over the step's
interval union. Summed durations double-count overlapping buckets and cannot
tell hidden from exposed time. The same interval math reads a merged
timeline (`from_trace`), so the plot and the live numbers agree. Feeding the
recorder also records timeline slices when the timeline is on.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

from . import timeline

T = TypeVar("T")
Interval = tuple[float, float]
COMPUTE_CATS = frozenset({"compute", "optimizer"})
COMM_CATS = frozenset({"comm"})
SYNC_CATS = frozenset({"sync"})


# -- interval arithmetic ---------------------------------------------------------
def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    merged: list[Interval] = []
    for lo, hi in sorted(i for i in intervals if i[1] > i[0]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def total(intervals: Iterable[Interval]) -> float:
    return sum(hi - lo for lo, hi in union(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Where both cover the time (inputs need not be disjoint)."""
    ua, ub = union(a), union(b)
    out: list[Interval] = []
    i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        if lo < hi:
            out.append((lo, hi))
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return out


def difference(a: Iterable[Interval], b: Iterable[Interval]) -> list[Interval]:
    """Where `a` covers the time and `b` does not (e.g. exposed communication)."""
    out: list[Interval] = []
    cut = union(b)
    for lo, hi in union(a):
        for blo, bhi in cut:
            if bhi <= lo or blo >= hi:
                continue
            if blo > lo:
                out.append((lo, blo))
            lo = max(lo, bhi)
        if lo < hi:
            out.append((lo, hi))
    return out


def clip(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


# -- one step's numbers ------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One step on one rank (seconds; fractions of the step time)."""

    step: int
    step_time_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    overlap_pct: float  # share of communication hidden behind compute; 0 without any
    exposed_fraction: float  # exposed_comm_s / step_time_s
    bytes_reduced: int = 0
    max_buckets_in_flight: int = 0
    lock_wait_s: float = 0.0

    def postfix(self) -> dict[str, str]:
        """Short fields for a tqdm bar."""
        return {"step": f"{self.step_time_s * 1e3:.0f}ms",
                "exposed": f"{100 * self.exposed_fraction:.0f}%",
                "overlap": f"{self.overlap_pct:.0f}%",
                "MB": f"{self.bytes_reduced / 2**20:.1f}",
                "inflight": str(self.max_buckets_in_flight),
                "lock": f"{self.lock_wait_s * 1e3:.1f}ms"}


def measure(step: int, lo: float, hi: float, compute: Iterable[Interval],
            comm: Iterable[Interval], *, unit: float = 1.0, bytes_reduced: int = 0,
            max_buckets_in_flight: int = 0, lock_wait_s: float = 0.0) -> StepMetrics:
    """StepMetrics of the window [lo, hi] (times in any unit; seconds = time * `unit`)."""
    cpu, net = union(clip(compute, lo, hi)), union(clip(comm, lo, hi))
    comm_s, hidden = total(net), total(intersection(cpu, net))
    step_time = hi - lo
    return StepMetrics(step, step_time * unit, total(cpu) * unit, comm_s * unit,
                       (comm_s - hidden) * unit,
                       100.0 * hidden / comm_s if comm_s > 0 else 0.0,
                       (comm_s - hidden) / step_time if step_time > 0 else 0.0,
                       bytes_reduced, max_buckets_in_flight, lock_wait_s)


# -- the live recorder --------------------------------------------------------------
@dataclass
class _Step:
    number: int = 0
    start: float | None = None
    compute: list[Interval] = field(default_factory=list)
    comm: list[Interval] = field(default_factory=list)
    nbytes: int = 0
    max_in_flight: int = 0
    lock_wait_s: float = 0.0


class StepRecorder:
    """Collects one rank's intervals and counters. Thread-safe: backward runs in a
    worker thread while buckets complete on the loop. Times are perf_counter seconds."""

    def __init__(self, keep: int = 1000) -> None:
        self._lock = threading.Lock()
        self._cur = _Step()
        self._in_flight = 0
        self.history: deque[StepMetrics] = deque(maxlen=keep)

    @property
    def last(self) -> StepMetrics | None:
        return self.history[-1] if self.history else None

    # -- explicit feeding ---------------------------------------------------------
    def begin_step(self, t: float | None = None) -> int:
        with self._lock:
            cur = self._cur
            cur.start = time.perf_counter() if t is None else t
            cur.max_in_flight = self._in_flight
            return cur.number

    def end_step(self, t: float | None = None) -> StepMetrics:
        """Close the step: its metrics; work still running carries into the next."""
        end = time.perf_counter() if t is None else t
        with self._lock:
            cur = self._cur
            start = end if cur.start is None else cur.start
            m = measure(cur.number, start, end, cur.compute, cur.comm,
                        bytes_reduced=cur.nbytes, max_buckets_in_flight=cur.max_in_flight,
                        lock_wait_s=cur.lock_wait_s)
            self._cur = _Step(cur.number + 1, None, clip(cur.compute, end, float("inf")),
                              clip(cur.comm, end, float("inf")))
            self.history.append(m)
        tl = timeline.active()
        if tl is not None:
            tl.complete(f"step {m.step}", "step", start, end, asdict(m))
        return m

    def add_compute(self, start: float, end: float) -> None:
        with self._lock:
            self._cur.compute.append((start, end))

    def add_comm(self, start: float, end: float, nbytes: int = 0) -> None:
        with self._lock:
            self._cur.comm.append((start, end))
            self._cur.nbytes += nbytes

    def add_lock_wait(self, seconds: float) -> None:
        with self._lock:
            self._cur.lock_wait_s += seconds

    def comm_started(self) -> None:
        """A bucket went on the wire (tracks the step's most buckets in flight)."""
        with self._lock:
            self._in_flight += 1
            self._cur.max_in_flight = max(self._cur.max_in_flight, self._in_flight)

    def comm_finished(self) -> None:
        with self._lock:
            self._in_flight -= 1

    # -- context managers (also timeline slices) ------------------------------------
    @contextmanager
    def compute(self, name: str = "compute", cat: str = "compute") -> Iterator[None]:
        start = time.perf_counter()
        try:
            with timeline.span(name, cat):
                yield
        finally:
            self.add_compute(start, time.perf_counter())

    @contextmanager
    def comm(self, name: str = "allreduce", nbytes: int = 0) -> Iterator[None]:
        """A communication that may overlap others (async slice on the timeline)."""
        start = time.perf_counter()
        self.comm_started()
        try:
            with timeline.async_span(name, "comm", bytes=nbytes):
                yield
        finally:
            self.comm_finished()
            self.add_comm(start, time.perf_counter(), nbytes)

    @contextmanager
    def lock_wait(self, name: str = "lock wait") -> Iterator[None]:
        start = time.perf_counter()
        try:
            with timeline.async_span(name, "sync"):
                yield
        finally:
            self.add_lock_wait(time.perf_counter() - start)

    @contextmanager
    def step(self) -> Iterator[None]:
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    def summary(self) -> dict[str, float]:
        """Medians over the kept steps (empty when none)."""
        if not self.history:
            return {}
        keys = [k for k in asdict(self.history[0]) if k != "step"]
        return {k: float(statistics.median(getattr(m, k) for m in self.history)) for k in keys}


_default = StepRecorder()


def recorder() -> StepRecorder:
    """The process-wide recorder that `progress` and the integrations feed."""
    return _default


# -- a rank-0 progress bar ------------------------------------------------------------
def _rank_of(coord: Any) -> int:
    if coord is not None:
        return int(coord.rank)
    from ._core.runtime import coordinator as runtime
    from ._tools.rank_output import env_rank

    return runtime.coordinator().rank if runtime.is_initialized() else env_rank() or 0


def _bar(iterable: Iterable[T], kwargs: dict[str, Any]) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError:  # metrics still recorded; just no bar
        return None
    return tqdm(iterable, **kwargs)


def progress(iterable: Iterable[T], coord: Any = None, *, recorder: StepRecorder | None = None,
             steps: bool = True, **tqdm_kwargs: Any) -> Iterator[T]:
    """Iterate; each item is one recorder step (`steps=True`). Rank 0 shows a tqdm bar
    whose postfix is the last step's metrics; other ranks iterate silently."""
    rec = recorder if recorder is not None else _default
    bar = _bar(iterable, tqdm_kwargs) if _rank_of(coord) == 0 else None
    try:
        for item in iterable if bar is None else bar:
            if steps:
                rec.begin_step()
            yield item
            if steps:
                rec.end_step()
            if bar is not None and rec.last is not None:
                bar.set_postfix(rec.last.postfix(), refresh=False)
    finally:
        if bar is not None:
            bar.close()


# -- reading a merged timeline ---------------------------------------------------------
@dataclass
class RankTracks:
    """One rank's intervals from a trace (µs) by role, plus its step slices."""

    compute: list[Interval] = field(default_factory=list)
    comm: list[Interval] = field(default_factory=list)
    sync: list[Interval] = field(default_factory=list)
    steps: list[tuple[float, float, dict[str, Any]]] = field(default_factory=list)

    def add(self, cat: str, lo: float, hi: float, args: dict[str, Any]) -> None:
        if cat == "step":
            self.steps.append((lo, hi, args))
        for cats, bucket in ((COMPUTE_CATS, self.compute), (COMM_CATS, self.comm),
                             (SYNC_CATS, self.sync)):
            if cat in cats:
                bucket.append((lo, hi))

    def window(self) -> tuple[float, float]:
        stamps = [t for iv in (self.compute, self.comm, self.sync) for i in iv for t in i]
        return (min(stamps), max(stamps)) if stamps else (0.0, 0.0)


def tracks(events: Iterable[dict[str, Any]]) -> dict[int, RankTracks]:
    """Per-rank intervals: "X" slices and matched async b/e pairs, by category."""
    out: dict[int, RankTracks] = defaultdict(RankTracks)
    opened: dict[tuple[int, str], dict[str, Any]] = {}
    for e in events:
        ph, pid = e.get("ph"), int(e.get("pid", 0))
        if ph == "X":
            out[pid].add(e.get("cat", ""), e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}))
        elif ph in ("b", "e"):
            key = (pid, str(e.get("id2", e.get("id"))))
            if ph == "b":
                opened[key] = e
            elif (b := opened.pop(key, None)) is not None:
                out[pid].add(b.get("cat", ""), b["ts"], e["ts"], b.get("args", {}))
    return dict(sorted(out.items()))


def from_trace(events: Iterable[dict[str, Any]]) -> dict[int, list[StepMetrics]]:
    """StepMetrics per rank and step slice (one whole-run "step" when none were
    recorded); seconds, from a trace's µs."""
    result: dict[int, list[StepMetrics]] = {}
    for rank, tr in tracks(events).items():
        steps = sorted(tr.steps) or [(*tr.window(), {})]
        result[rank] = [_trace_step(i, tr, lo, hi, args) for i, (lo, hi, args) in enumerate(steps)]
    return result


def _trace_step(i: int, tr: RankTracks, lo: float, hi: float,
                args: dict[str, Any]) -> StepMetrics:
    return measure(int(args.get("step", i)), lo, hi, tr.compute, tr.comm, unit=1e-6,
                   bytes_reduced=int(args.get("bytes_reduced", 0)),
                   max_buckets_in_flight=int(args.get("max_buckets_in_flight", 0)),
                   lock_wait_s=total(clip(tr.sync, lo, hi)) * 1e-6)
