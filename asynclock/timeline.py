"""A per-rank Chrome-trace timeline that stays readable when a job is killed.

Switch it on with `ASYNCLOCK_TIMELINE=/path/prefix` (or `timeline.start(prefix)`,
or `asynclock-launch --timeline prefix`), then record from anywhere:

    with timeline.span("forward", cat="compute", batch=i): ...
    handle = timeline.begin("allreduce", cat="comm", bucket=3) ... timeline.end(handle)
    timeline.instant("checkpoint"); timeline.counter("in_flight", buckets=2)
    timeline.attach(coord.lowlevel.engine)   # every collective as an async span

Why this format: Horovod writes one JSON array from rank 0 and a killed run
leaves it unparseable. Here every rank appends each event as one JSON line
with a single `os.write` (no user-space buffer), so after SIGKILL a file holds
every event recorded so far and at most one torn line. `merge` (run by the
launcher, by rank 0 in `finish`, or by hand: `python -m asynclock.timeline
merge prefix`) skips torn lines, closes async spans a dead rank left open,
moves slices that overlap without nesting onto a sibling thread (Perfetto
drops those), and writes one file atomically: one process per rank, one
thread per category ("compute", "comm", "sync", ...).

Hooks for the engine and the torch integration: `attach(engine)` sets
`Engine.on_event` (progress.py calls it at op issue, data-stage issue and
completion; None costs one attribute test), so the coordinator should call
`timeline.attach(self.engine)` when `timeline.enabled()`. Gradient code
records `span("forward"|"backward", cat="compute")`, `span("pack"|"unpack",
cat="comm", bucket=i)`, `span("step", cat="optimizer")`, and lock waits as
`async_span(name, cat="sync")`; `metrics.StepRecorder` does both the metrics
and these slices.

Clock: each rank reads `time.time_ns()` once and then advances with
`perf_counter`, so ranks on one host align exactly, ranks on different
hosts to NTP accuracy, and no wall-clock step can reorder a rank's events.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Any

from ._core.base import settings

# The file side of the timeline, re-exported so `timeline.merge(...)` works.
from ._tools.timeline_merge import MergeResult as MergeResult
from ._tools.timeline_merge import merge as merge
from ._tools.timeline_merge import merged_path as merged_path
from ._tools.timeline_merge import rank_files as rank_files
from ._tools.timeline_merge import rank_path as rank_path
from ._tools.timeline_merge import read_rank_file as read_rank_file
from ._tools.timeline_merge import remove_rank_files as remove_rank_files

ENV = "ASYNCLOCK_TIMELINE"
# Fixed thread ids, so every rank lists its categories in the same order.
CATEGORY_TIDS = {"step": 1, "compute": 2, "optimizer": 3, "comm": 4, "sync": 5, "data": 6}
Event = dict[str, Any]
_NULL: AbstractContextManager[None] = nullcontext()
# Built once: json.dumps(..., separators=...) constructs an encoder on every call.
_encode = json.JSONEncoder(separators=(",", ":"), default=str).encode


class Clock:
    """Epoch microseconds that never jump: one wall-clock read, then perf_counter."""

    __slots__ = ("perf", "wall_us")

    def __init__(self) -> None:
        self.perf = time.perf_counter()
        self.wall_us = time.time_ns() / 1e3

    def us(self, perf: float | None = None) -> float:
        """Epoch µs of a perf_counter reading (default: now)."""
        t = time.perf_counter() if perf is None else perf
        return round(self.wall_us + (t - self.perf) * 1e6, 3)


class Timeline:
    """One rank's event file; every method is thread-safe and never buffers."""

    def __init__(self, prefix: str | os.PathLike[str], rank: int = 0,
                 size: int | None = None) -> None:
        self.prefix, self.rank = str(prefix), rank
        self.path = rank_path(prefix, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = Clock()
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}
        self._open: dict[int, tuple[str, str, int]] = {}
        self._ids = itertools.count(1)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        self._fd: int | None = os.open(self.path, flags, 0o644)
        self._meta("process_name", 0, name=f"rank {rank}", size=size,
                   host=socket.gethostname(), os_pid=os.getpid())
        self._meta("process_sort_index", 0, sort_index=rank)

    def _meta(self, kind: str, tid: int, **args: Any) -> None:
        self.emit({"name": kind, "ph": "M", "tid": tid, "args": args})

    def emit(self, event: Event) -> None:
        """Append one event as one line with one write (atomic for a kill)."""
        event["pid"] = self.rank
        line = (_encode(event) + "\n").encode()
        with self._lock:
            if self._fd is not None:
                os.write(self._fd, line)

    def tid(self, cat: str) -> int:
        """The thread id of a category; named in the file on first use."""
        tid = self._tids.get(cat)
        if tid is None:
            tid = CATEGORY_TIDS.get(cat, 100 + len(self._tids))
            self._tids[cat] = tid
            self._meta("thread_name", tid, name=cat)
            self._meta("thread_sort_index", tid, sort_index=tid)
        return tid

    # -- events ------------------------------------------------------------------
    def complete(self, name: str, cat: str, start: float, end: float,
                 args: dict[str, Any] | None = None) -> None:
        """A finished slice from two perf_counter readings ("X" event)."""
        self.emit({"name": name, "cat": cat, "ph": "X", "ts": self.clock.us(start),
                   "dur": round((end - start) * 1e6, 3), "tid": self.tid(cat), "args": args or {}})

    def instant(self, name: str, cat: str = "compute", args: dict[str, Any] | None = None,
                t: float | None = None) -> None:
        self.emit({"name": name, "cat": cat, "ph": "i", "s": "t", "ts": self.clock.us(t),
                   "tid": self.tid(cat), "args": args or {}})

    def counter(self, name: str, values: dict[str, float], t: float | None = None) -> None:
        self.emit({"name": name, "ph": "C", "ts": self.clock.us(t), "tid": 0, "args": values})

    def begin(self, name: str, cat: str = "comm", args: dict[str, Any] | None = None,
              t: float | None = None) -> int:
        """Open an async slice (may overlap others); returns the handle for `end`."""
        handle = next(self._ids)
        tid = self.tid(cat)
        self._open[handle] = (name, cat, tid)
        self._async("b", handle, name, cat, tid, args, t)
        return handle

    def mark(self, handle: int, name: str, args: dict[str, Any] | None = None,
             t: float | None = None) -> None:
        """An instant inside an open async slice (e.g. "data stage issued")."""
        opened = self._open.get(handle)
        if opened is not None:
            self._async("n", handle, name, opened[1], opened[2], args, t)

    def end(self, handle: int, args: dict[str, Any] | None = None, t: float | None = None) -> None:
        opened = self._open.pop(handle, None)
        if opened is not None:
            self._async("e", handle, opened[0], opened[1], opened[2], args, t)

    def _async(self, ph: str, handle: int, name: str, cat: str, tid: int,
               args: dict[str, Any] | None, t: float | None) -> None:
        # id2.local: Perfetto then shows the slice under this rank, not globally.
        self.emit({"name": name, "cat": cat, "ph": ph, "ts": self.clock.us(t), "tid": tid,
                   "id2": {"local": hex(handle)}, "args": args or {}})

    def close(self) -> None:
        """Flush to disk and stop writing (later events are dropped silently)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.fsync(fd)
            os.close(fd)

    @property
    def closed(self) -> bool:
        return self._fd is None


class _Span:
    """`with span(...)`: a class, not a generator, to keep the per-span cost low."""

    __slots__ = ("tl", "name", "cat", "args", "start")

    def __init__(self, tl: Timeline, name: str, cat: str, args: dict[str, Any]) -> None:
        self.tl, self.name, self.cat, self.args = tl, name, cat, args
        self.start = 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is not None:
            self.args["error"] = kind.__name__
        self.tl.complete(self.name, self.cat, self.start, time.perf_counter(), self.args)


class _AsyncSpan(_Span):
    """`with async_span(...)`: an async slice, for work that overlaps on one thread."""

    __slots__ = ("handle",)

    def __enter__(self) -> None:
        self.handle = self.tl.begin(self.name, self.cat, self.args)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.tl.end(self.handle, {"error": kind.__name__} if kind is not None else None)


# -- the process-wide switch ----------------------------------------------------
_active: Timeline | None = None
_resolved = False
_switch = threading.Lock()


def start(prefix: str | os.PathLike[str] | None = None, *, rank: int | None = None,
          size: int | None = None) -> Timeline:
    """Record this rank's events under `prefix` (default: $ASYNCLOCK_TIMELINE)."""
    global _resolved
    prefix = prefix if prefix is not None else settings.text(ENV)
    if not prefix:
        raise ValueError(f"timeline.start() needs a path prefix (or set {ENV})")
    with _switch:
        _resolved = True
        return _open(prefix, rank, size)


