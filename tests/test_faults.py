"""Faults: a failing, killed, frozen or late rank; mismatches; cancellation.

Multi-rank tests are real mpiexec/mpirun jobs. Two launch modes:

* the default launcher, which kills the whole job once one rank exits
  non-zero (hydra, Open MPI's mpirun): what users get out of the box;
* a launcher told not to clean up (`-disable-auto-cleanup`,
  `--enable-recovery`), each rank wrapped by `fault_exitcode.py`, which
  prints `RANK r EXIT code`: this shows that every rank leaves by itself,
  non-zero, through asynclock alone (as under launchers that do not clean
  up, or when the failed rank is frozen rather than dead).

Heartbeats run fast here (0.2 s, dead after 3 s) to keep the tests short.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpijob import (
    DEFAULT_KIND,
    OTHER_KINDS,
    PROGRAMS,
    ROOT,
    Job,
    assert_all_ok,
    crossed,
    mpi_select,
    run_job,
)

from asynclock import Coordinator
from asynclock._core.base.errors import RankFailedError
from asynclock._core.engine.progress import Engine, InflightOp
from asynclock._core.runtime.exits import EXIT_RANK_FAILED, EXIT_STALL, EXIT_UNCAUGHT
from asynclock._core.runtime.failure import is_failure, tagged, traceback_text
from asynclock._core.runtime.watchdog import (
    CLOSING,
    FAILED,
    PeerStatus,
    Watchdog,
    WatchdogPolicy,
    missing_ranks,
    reason_for_peers,
    stall_text,
)

KINDS = [DEFAULT_KIND, *OTHER_KINDS]
STRAY = {"ASYNCLOCK_STRAY_S": "0.2"}
FAST = {"ASYNCLOCK_HEARTBEAT_S": "0.2", "ASYNCLOCK_DEAD_AFTER_S": "3",
        "ASYNCLOCK_FAILURE_GRACE_S": "1"}
DEADLINE_S = 30.0  # every survivor must be gone within this


# -- helpers -------------------------------------------------------------------------
def no_cleanup_launcher(kind: str, nranks: int) -> list[str]:
    """The launcher, told to leave the surviving ranks alone when one dies."""
    argv = mpi_select.launcher(kind, nranks)
    if mpi_select.describe(kind)["kind"] == "embedded":
        return [argv[0], "-disable-auto-cleanup", *argv[1:]]
    return [argv[0], "--enable-recovery", "--mca", "orte_abort_on_non_zero_status", "0",
            *argv[1:]]


def timed(program: str, nranks: int, *args: str, cleanup: bool = True, kind: str = DEFAULT_KIND,
          env: dict[str, str] | None = None, timeout: float = 90) -> tuple[Job, float]:
    """Run a job; without cleanup, through the exit-code wrapper."""
    t0 = time.monotonic()
    if cleanup:
        job = run_job(program, nranks, *args, timeout=timeout, env=env, kind=kind)
    else:
        job = run_job("fault_exitcode.py", nranks, str(PROGRAMS / program), *args,
                      timeout=timeout, env=env, kind=kind,
                      launcher=no_cleanup_launcher(kind, nranks))
    return job, time.monotonic() - t0


def rank_pids(job: Job) -> dict[int, int]:
    found = re.findall(r"^(?:\[\d+\] )?RANK (\d+) OK pid (\d+)$", job.output, re.M)
    return {int(r): int(p) for r, p in found}


def exit_codes(job: Job) -> dict[int, int]:
    return {int(r): int(c) for r, c in re.findall(r"^RANK (\d+) EXIT (-?\d+)$", job.output, re.M)}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def assert_no_orphans(job: Job, nranks: int) -> None:
    """Every rank process is gone once the launcher returned (5 s to be reaped)."""
    pids = rank_pids(job)
    assert len(pids) == nranks, job.explain()
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {r: p for r, p in pids.items() if _alive(p)}
    for pid in left.values():  # do not leak them into the next test
        os.kill(pid, 9)
    assert not left, f"orphaned rank processes {left}\n{job.explain()}"


def assert_exits(job: Job, want: dict[int, int], elapsed: float) -> None:
    assert exit_codes(job) == want, job.explain()
    assert elapsed < DEADLINE_S, f"took {elapsed:.1f} s\n{job.explain()}"
    assert not job.ok_lines("unexpected"), job.explain()


# -- an exception on one rank ---------------------------------------------------------------
@pytest.mark.parametrize("nranks, mode, bad", [(2, "async", 1), (3, "sync", 2), (3, "async", 0)])
def test_uncaught_exception_stops_every_rank(nranks: int, mode: str, bad: int) -> None:
    args = ["--rank", str(bad)] + (["--sync"] if mode == "sync" else [])
    job, elapsed = timed("fault_raise.py", nranks, *args, cleanup=False, env=FAST)
    want = {r: EXIT_UNCAUGHT if r == bad else EXIT_RANK_FAILED for r in range(nranks)}
    assert_exits(job, want, elapsed)
    assert job.output.count("Traceback (most recent call last)") == 1, job.explain()
    assert f"[rank {bad}] Traceback (most recent call last)" in job.output, job.explain()
    assert f"[rank {bad}] ValueError: boom from rank {bad}" in job.output, job.explain()
    for r in set(range(nranks)) - {bad}:
        line = f"asynclock[rank {r}]: rank {bad} failed with ValueError: boom from rank {bad}"
        assert line in job.output, job.explain()
    assert_no_orphans(job, nranks)


def test_peers_stop_when_a_failed_rank_shut_down_first() -> None:
    """Rank 1 calls shutdown() in a `finally`, then dies: rank 0 must not wait for it."""
    job, elapsed = timed("fault_raise.py", 2, "--sync", "--shutdown-in-finally", cleanup=False,
                         env=FAST)
    assert_exits(job, {0: EXIT_RANK_FAILED, 1: EXIT_UNCAUGHT}, elapsed)
    assert job.output.count("Traceback (most recent call last)") == 1, job.explain()
    assert "[rank 1] ValueError: boom from rank 1" in job.output, job.explain()
    assert re.search(r"asynclock\[rank 0\]: rank 1 shut asynclock down after issuing #\d+ on "
                     r"lane user, so allreduce\(sum\) float64\[65536\] #\d+ on lane user can "
                     r"never complete", job.output), job.explain()
    assert_no_orphans(job, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_sys_exit_on_every_rank_ends_the_job_with_its_status(kind: str) -> None:
    """`sys.exit(5)` inside `async with asynclock.start()` on every rank (a script that
    decides its outcome everywhere): each rank exits 5, with no traceback, as Python does."""
    job, elapsed = timed("fault_sysexit.py", 2, cleanup=False, kind=kind, env=FAST)
    assert job.ok_lines("exiting") == {0, 1}, job.explain()
    assert_exits(job, {0: 5, 1: 5}, elapsed)
    assert "Traceback" not in job.output and "uncaught" not in job.output, job.explain()
    assert "asynclock[rank" not in job.output, job.explain()
    assert_no_orphans(job, 2)


def test_sys_exit_on_one_rank_ends_the_job_with_its_status() -> None:
    """Rank 1 calls `sys.exit(5)` while the others wait for it in an allreduce: they
    stop at once, say why, and exit 5 too; nobody prints a traceback or hangs (a rank
    that finalized MPI while its peers waited for it hung hydra for ever)."""
    job, elapsed = timed("fault_sysexit.py", 3, "--rank", "1", cleanup=False, env=FAST)
    assert_exits(job, {0: 5, 1: 5, 2: 5}, elapsed)
    assert elapsed < 15, job.explain()  # not the 3 s dead-after verdict plus a hang
    assert "Traceback" not in job.output and "uncaught" not in job.output, job.explain()
    for r in (0, 2):  # each learns it from its own heartbeats or from the other first
        assert re.search(rf"asynclock\[rank {r}\]: rank 1 exited with status 5( \(reported "
                         r"by rank \d\))?; this rank waits in allreduce\(sum\) "
                         r"float64\[65536\]", job.output), job.explain()
    assert_no_orphans(job, 3)


@pytest.mark.parametrize("kind", KINDS)
def test_uncaught_exception_default_launcher(kind: str) -> None:
    job, elapsed = timed("fault_raise.py", 2, kind=kind, env=FAST)
    assert job.returncode != 0 and elapsed < DEADLINE_S, job.explain()
    assert job.output.count("Traceback (most recent call last)") == 1, job.explain()
    assert "[rank 1] ValueError: boom from rank 1" in job.output, job.explain()
    assert_no_orphans(job, 2)


# -- a rank killed or frozen mid-collective ----------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("nranks", [2, 3])
def test_killed_rank_default_launcher(kind: str, nranks: int) -> None:
    job, elapsed = timed("fault_kill.py", nranks, kind=kind, env=FAST)
    assert job.returncode != 0 and elapsed < DEADLINE_S, job.explain()
    assert job.ok_lines("warmed") == set(range(nranks)), job.explain()
    pids = rank_pids(job)
    victim = pids[1]  # hydra names the pid, mpirun and asynclock the rank
    named = re.search(rf"rank 1\b|PID {victim}\b", job.output.replace(f"OK pid {victim}", ""))
    if not named and kind == "embedded":
        # Hydra SIGKILLs the survivors at once, and its banner then names the
        # first of the killed processes it reaps, which may be a survivor: it
        # must still be one of this job's ranks, killed by signal 9.
        banner = re.search(r"PID (\d+) RUNNING AT .*\n.*EXIT CODE: 9", job.output)
        named = banner and int(banner[1]) in pids.values() and "Killed (signal 9)" in job.output
    assert named, job.explain()
    assert_no_orphans(job, nranks)


@pytest.mark.parametrize("kind, nranks", crossed([(3,), (2,)], KINDS[0]))
def test_killed_rank_without_launcher_cleanup(kind: str, nranks: int) -> None:
    job, elapsed = timed("fault_kill.py", nranks, cleanup=False, kind=kind, env=FAST)
    want = {r: 137 if r == 1 else EXIT_RANK_FAILED for r in range(nranks)}
    assert_exits(job, want, elapsed)
    for r in set(range(nranks)) - {1}:
        assert re.search(rf"asynclock\[rank {r}\]: .*rank 1 is unreachable: no heartbeat for "
                         r".*allreduce\(sum\) float64\[262144\] #\d+ on lane user name='step'",
                         job.output), job.explain()
    assert_no_orphans(job, nranks)


@pytest.mark.parametrize("kind", KINDS)
def test_frozen_rank_is_declared_dead(kind: str) -> None:
    """SIGSTOP: alive to every launcher, silent to its peers."""
    job, elapsed = timed("fault_kill.py", 2, "--signal", "STOP", kind=kind, env=FAST)
    assert job.returncode != 0 and elapsed < DEADLINE_S, job.explain()
    assert "asynclock[rank 0]: rank 1 is unreachable" in job.output, job.explain()
    assert_no_orphans(job, 2)


def test_a_rank_frozen_holding_the_gil_dumps_its_own_stacks() -> None:
    """A C call that keeps the GIL freezes every thread of rank 1, heartbeats
    included: before its peer declares it dead (3 s here), its faulthandler
    timer (re-armed by each heartbeat, 0.8 x 3 s) prints where it is stuck."""
    job, elapsed = timed("fault_kill.py", 2, "--signal", "GIL", env=FAST)
    assert job.returncode != 0 and elapsed < DEADLINE_S, job.explain()
    assert "asynclock[rank 0]: rank 1 is unreachable" in job.output, job.explain()
    dump = job.output[job.output.find("Timeout (0:00:02"):]
    assert dump and re.search(r'fault_kill\.py", line \d+ in hold_the_gil', dump), job.explain()
    # the heartbeat thread, waiting
    assert "asynclock/_core/runtime/watchdog.py" in dump, job.explain()
    assert_no_orphans(job, 2)


# -- the same under horovodrun (the Horovod backend shares the watchdog) ------------------------
@functools.cache
def horovod_missing() -> str:
    """Why horovodrun jobs cannot run here ('' when they can)."""
    if not Path(sys.executable).with_name("horovodrun").exists():
        return "horovodrun is not in the venv"
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True,
                           text=True, timeout=120)
    return "" if probe.returncode == 0 else "import horovod.torch fails"


def horovodrun(program: str, *args: str, gloo: bool) -> tuple[Job, float]:
    """2 ranks through `asynclock.launch --runner horovodrun` (lines tagged `[r] `)."""
    if reason := horovod_missing():
        pytest.skip(reason)
    if not gloo and "system" not in KINDS:
        pytest.skip("horovodrun's MPI controller needs Open MPI")
    cmd = [sys.executable, "-m", "asynclock.launch", "-n", "2", "--runner", "horovodrun",
           *(["--gloo"] if gloo else []), "--timeout", "120", str(PROGRAMS / program), *args]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **FAST})
    return Job(done.returncode, done.stdout + done.stderr, cmd), time.monotonic() - t0


@pytest.mark.horovod
@pytest.mark.parametrize("gloo", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["mpi", "gloo"])
def test_killed_rank_horovodrun(gloo: bool) -> None:
    job, elapsed = horovodrun("fault_kill.py", gloo=gloo)
    assert job.returncode not in (0, 124) and elapsed < DEADLINE_S, job.explain()
    assert re.search(r"rank 1\b|Process name: 1\b", job.output), job.explain()
    assert_no_orphans(job, 2)


@pytest.mark.horovod
@pytest.mark.parametrize("gloo", [False, True], ids=["mpi", "gloo"])
def test_frozen_rank_horovodrun(gloo: bool) -> None:
    """The watchdog runs on the Horovod backend too: under Horovod's MPI controller on
    a communicator, under `horovodrun --gloo` (no MPI world) on a TCP mesh of its own
    (`transports.heartbeat`)."""
    job, elapsed = horovodrun("fault_kill.py", "--signal", "STOP", gloo=gloo)
    assert job.returncode not in (0, 124) and elapsed < DEADLINE_S, job.explain()
    assert "asynclock[rank 0]: rank 1 is unreachable" in job.output, job.explain()
    assert_no_orphans(job, 2)


@pytest.mark.horovod
@pytest.mark.parametrize("how", ["KILL", pytest.param("STOP", marks=pytest.mark.slow)])
def test_a_rank_lost_mid_backward_ends_the_shared_file_round(how: str) -> None:
    """Under `horovodrun --gloo` on one node the buckets go through a mapped file: a
    peer lost while the others wait on its counters there ends the job, naming it."""
    job, elapsed = horovodrun("fault_train_kill.py", "--signal", how, gloo=True)
    assert job.returncode not in (0, 124) and elapsed < DEADLINE_S, job.explain()
    assert "transport_shm" in job.output, job.explain()
    assert re.search(r"rank 1\b", job.output) and "unexpected" not in job.output, job.explain()
    assert_no_orphans(job, 2)


GLOO_ROUNDS = {"ASYNCLOCK_BULK": "gloo", "ASYNCLOCK_GLOO_MIN_BYTES": "1",
               "ASYNCLOCK_NODE_WINDOW": "0"}


@pytest.mark.parametrize("how", ["KILL", pytest.param("STOP", marks=pytest.mark.slow)])
def test_a_rank_lost_mid_backward_ends_the_gloo_round(how: str) -> None:
    """Buckets over gloo from the packing thread (as across hosts where MPI's call
    spins): a peer lost while the others wait in gloo ends the job on every survivor,
    each naming it, also when nothing resets gloo's connections (a frozen peer)."""
    killed = how == "KILL"  # a frozen rank never exits: the launcher cleans it up
    job, elapsed = timed("fault_train_kill.py", 2, "--signal", how, cleanup=not killed,
                         env={**FAST, **GLOO_ROUNDS})
    assert "transport_gloo" in job.output, job.explain()
    if killed:
        assert_exits(job, {0: EXIT_RANK_FAILED, 1: 137}, elapsed)
    else:
        assert job.returncode not in (0, 124) and elapsed < DEADLINE_S, job.explain()
    assert re.search(r"asynclock\[rank 0\]: .*rank 1\b", job.output), job.explain()
    assert "unexpected" not in job.output, job.explain()
    assert_no_orphans(job, 2)


