"""Timeline files, merge, step metrics and the overlap plot.

In-process tests pin the file format and the repair rules of `merge`; the
MPI jobs show every rank's events reach one valid trace, also when a rank is
SIGKILLed mid-run, and that the plot command draws a real run's trace.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from mpijob import PROGRAMS, ROOT, assert_all_ok, run_job

from asynclock import metrics, timeline
from asynclock._tools.timeline_merge import MergeResult

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())  # the whole point: always valid JSON
    assert isinstance(doc, dict) and isinstance(doc["traceEvents"], list)
    events: list[dict[str, Any]] = doc["traceEvents"]
    return events


def thread_names(events: list[dict[str, Any]], pid: int) -> set[str]:
    return {e["args"]["name"] for e in events
            if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid}


@pytest.fixture
def fresh_switch() -> Any:
    """Each test starts and ends with no active timeline."""
    timeline.stop()
    yield
    timeline.stop()


# -- recording and merging, in process -------------------------------------------
def test_events_are_lines_and_merge_to_perfetto_json(tmp_path: Path, fresh_switch: Any) -> None:
    timeline.start(tmp_path / "run", rank=0, size=1)
    with timeline.span("forward", cat="compute", batch=3), timeline.span("inner", cat="compute"):
        pass
    handle = timeline.begin("allreduce", cat="comm", bucket=1)
    timeline.instant("checkpoint", cat="io")
    timeline.counter("in_flight", buckets=2)
    timeline.end(handle, ok=True)
    with timeline.async_span("lock", cat="sync"):
        pass
    timeline.stop()
    raw = (tmp_path / "run.rank0.jsonl").read_bytes().splitlines()
    assert all(isinstance(json.loads(line), dict) for line in raw)
    result = timeline.merge(tmp_path / "run")
    assert result.path == tmp_path / "run.json" and result.ranks == (0,)
    events = load(result.path)
    names = [e["name"] for e in events if e["ph"] != "M"]
    assert {"forward", "inner", "allreduce", "checkpoint", "in_flight", "lock"} <= set(names)
    assert thread_names(events, 0) == {"compute", "comm", "io", "sync"}
    forward = next(e for e in events if e["name"] == "forward")
    inner = next(e for e in events if e["name"] == "inner")
    assert forward["args"] == {"batch": 3} and forward["tid"] == inner["tid"]
    assert min(e["ts"] for e in events if "ts" in e) == 0  # rebased; origin in otherData
    b, e = (x for x in events if x["name"] == "allreduce")
    assert (b["ph"], e["ph"], e["args"]) == ("b", "e", {"ok": True}) and b["id2"] == e["id2"]


def test_switch_off_costs_a_shared_noop(fresh_switch: Any, monkeypatch: Any) -> None:
    monkeypatch.delenv(timeline.ENV, raising=False)
    assert not timeline.enabled()
    assert timeline.span("a") is timeline.span("b")  # one shared null context
    assert timeline.begin("x") == 0
    timeline.end(0)
    engine = SimpleNamespace(on_event=None)
    assert timeline.attach(engine) is False and engine.on_event is None


def test_env_var_switch_starts_recording(tmp_path: Path) -> None:
    code = ("from asynclock import timeline\n"
            "with timeline.span('hello', cat='compute'):\n    pass\n")
    env = {**os.environ, timeline.ENV: str(tmp_path / "tl"), "PMI_RANK": "3", "PMI_SIZE": "4"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60)
    events, torn = timeline.read_rank_file(tmp_path / "tl.rank3.jsonl")
    assert torn == 0 and {e["pid"] for e in events} == {3}
    assert events[0]["args"]["size"] == 4 and any(e["name"] == "hello" for e in events)


def test_forked_child_does_not_write_as_its_parent(tmp_path: Path, fresh_switch: Any) -> None:
    timeline.start(tmp_path / "f", rank=0)
    pid = os.fork()
    if pid == 0:  # the child: recording is off, the parent's file untouched
        os._exit(0 if not timeline.enabled() and timeline.begin("child") == 0 else 1)
    assert os.waitpid(pid, 0)[1] == 0
    timeline.instant("parent")
    timeline.stop()
    events, _ = timeline.read_rank_file(tmp_path / "f.rank0.jsonl")
    assert [e["name"] for e in events if e["ph"] != "M"] == ["parent"]


def test_directory_prefix(tmp_path: Path) -> None:
    tl = timeline.Timeline(str(tmp_path) + "/", rank=1)
    tl.instant("x")
    tl.close()
    assert (tmp_path / "rank1.jsonl").is_file()
    assert timeline.merge(str(tmp_path) + "/").path == tmp_path / "timeline.json"


def test_clock_is_epoch_microseconds() -> None:
    clock = timeline.Clock()
    assert abs(clock.us() - time.time_ns() / 1e3) < 1e6
    assert clock.us(clock.perf + 1.0) - clock.us(clock.perf) == pytest.approx(1e6)


def test_merge_repairs_what_a_kill_leaves(tmp_path: Path) -> None:
    """A torn last line is skipped, an async slice left open is closed."""
    prefix = tmp_path / "job"
    for rank in (0, 1):
        tl = timeline.Timeline(prefix, rank=rank, size=2)
        tl.complete("forward", "compute", tl.clock.perf, tl.clock.perf + 0.01)
        tl.begin("allreduce", "comm")  # never ended: the rank died
        tl.close()
    with open(timeline.rank_path(prefix, 1), "ab") as f:
        f.write(b'{"name":"torn","ph":"X","ts":12')  # killed inside a write
    result = timeline.merge(prefix)
    assert (result.torn_lines, result.closed_spans, result.ranks) == (1, 2, (0, 1))
    events = load(result.path)
    ends = [e for e in events if e["ph"] == "e"]
    assert {e["pid"] for e in ends} == {0, 1}
    assert all(e["args"] == {"unfinished": True} for e in ends)
    assert "torn" not in {e["name"] for e in events}
    assert "1 torn line" in result.describe()


def test_merge_moves_slices_that_do_not_nest(tmp_path: Path) -> None:
    """Perfetto drops overlapping, non-nested slices on one thread."""
    tl = timeline.Timeline(tmp_path / "p", rank=0)
    t0 = tl.clock.perf
    tl.complete("a", "compute", t0, t0 + 2)
    tl.complete("a.child", "compute", t0 + 0.5, t0 + 1)
    tl.complete("b", "compute", t0 + 1.5, t0 + 3)  # overlaps a, not inside it
    tl.close()
    events = load(timeline.merge(tmp_path / "p").path)
    tid = {e["name"]: e["tid"] for e in events if e["ph"] == "X"}
    assert tid["a"] == tid["a.child"] != tid["b"]
    assert thread_names(events, 0) == {"compute", "compute #2"}


def test_merge_ignores_files_of_an_older_bigger_run(tmp_path: Path) -> None:
    for rank in range(3):
        timeline.Timeline(tmp_path / "r", rank=rank, size=3).close()
    for rank in range(2):  # the new, smaller run rewrites ranks 0 and 1
        timeline.Timeline(tmp_path / "r", rank=rank, size=2).close()
    result = timeline.merge(tmp_path / "r")
    assert result.ranks == (0, 1) and result.ignored == ("r.rank2.jsonl",)
    assert timeline.remove_rank_files(tmp_path / "r") == 3


def test_merge_without_files_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no timeline files"):
        timeline.merge(tmp_path / "none")
    out = subprocess.run([sys.executable, "-m", "asynclock.timeline", "merge",
                          str(tmp_path / "none")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "no timeline files" in out.stderr


# -- metrics ------------------------------------------------------------------------
def test_interval_arithmetic() -> None:
    assert metrics.union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert metrics.intersection([(0, 4), (6, 9)], [(3, 7)]) == [(3, 4), (6, 7)]
    assert metrics.difference([(0, 10)], [(2, 3), (5, 6)]) == [(0, 2), (3, 5), (6, 10)]
    assert metrics.clip([(0, 4), (6, 9)], 3, 7) == [(3, 4), (6, 7)]


def test_step_metrics_from_explicit_times() -> None:
    rec = metrics.StepRecorder()
    rec.begin_step(0.0)
    rec.add_compute(0.0, 6.0)
    rec.comm_started()
    rec.comm_started()
    rec.comm_finished()
    rec.add_comm(4.0, 9.0, nbytes=100)
    rec.add_comm(8.0, 12.0, nbytes=50)  # still running when the step ends
    rec.add_lock_wait(0.5)
    m = rec.end_step(10.0)
    assert (m.step, m.step_time_s, m.compute_s, m.comm_s) == (0, 10.0, 6.0, 6.0)
    assert m.exposed_comm_s == 4.0 and m.overlap_pct == pytest.approx(100 * 2 / 6)
    assert (m.exposed_fraction, m.bytes_reduced, m.max_buckets_in_flight) == (0.4, 150, 2)
    assert m.lock_wait_s == 0.5 and rec.last is m
    rec.begin_step(10.0)
    nxt = rec.end_step(14.0)  # the carried-over (10, 12) communication, nothing hides it
    assert (nxt.step, nxt.comm_s, nxt.exposed_comm_s, nxt.max_buckets_in_flight) == (1, 2, 2, 1)
    assert rec.summary()["step_time_s"] == 7.0
    assert metrics.StepMetrics(0, 1, 1, 0, 0, 0.0, 0.0).overlap_pct == 0.0


def test_metrics_from_a_trace_match_the_recorder() -> None:
    events = [
        {"ph": "X", "pid": 1, "cat": "step", "name": "step 0", "ts": 0, "dur": 10e6,
         "args": {"step": 0, "bytes_reduced": 100}},
        {"ph": "X", "pid": 1, "cat": "compute", "name": "fwd", "ts": 0, "dur": 6e6},
        {"ph": "b", "pid": 1, "cat": "comm", "name": "ar", "ts": 4e6, "id2": {"local": "0x1"}},
        {"ph": "e", "pid": 1, "cat": "comm", "name": "ar", "ts": 9e6, "id2": {"local": "0x1"}},
        {"ph": "X", "pid": 1, "cat": "sync", "name": "lock", "ts": 9e6, "dur": 1e6},
    ]
    (m,) = metrics.from_trace(events)[1]
    assert (m.step_time_s, m.comm_s, m.exposed_comm_s, m.bytes_reduced) == (10, 5, 3, 100)
    assert m.lock_wait_s == pytest.approx(1.0)


def test_progress_bar_on_rank_0_only() -> None:
    rec = metrics.StepRecorder()
    out = io.StringIO()
    items = list(metrics.progress(range(3), SimpleNamespace(rank=0), recorder=rec, file=out,
                                  mininterval=0))
    assert items == [0, 1, 2] and [m.step for m in rec.history] == [0, 1, 2]
    assert "exposed=" in out.getvalue() and "3/3" in out.getvalue()
    quiet = metrics.StepRecorder()
    assert list(metrics.progress("ab", SimpleNamespace(rank=1), recorder=quiet)) == ["a", "b"]
    assert len(quiet.history) == 2


# -- real jobs ------------------------------------------------------------------------
def launch(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "asynclock.launch", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=env)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A 2-rank job through the launcher with --timeline (merged at the end)."""
    prefix = tmp_path_factory.mktemp("timeline") / "run"
    job = launch("-n", "2", "--timeout", "150", "--timeline", str(prefix),
                 str(PROGRAMS / "timeline_steps.py"))
    text = job.stdout + job.stderr
    assert job.returncode == 0, text
    for rank in (0, 1):
        assert f"[{rank}] RANK {rank} OK done" in job.stdout, text
    assert "asynclock-launch: timeline" in job.stderr and "from ranks 0,1" in job.stderr, text
    return prefix, text