def _open(prefix: str | os.PathLike[str], rank: int | None, size: int | None) -> Timeline:
    """Replace the active timeline (caller holds `_switch`)."""
    global _active
    if _active is None:
        atexit.register(stop)  # stop() unregisters, so this never piles up
    else:
        _active.close()
    _active = Timeline(prefix, _detect_rank() if rank is None else rank,
                       _detect_size() if size is None else size)
    return _active


def stop() -> Timeline | None:
    """Close the active timeline (idempotent); returns it, so callers can merge."""
    global _active, _resolved
    with _switch:
        tl, _active, _resolved = _active, None, True
    if tl is not None:
        atexit.unregister(stop)
        tl.close()
    return tl


def _forget_in_child() -> None:
    """A forked child (e.g. a DataLoader worker) must not write as its parent's rank."""
    global _active, _resolved
    _active, _resolved = None, True


os.register_at_fork(after_in_child=_forget_in_child)


def active() -> Timeline | None:
    """The recording timeline; the first call starts one if $ASYNCLOCK_TIMELINE is set."""
    if not _resolved:
        _start_from_env()
    return _active


def enabled() -> bool:
    return active() is not None


def _start_from_env() -> None:
    """Once per process, under the lock: two threads must not both open (and truncate)."""
    global _resolved
    with _switch:
        if not _resolved:
            prefix = settings.text(ENV)
            if prefix:
                _open(prefix, None, None)
            _resolved = True