# -- stalls ------------------------------------------------------------------------------
@pytest.mark.parametrize("nranks", [2, 3])
def test_stall_report_names_missing_rank(nranks: int) -> None:
    env = {"ASYNCLOCK_STALL_WARN_S": "0.5", "ASYNCLOCK_HEARTBEAT_S": "0.1"}
    job, _ = timed("fault_stall.py", nranks, env=env)
    assert_all_ok(job, nranks)
    assert job.ok_lines("stall_reported") == set(range(nranks)) - {1}, job.explain()
    assert job.ok_lines("peers_reported") == {1}, job.explain()


@pytest.mark.parametrize("nranks", [2, 3])
def test_stall_abort_stops_every_rank(nranks: int) -> None:
    env = {"ASYNCLOCK_STALL_WARN_S": "0.5", "ASYNCLOCK_STALL_ABORT_S": "1.5",
           "ASYNCLOCK_HEARTBEAT_S": "0.1", "ASYNCLOCK_FAILURE_GRACE_S": "1"}
    job, elapsed = timed("fault_stall.py", nranks, "--abort", cleanup=False, env=env)
    codes = exit_codes(job)
    assert sorted(codes) == list(range(nranks)) and all(codes.values()), job.explain()
    assert EXIT_STALL in codes.values() and codes[1] == EXIT_RANK_FAILED, job.explain()
    assert elapsed < DEADLINE_S and not job.ok_lines("unexpected"), job.explain()
    assert re.search(r"asynclock\[rank [02]\]: stall: waiting \d+\.\d s in allreduce\(sum\) "
                     r"float32\[2, 3\] #\d+ on lane user name='late'; missing ranks \[1\]"
                     r".*stopping the job \(exit 4\)", job.output), job.explain()
    assert re.search(r"asynclock\[rank 1\]: rank [02] stopped the job: stall", job.output)
    assert_no_orphans(job, nranks)