def check_trace(events: list[dict[str, Any]], nranks: int) -> None:
    pids = {e["pid"] for e in events}
    assert pids == set(range(nranks))
    for pid in pids:
        mine = [e for e in events if e["pid"] == pid]
        steps = [e for e in mine if e["ph"] == "X" and e["cat"] == "step"]
        assert [e["args"]["step"] for e in steps] == [0, 1, 2, 3]
        assert {"forward", "backward", "optimizer"} <= {e["name"] for e in mine if e["ph"] == "X"}
        ops = [e for e in mine if e["ph"] == "b" and e["args"].get("lane") == "user"]
        assert {e["args"]["name"] for e in ops} >= {"grad0", "grad3", "step0"}  # engine hook
        begun = {json.dumps(e["id2"]) for e in mine if e["ph"] == "b"}
        assert begun == {json.dumps(e["id2"]) for e in mine if e["ph"] == "e"}
        assert {"compute", "comm", "sync", "step"} <= thread_names(events, pid)


@pytest.mark.mpi
def test_two_rank_job_timeline_has_every_rank(two_rank_run: tuple[Path, str]) -> None:
    prefix, _ = two_rank_run
    check_trace(load(timeline.merged_path(prefix)), 2)
    assert sorted(timeline.rank_files(prefix)) == [0, 1]


