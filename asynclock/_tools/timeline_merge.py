"""Timeline files: where each rank writes, and the merge into one Perfetto JSON.

Kept apart from `timeline` (the recorder) because merging runs in another
process (the launcher, rank 0 after a barrier, or by hand after a killed
job) and must cope with whatever a dead rank left behind: a torn last line,
async slices never ended, slices that overlap without nesting, files of an
older, bigger run under the same prefix.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Event = dict[str, Any]


# -- files ----------------------------------------------------------------------
def _is_dir_prefix(prefix: str | os.PathLike[str]) -> bool:
    text = os.fspath(prefix)
    return text.endswith(("/", os.sep)) or Path(text).is_dir()


def rank_path(prefix: str | os.PathLike[str], rank: int) -> Path:
    """`<prefix>.rank<r>.jsonl`, or `<dir>/rank<r>.jsonl` when prefix is a directory."""
    p = Path(prefix)
    return p / f"rank{rank}.jsonl" if _is_dir_prefix(prefix) else p.with_name(
        f"{p.name}.rank{rank}.jsonl")


def merged_path(prefix: str | os.PathLike[str]) -> Path:
    p = Path(prefix)
    return p / "timeline.json" if _is_dir_prefix(prefix) else p.with_name(p.name + ".json")


def rank_files(prefix: str | os.PathLike[str]) -> dict[int, Path]:
    """Every rank's event file under `prefix`, by rank."""
    probe = rank_path(prefix, 0)
    pattern = re.compile(re.escape(probe.name).replace("rank0", r"rank(\d+)") + "$")
    if not probe.parent.is_dir():
        return {}
    found = {int(m.group(1)): f for f in probe.parent.iterdir() if (m := pattern.match(f.name))}
    return dict(sorted(found.items()))


def remove_rank_files(prefix: str | os.PathLike[str]) -> int:
    """Delete a previous run's files, so a smaller job cannot merge stale ranks."""
    files = rank_files(prefix)
    for path in files.values():
        path.unlink()
    return len(files)


def read_rank_file(path: Path) -> tuple[list[Event], int]:
    """The events of one file and how many torn (unparseable) lines were skipped."""
    events: list[Event] = []
    torn = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                event = json.loads(raw)
            except ValueError:
                torn += 1
                continue
            if isinstance(event, dict):
                events.append(event)
            else:
                torn += 1
    return events, torn


# -- merging ----------------------------------------------------------------------
@dataclass(frozen=True)
class MergeResult:
    """What `merge` wrote, and what it had to repair."""

    path: Path
    events: int
    ranks: tuple[int, ...]
    torn_lines: int
    closed_spans: int
    ignored: tuple[str, ...]

    def describe(self) -> str:
        notes = [f"{self.torn_lines} torn line(s) skipped"] if self.torn_lines else []
        notes += [f"{self.closed_spans} unfinished span(s) closed"] if self.closed_spans else []
        notes += [f"ignored stale {', '.join(self.ignored)}"] if self.ignored else []
        ranks = ",".join(map(str, self.ranks))
        return f"{self.path}: {self.events} events from ranks {ranks}" + "".join(
            f"; {n}" for n in notes)


def merge(prefix: str | os.PathLike[str], out: str | os.PathLike[str] | None = None
          ) -> MergeResult:
    """Merge every rank's file into one Chrome-trace JSON (atomic write); works on the
    files of a killed job."""
    files = rank_files(prefix)
    if not files:
        raise FileNotFoundError(f"no timeline files {rank_path(prefix, 0).name} "
                                f"(rank0, rank1, ...) in {rank_path(prefix, 0).parent}")
    loaded = {rank: read_rank_file(path) for rank, path in files.items()}
    ignored = _stale_ranks(loaded)
    events = [e for r, (evs, _) in loaded.items() if r not in ignored for e in evs]
    closed = _close_open_async(events)
    _layout_slices(events)
    origin = _rebase(events)
    target = Path(out) if out is not None else merged_path(prefix)
    ranks = tuple(r for r in loaded if r not in ignored)
    torn = sum(t for r, (_, t) in loaded.items() if r not in ignored)
    info = {"origin_epoch_us": origin, "ranks": list(ranks), "torn_lines": torn,
            "closed_spans": closed}
    _write_atomic(target, {"traceEvents": events, "displayTimeUnit": "ms",
                           "otherData": {"asynclock": info}})
    return MergeResult(target, len(events), ranks, torn, closed,
                       tuple(files[r].name for r in sorted(ignored)))