# -- mismatches and cancellation ---------------------------------------------------------
@pytest.mark.parametrize("nranks", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_randomized_mismatch_trials(nranks: int) -> None:
    # a name that differs by rank waits out the stray timeout (UnmatchedError)
    job, _ = timed("fault_mismatch.py", nranks, "--trials", "100", timeout=120, env=STRAY)
    assert_all_ok(job, nranks)


@pytest.mark.slow
@pytest.mark.parametrize("nranks, seed", [(2, 11), (3, 12)])
def test_randomized_mismatch_trials_long(nranks: int, seed: int) -> None:
    job, _ = timed("fault_mismatch.py", nranks, "--trials", "3000", "--seed", str(seed), env=STRAY,
                   timeout=900)
    assert_all_ok(job, nranks)


@pytest.mark.parametrize("nranks, loop", [(2, "asyncio"), (3, "trio")])
def test_cancellation_torture(nranks: int, loop: str) -> None:
    """1000 cancelled awaits of collectives: all complete right, nothing left in flight."""
    args = ["--count", "1000", "--no-locks"] + (["--trio"] if loop == "trio" else [])
    job, _ = timed("fault_cancel.py", nranks, *args, timeout=240)
    assert_all_ok(job, nranks)


def test_cancellation_torture_with_locks() -> None:
    """The same, mixed with cancelled acquisitions of a cross-rank lock."""
    if not hasattr(Coordinator, "lock"):
        pytest.skip("no cross-rank locks in this build")
    job, _ = timed("fault_cancel.py", 2, "--count", "1000", timeout=240)
    assert_all_ok(job, 2)
    assert job.ok_lines("locks_tortured") == {0, 1}, job.explain()


@pytest.mark.slow
@pytest.mark.parametrize("nranks, loop", [(2, "trio"), (3, "asyncio")])
def test_cancellation_torture_long(nranks: int, loop: str) -> None:
    args = ["--count", "20000", "--seed", "7"] + (["--trio"] if loop == "trio" else [])
    job, _ = timed("fault_cancel.py", nranks, *args, timeout=1800)
    assert_all_ok(job, nranks)


# -- clean exits stay prompt ---------------------------------------------------------------
@pytest.mark.parametrize("args", [[], ["--sync", "--forget"]])
def test_clean_exit_is_not_delayed_by_heartbeats(args: list[str]) -> None:
    """Heartbeat every 120 s: a shutdown that waited for a tick would time out."""
    job, _ = timed("fault_exit.py", 2, *args, env={"ASYNCLOCK_HEARTBEAT_S": "120"}, timeout=90)
    assert_all_ok(job, 2)


# -- in-process: report texts, failure policy, engine hooks ---------------------------------
def _op(lane: int = 0, seq: int = 3, age: float = 61.0) -> InflightOp:
    return InflightOp("allreduce(sum) float32[4] #3 on lane user name='w'", age, lane, seq, 1)


def test_missing_ranks_by_published_seq() -> None:
    peers = {1: PeerStatus(seqs=(2, 0, 0)), 2: PeerStatus(seqs=(3, 0, 0)), 3: None}
    assert missing_ranks(_op(), peers) == [1, 3]
    text = stall_text(_op(), ("user", "grad", "sync"), peers)
    assert text.startswith("stall: waiting 61.0 s in allreduce(sum) float32[4] #3 on lane user")
    assert "missing ranks [1, 3]" in text
    assert "rank 1: issued up to #2 on lane user, has nothing in flight" in text
    assert "rank 3: no heartbeat received yet" in text


def test_stall_text_when_every_rank_issued() -> None:
    peers = {1: PeerStatus(seqs=(3,), oldest="barrier #9 on lane sync", oldest_age=4.0,
                           loop_lag=2.5)}
    text = stall_text(_op(), ("user",), peers)
    assert "every rank has issued it" in text
    assert "waits in barrier #9 on lane sync for 4.0 s" in text
    assert "its event loop has not run for 2.5 s" in text
    own = stall_text(_op(), ("user",), peers, own_lag=7.0)
    assert "(and this rank's event loop has not run for 7.0 s)" in own


def test_stall_text_of_a_call_waiting_to_be_matched() -> None:
    """Rank 1's header rounds are past the call's slot, yet it never proposed the
    call: the matching table, not the published count, names the missing rank."""
    peers = {1: PeerStatus(seqs=(9,)), 2: PeerStatus(seqs=(9,))}
    waiting = InflightOp("allreduce(sum) float32[4] #3 on lane user name='w'", 61.0, 0, 3, 1,
                         unmatched_by=(1,))
    text = stall_text(waiting, ("user",), peers)
    assert "ranks [1] have not issued it" in text and "rank 1: issued up to #9" in text
    assert "rank 2:" not in text


class _Pending:
    """A request that never completes (the request protocol: `Test()`)."""

    def Test(self) -> bool:  # noqa: N802
        return False


def test_snapshot_with_a_raw_request_in_flight() -> None:
    """The watchdog thread snapshots every in-flight op, raw requests included."""
    engine = Engine()
    engine.track(_Pending(), "a point-to-point receive")
    (view,) = engine.snapshot().ops
    assert view.description == "a point-to-point receive" and view.unmatched_by is None


def _dog(size: int = 3) -> Watchdog:
    """Decision logic only: no thread, no communicator."""
    return Watchdog(None, Engine(), 0, size, WatchdogPolicy(dead_after_s=10.0))


def test_peer_failure_is_relayed_with_its_reason() -> None:
    dog = _dog()
    dog._on_status(2, PeerStatus(FAILED, reason="rank 2 failed with KeyError: 'x'"), 0.0)
    assert dog.stopping == "rank 2 failed with KeyError: 'x'" and dog.exit_code == EXIT_RANK_FAILED
    dog2 = _dog()
    dog2._on_status(2, PeerStatus(FAILED, reason="rank 1 is unreachable: ..."), 0.0)
    assert dog2.stopping == "rank 1 is unreachable: ... (reported by rank 2)"


def test_a_relayed_stop_keeps_the_words_of_the_rank_that_decided_it() -> None:
    """Rank 2 heard rank 0's stall stop and stops too; rank 1 may hear rank 2 first."""
    dog = _dog()
    dog.rank = 2
    dog._on_status(0, PeerStatus(FAILED, reason="rank 0 stopped the job: stall: waiting"), 0.0)
    told = reason_for_peers(2, dog.stopping or "", dog._relayed)
    assert told == "rank 0 stopped the job: stall: waiting"
    rank1 = _dog()
    rank1.rank = 1
    rank1._on_status(2, PeerStatus(FAILED, reason=told), 0.0)
    assert rank1.stopping == "rank 0 stopped the job: stall: waiting (reported by rank 2)"
    assert reason_for_peers(0, "stall: waiting", False) == "rank 0 stopped the job: stall: waiting"


def test_silent_peer_is_declared_dead() -> None:
    dog = _dog()
    now = time.monotonic()
    dog._heard = {1: now - 11.0, 2: now}
    dog._check_peers(now, Engine().snapshot())
    assert dog.stopping is not None and dog.stopping.startswith("rank 1 is unreachable")
    assert dog._fatal is not None and dog._fatal[1] is RankFailedError


def test_closed_peer_that_never_issued_our_op_is_fatal() -> None:
    dog, engine = _dog(2), Engine()
    dog._on_status(1, PeerStatus(CLOSING, seqs=(2,)), time.monotonic())
    assert dog.stopping is None  # shutting down is not a failure by itself
    snap = engine.snapshot()
    snap = type(snap)((_op(seq=3),), 1, (3,), ("user",))
    now = time.monotonic()
    dog._check_peers(now, snap)
    # the peer's last status may predate its issuing #3: the verdict must persist
    assert dog.stopping is None
    dog._check_peers(now + 9.9, snap)
    assert dog.stopping is None
    dog._check_peers(now + 10.1, snap)
    assert dog.stopping == ("rank 1 shut asynclock down after issuing #2 on lane user, so "
                            "allreduce(sum) float32[4] #3 on lane user name='w' can never complete")


def test_failure_policy_texts() -> None:
    try:
        raise ValueError("boom")
    except ValueError as exc:
        text = traceback_text(1, 2, exc)
    assert text.startswith("asynclock[rank 1]: uncaught ValueError; stopping all 2 ranks\n")
    assert all(line.startswith("[rank 1] ") for line in text.splitlines()[1:])
    assert "[rank 1] ValueError: boom" in text
    assert tagged(3, "a\nb\n") == "[rank 3] a\n[rank 3] b\n"
    assert not is_failure(SystemExit(0)) and is_failure(SystemExit(2))
    import asyncio

    assert not is_failure(asyncio.CancelledError()) and is_failure(KeyboardInterrupt())


class _Pending:
    """A transport request that never completes (the engine's request protocol)."""

    def Test(self) -> bool:  # noqa: N802
        return False

    def Wait(self) -> None:  # noqa: N802
        raise AssertionError("not waited on here")


def test_fail_all_wakes_waiters_and_refuses_new_work() -> None:
    import anyio

    async def main() -> None:
        engine = Engine()
        async with anyio.create_task_group() as tg:
            await tg.start(engine.run)
            op = engine.track(_Pending(), "lock 'x' request to rank 1")
            snap = engine.snapshot()
            assert snap.in_flight == 1 and snap.ops[0].description == "lock 'x' request to rank 1"
            assert snap.ops[0].lane == -1
            engine.fail_all_soon(RankFailedError("rank 1 is unreachable"))
            with pytest.raises(RankFailedError, match="rank 1 is unreachable"):
                await engine.wait(op)
            with pytest.raises(RankFailedError):
                engine.track(_Pending(), "later")
            assert engine.statistics().in_flight == 0
            tg.cancel_scope.cancel()

    anyio.run(main)