@pytest.mark.mpi
def test_three_rank_trio_job_timeline(tmp_path: Path) -> None:
    job = run_job("timeline_steps.py", 3, "--trio", timeout=240,
                  env={timeline.ENV: str(tmp_path / "tl")})
    assert_all_ok(job, 3)
    assert job.ok_lines("merged") == {0}, job.explain()  # rank 0 merged in finish()
    check_trace(load(tmp_path / "tl.json"), 3)


@pytest.mark.mpi
def test_killed_rank_still_merges_to_valid_json(tmp_path: Path) -> None:
    """Rank 1 SIGKILLs itself mid-run; rank 0 dies with the job."""
    prefix = tmp_path / "killed"
    job = run_job("timeline_steps.py", 2, "--die", timeout=120, env={timeline.ENV: str(prefix)})
    assert job.returncode != 0, job.explain()
    assert job.ok_lines("before_kill") == {0, 1} and not job.ok_lines("done"), job.explain()
    with open(timeline.rank_path(prefix, 1), "ab") as f:
        f.write(b'{"name":"torn","ph":"i","ts":1')  # as if killed inside a write
    result: MergeResult = timeline.merge(prefix)
    assert result.ranks == (0, 1) and result.torn_lines == 1, result
    events = load(result.path)
    for pid in (0, 1):
        steps = [e for e in events if e["pid"] == pid and e["ph"] == "X" and e["cat"] == "step"]
        assert len(steps) == 4, (pid, steps)
    doomed = [e for e in events if e["name"] == "doomed"]
    assert [e["ph"] for e in doomed] == ["b", "e"] and doomed[1]["args"] == {"unfinished": True}