def _stale_ranks(loaded: dict[int, tuple[list[Event], int]]) -> set[int]:
    """Ranks at or past the size in rank 0's header: files of an older, bigger run
    (every run rewrites rank 0's file, so its header is the newest)."""
    events = loaded.get(0, ([], 0))[0]
    sizes = [e["args"].get("size") for e in events
             if e.get("name") == "process_name" and e.get("ph") == "M"]
    size = sizes[0] if sizes else None
    return {r for r in loaded if r >= size} if isinstance(size, int) else set()


def _close_open_async(events: list[Event]) -> int:
    """End async slices a killed rank left open at that rank's last timestamp."""
    last: dict[int, float] = defaultdict(float)
    opened: dict[tuple[int, str], Event] = {}
    for e in events:
        if "ts" in e:
            last[e["pid"]] = max(last[e["pid"]], e["ts"] + e.get("dur", 0))
        key = (e.get("pid", 0), str(e.get("id2", e.get("id"))))
        if e.get("ph") == "b":
            opened[key] = e
        elif e.get("ph") == "e":
            opened.pop(key, None)
    for (pid, _), b in opened.items():
        events.append({**b, "ph": "e", "ts": last[pid], "args": {"unfinished": True}})
    return len(opened)


def _layout_slices(events: list[Event]) -> None:
    """Slices on one thread must nest; move any that overlap a sibling to `<cat> #k`."""
    tracks: dict[tuple[int, int], list[Event]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            tracks[(e["pid"], e.get("tid", 0))].append(e)
    names = {(e["pid"], e.get("tid", 0)): e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    extra: list[Event] = []
    for (pid, tid), slices in tracks.items():
        for lane in _assign_lanes(slices):
            if lane:
                extra += _rename(slices, lane, pid, tid, names.get((pid, tid), str(tid)))
    events.extend(extra)


def _assign_lanes(slices: list[Event]) -> set[int]:
    """Greedy: each slice goes to the first lane where it nests; returns lanes used."""
    slices.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
    stacks: list[list[float]] = []
    for e in slices:
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        e["_lane"] = _place(stacks, start, end, e)
    return {e["_lane"] for e in slices}


def _place(stacks: list[list[float]], start: float, end: float, e: Event) -> int:
    eps = 0.01  # µs: rounding of ts and dur must not split a child from its parent
    for i, stack in enumerate(stacks):
        while stack and stack[-1] <= start + eps:
            stack.pop()
        if not stack or end <= stack[-1] + eps:
            if stack and end > stack[-1]:
                e["dur"] = round(stack[-1] - start, 3)
            stack.append(min(end, stack[-1]) if stack else end)
            return i
    stacks.append([end])
    return len(stacks) - 1


def _rename(slices: list[Event], lane: int, pid: int, tid: int, name: str) -> list[Event]:
    new_tid = tid + 1000 * lane
    for e in slices:
        if e["_lane"] == lane:
            e["tid"] = new_tid
    meta = {"ph": "M", "pid": pid, "tid": new_tid}
    return [{**meta, "name": "thread_name", "args": {"name": f"{name} #{lane + 1}"}},
            {**meta, "name": "thread_sort_index", "args": {"sort_index": new_tid}}]


def _rebase(events: list[Event]) -> float:
    """Start the trace at 0 µs (keeps sub-µs precision); returns the epoch origin."""
    stamps = [e["ts"] for e in events if "ts" in e]
    origin = min(stamps) if stamps else 0.0
    for e in events:
        e.pop("_lane", None)
        if "ts" in e:
            e["ts"] = round(e["ts"] - origin, 3)
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0.0)))
    return origin


def _write_atomic(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
    os.replace(tmp, path)