def _coordinator_attr(name: str) -> int | None:
    from ._core.runtime import coordinator as runtime

    return int(getattr(runtime.coordinator(), name)) if runtime.is_initialized() else None


def _detect_rank() -> int:
    """The coordinator's rank, else the launcher's environment, else 0."""
    from ._tools.rank_output import env_rank

    found = _coordinator_attr("rank")
    return found if found is not None else env_rank() or 0


def _detect_size() -> int | None:
    from ._tools.rank_output import env_size

    found = _coordinator_attr("size")
    return found if found is not None else env_size()


def span(name: str, cat: str = "compute", **args: Any) -> AbstractContextManager[None]:
    """Time a block on this thread as one slice; a shared no-op when off."""
    tl = active()
    return _NULL if tl is None else _Span(tl, name, cat, args)


def async_span(name: str, cat: str = "comm", **args: Any) -> AbstractContextManager[None]:
    """Like `span`, but an async slice: safe for tasks that interleave on one loop."""
    tl = active()
    return _NULL if tl is None else _AsyncSpan(tl, name, cat, args)


def instant(name: str, cat: str = "compute", **args: Any) -> None:
    tl = active()
    if tl is not None:
        tl.instant(name, cat, args)


def counter(name: str, **values: float) -> None:
    tl = active()
    if tl is not None:
        tl.counter(name, values)


def begin(name: str, cat: str = "comm", **args: Any) -> int:
    """Open an async slice; 0 (ignored by `end`) when the timeline is off."""
    tl = active()
    return 0 if tl is None else tl.begin(name, cat, args)


def end(handle: int, **args: Any) -> None:
    tl = active()
    if tl is not None and handle:
        tl.end(handle, args)


# -- the progress engine's hook -------------------------------------------------
class EngineObserver:
    """`Engine.on_event`: each collective becomes an async slice (issue → done)."""

    def __init__(self, tl: Timeline) -> None:
        self.tl = tl
        self.handles: dict[int, int] = {}

    def __call__(self, what: str, op: Any, t: float) -> None:
        try:  # the engine must never fail because of tracing
            self._record(what, op, t)
        except Exception:
            self.handles.pop(id(op), None)

    def _record(self, what: str, op: Any, t: float) -> None:
        if what == "issue":
            lane = getattr(op.lane.transport, "name", None) or "raw"
            name = getattr(op, "what", None) or op.call.kind.name.lower()
            args = {"lane": lane, "seq": op.call.seq, "name": op.call.name}
            cat = "sync" if lane == "sync" else "comm"
            self.handles[id(op)] = self.tl.begin(name, cat, args, t)
        elif what == "data":
            self.tl.mark(self.handles.get(id(op), 0), "data", {"bytes": op.stage_bytes}, t)
        elif what == "done":
            error = {"error": repr(op.error)} if op.error is not None else None
            self.tl.end(self.handles.pop(id(op), 0), error, t)


def attach(engine: Any) -> bool:
    """Record `engine`'s collectives while the timeline is on; False if it is off."""
    tl = active()
    if tl is None:
        return False
    engine.on_event = EngineObserver(tl)
    return True


async def finish(coord: Any, out: str | os.PathLike[str] | None = None) -> MergeResult | None:
    """Collective: every rank closes its file, then rank 0 merges (returns the result)."""
    tl = stop()
    await coord.barrier(name="timeline")
    if tl is None or coord.rank != 0:
        return None
    return merge(tl.prefix, out)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m asynclock.timeline merge PREFIX [-o OUT]`."""
    p = argparse.ArgumentParser(prog="python -m asynclock.timeline")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("merge", help="merge every rank's file into one Perfetto JSON")
    m.add_argument("prefix")
    m.add_argument("-o", "--output", default=None, help="default: <prefix>.json")
    args = p.parse_args(argv)
    try:
        result = merge(args.prefix, args.output)
    except (OSError, ValueError) as exc:
        print(f"timeline merge: {exc}", file=sys.stderr)
        return 1
    print(result.describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())