@pytest.mark.mpi
def test_plot_command_writes_png(two_rank_run: tuple[Path, str], tmp_path: Path) -> None:
    prefix, _ = two_rank_run
    out = tmp_path / "overlap.png"
    trace = str(timeline.merged_path(prefix))
    done = subprocess.run([sys.executable, "-m", "asynclock.plot", trace, "-o", str(out),
                           "--steps", "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    assert "rank 0: exposed" in done.stdout and "rank 1: exposed" in done.stdout
    per_rank = metrics.from_trace(load(timeline.merged_path(prefix)))
    assert sorted(per_rank) == [0, 1] and all(len(v) == 4 for v in per_rank.values())


def test_import_asynclock_stays_light() -> None:
    code = ("import sys, asynclock, asynclock.timeline, asynclock.metrics, asynclock.plot\n"
            "import asynclock.launch, asynclock._tools.rank_output\n"
            "heavy = {'matplotlib', 'torch', 'tqdm'} & set(sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.mpi
@pytest.mark.parametrize("gated", [pytest.param(False, marks=pytest.mark.slow), True])
def test_horovod_script_is_traced_by_the_switch_alone(tmp_path: Path, gated: bool) -> None:
    """ASYNCLOCK_TIMELINE (via --timeline) records a Horovod-style script's forward,
    backward window, bucket pack/unpack, optimizer and gradient allreduces."""
    prefix = tmp_path / "hvd"
    job = launch("-n", "2", "--timeout", "150", "--timeline", str(prefix),
                 str(PROGRAMS / "timeline_torch.py"), *(["--gated"] if gated else []))
    text = job.stdout + job.stderr
    assert job.returncode == 0, text
    events = json.loads(Path(f"{prefix}.json").read_text())["traceEvents"]
    for pid in (0, 1):
        mine = [e for e in events if e.get("pid") == pid]
        slices = Counter(e["name"] for e in mine if e["ph"] == "X")
        assert slices["forward"] >= 4 and slices["optimizer"] >= 4, slices
        assert slices["pack"] >= 4 * 4 and slices["unpack"] >= 4, slices  # 4 params, 4 steps
        opened = Counter(e["name"] for e in mine if e["ph"] == "b")
        assert opened["backward"] == 4, opened
        grads = [e for e in mine if e["ph"] == "b" and e["args"].get("lane") == "grad"]
        assert grads, "no gradient-lane collective recorded"
        begun = {json.dumps(e["id2"]) for e in mine if e["ph"] == "b"}
        assert begun == {json.dumps(e["id2"]) for e in mine if e["ph"] == "e"}, "unclosed slice"
