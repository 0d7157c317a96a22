"""Elastic jobs: a rank SIGKILLed mid-epoch leaves, the survivors go on from the last
commit in the same processes, a host the discovery script adds joins at the next commit,
and below --min-np the job ends naming what was lost.

The jobs run under `python -m asynclock.launch --elastic` (Horovod's elastic driver,
`horovodrun --gloo --min-np --max-np --host-discovery-script`) on one machine: each
"host" is another name of this machine (`127.0.0.1`, `127.1`, ...: horovodrun starts
ranks on a name that resolves to a local address without ssh), one slot each, since the
driver blacklists the host of a rank that failed. The program is
tests/programs/elastic_train.py; rank 0 checks the samples and the parameters against a
one-process replay of the committed steps (float64, rtol 1e-9) and prints `checked`.

The pure parts (the sampler's shards, the state's commits and host checks, the
launcher's command line) are tested in-process on a one-rank coordinator.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpijob import PROGRAMS, ROOT, Job, horovodrun_missing

import asynclock
from asynclock import launch
from asynclock._core.runtime import elastic as core_elastic
from asynclock._core.transports.horovod_elastic import ADDED, REMOVED, driver_unreachable

HOSTS = ("localhost", "127.0.0.1", "127.1")  # names of this machine, one slot each
ADDED_HOST = "127.0.1"
RECOVERY_LIMIT_S = 20.0  # gloo's own timeout (30 s) would show as a longer recovery
_AT = re.compile(r"RANK (\d+) OK (\w+) (?:pid=(\d+) )?.*?at=([\d.]+)")


def elastic_job(tmp_path: Path, *args: str, min_np: int = 2, max_np: int = 3,
                elastic_timeout: int | None = None, timeout: float = 300,
                env: dict[str, str] | None = None) -> tuple[Job, float]:
    """The program on 3 ranks under `asynclock.launch --elastic`; (job, seconds)."""
    if why := horovodrun_missing(gloo=True):
        pytest.skip(why)
    (tmp_path / "hosts").write_text("".join(f"{h}:1\n" for h in HOSTS))
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts'}\n")
    script.chmod(0o755)
    extra = ["--launcher-arg=--network-interface", "--launcher-arg=lo"]
    if elastic_timeout is not None:
        extra += ["--launcher-arg=--elastic-timeout", f"--launcher-arg={elastic_timeout}"]
    cmd = [sys.executable, "-m", "asynclock.launch", "--elastic", "-n", "3",
           "--min-np", str(min_np), "--max-np", str(max_np),
           "--host-discovery-script", str(script), *extra, "--timeout", str(timeout),
           str(PROGRAMS / "elastic_train.py"), str(tmp_path), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                **(env or {})}
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60, cwd=ROOT,
                          env=full_env)
    return Job(done.returncode, done.stdout + done.stderr, cmd), time.monotonic() - t0


def events(job: Job, label: str) -> list[tuple[int, int | None, float, str]]:
    """(rank, pid, time, line) of each `RANK r OK label ... at=T` line."""
    found = []
    for line in job.output.splitlines():
        m = _AT.search(line)
        if m and m[2] == label:
            found.append((int(m[1]), int(m[3]) if m[3] else None, float(m[4]), line))
    return found


def pids(job: Job, label: str) -> dict[int, set[int]]:
    """rank -> the pids that printed `RANK rank OK label pid=P`."""
    out: dict[int, set[int]] = {}
    for m in re.finditer(rf"RANK (\d+) OK {label} pid=(\d+)", job.output):
        out.setdefault(int(m[1]), set()).add(int(m[2]))
    return out


def recovery_s(job: Job) -> float:
    """From the SIGKILL to the first step of the 2-rank world (each survivor's, the later)."""
    died = events(job, "died")
    assert len(died) == 1, job.explain()
    firsts = [t for _r, _p, t, line in events(job, "world") if "size=2 " in line]
    assert len(firsts) == 2, job.explain()
    return max(firsts) - died[0][2]


def check_kill_and_rejoin(job: Job, dead: int = 2) -> None:
    assert job.returncode == 0, job.explain()
    checked = [line for line in job.output.splitlines() if "RANK 0 OK checked" in line]
    # step 7 ran at 3 ranks but was not committed: the survivors did it again at 2
    assert checked and re.search(r"sizes=3{6}2+3+ ", checked[0]), job.explain()
    started, done = pids(job, "started"), pids(job, "done")
    # the survivors finish in the processes they started in; the newcomer is a new one
    survivors = set().union(*(started[rank] for rank in {0, 1, 2} - {dead}))
    assert survivors <= done[0] | done[1] | done[2], job.explain()
    assert len(done[0] | done[1] | done[2]) == 3 and sum(map(len, started.values())) == 4, \
        job.explain()
    for rank in {0, 1, 2} - {dead}:
        assert f"asynclock[rank {rank}]: rank {dead} left the job: its connection closed" in \
            job.output, job.explain()
    assert re.search(r"RANK 2 OK done pid=\d+ size=3", job.output), job.explain()
    assert recovery_s(job) < RECOVERY_LIMIT_S, job.explain()


@pytest.mark.horovod
def test_a_killed_rank_leaves_and_an_added_host_joins(tmp_path: Path) -> None:
    """`hvd.elastic.run`, `TorchState`, `ElasticSampler`, `DistributedOptimizer`: rank 2
    is SIGKILLed in step 8, ranks 0 and 1 go on from the commit of step 6 at 2 ranks,
    a host added to the discovery output joins at the next commit, and the job ends at
    3 ranks: every sample of the epoch used once, the parameters those of the replay."""
    job, _ = elastic_job(tmp_path, "--api", "hvd", "--add-host", ADDED_HOST)
    check_kill_and_rejoin(job)


@pytest.mark.horovod
def test_the_async_api_survives_a_reset_with_its_loop_and_side_tasks(tmp_path: Path) -> None:
    """`asynclock.run_elastic` with `coord.train_step`: the same, and a side task on the
    same loop keeps ticking through both resets (the new world is made in a thread)."""
    job, _ = elastic_job(tmp_path, "--api", "async", "--add-host", ADDED_HOST)
    check_kill_and_rejoin(job)
    gaps = {int(m[1]): float(m[2]) for m in re.finditer(
        r"RANK (\d+) OK side_task ticks=\d+ max_gap=([\d.]+)", job.output)}
    assert set(gaps) == {0, 1, 2} and max(gaps[0], gaps[1]) < 3.0, job.explain()


@pytest.mark.horovod
@pytest.mark.slow
def test_when_rank_0_dies_the_lowest_survivor_leads(tmp_path: Path) -> None:
    """Rank 0 dies: rank 1 becomes rank 0 of the new world, the state is synced from it,
    it hears of the added host from the driver, and it checks the end."""
    job, _ = elastic_job(tmp_path, "--kill-rank", "0", "--add-host", ADDED_HOST)
    check_kill_and_rejoin(job, dead=0)


@pytest.mark.horovod
@pytest.mark.slow
def test_a_rank_cut_off_is_named_by_its_silence_and_left_behind(tmp_path: Path) -> None:
    """Rank 2 freezes (SIGSTOP: alive, connections open, silent, as behind a cut link)
    and is SIGKILLed 4 s later, as when the launcher's session to a cut host ends. The
    survivors name it after ASYNCLOCK_DEAD_AFTER_S (2 s) and re-form once the driver
    has seen it go; training ends as in the other tests."""
    job, _ = elastic_job(tmp_path, "--cut-for", "4", env={
        "ASYNCLOCK_DEAD_AFTER_S": "2", "ASYNCLOCK_HEARTBEAT_S": "0.2"})
    assert job.returncode == 0, job.explain()
    for rank in (0, 1):
        assert f"asynclock[rank {rank}]: rank 2 is unreachable: no heartbeat for" in \
            job.output, job.explain()
    assert re.search(r"RANK 0 OK checked steps=\d+ sizes=3{6}2+ ", job.output), job.explain()


@pytest.mark.horovod
def test_below_min_np_the_job_ends_naming_the_lost_rank(tmp_path: Path) -> None:
    """--min-np 3: after rank 2 dies the driver cannot re-form the job; it ends, and each
    survivor says why, naming the rank that was lost."""
    job, elapsed = elastic_job(tmp_path, min_np=3, elastic_timeout=5, timeout=150)
    assert job.returncode not in (0, 124), job.explain()
    for rank in (0, 1):
        assert (f"asynclock[rank {rank}]: the job could not re-form after rank 2 left the job"
                in job.output), job.explain()
    assert elapsed < 150, job.explain()


@pytest.mark.horovod
@pytest.mark.slow
def test_the_example_kills_a_rank_and_finishes_at_three() -> None:
    """examples/elastic_kill_and_continue.py starts its own elastic job and finishes it."""
    if why := horovodrun_missing(gloo=True):
        pytest.skip(why)
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "elastic_kill_and_continue.py")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "rank 2: SIGKILL" in out and "added host 127.0.1" in out, out
    assert len(re.findall(r"finished as rank \d of 3", out)) == 3, out
    assert re.search(r"epoch 2 done at 3 ranks", out), out


# -- in-process: one rank --------------------------------------------------------------
@pytest.fixture
def one_rank() -> object:
    coord = asynclock.init("local")
    yield coord
    asynclock.shutdown()


def test_sampler_shards_what_is_left_without_repeating(one_rank: object) -> None:
    import asynclock.torch as hvd

    sampler = hvd.elastic.ElasticSampler(range(10), shuffle=True, seed=3)
    order = sampler.epoch_order()
    assert sorted(order) == list(range(10)) and list(sampler) == order
    sampler.record_batch(0, 3)
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == order[3:] and len(sampler) == 7
    sampler.set_epoch(1)
    assert sampler.processed_num == 0 and sorted(sampler) == list(range(10))
    assert list(sampler) != order  # another epoch, another order


def test_object_state_commits_deep_copies(one_rank: object) -> None:
    state = asynclock.ObjectState(seen=[1], step=0)
    state.seen.append(2)
    state.step = 5
    state.restore()
    assert state.seen == [1] and state.step == 0
    state.seen.append(3)
    state.commit()
    state.seen.append(4)
    state.restore()
    assert state.seen == [1, 3]


def test_host_notes_interrupt_at_the_next_commit_once(one_rank: object) -> None:
    state = asynclock.ObjectState(step=0)
    state.commit()
    state.on_hosts_updated(100.0, ADDED)
    with pytest.raises(asynclock.HostsUpdatedInterrupt) as added:
        state.commit()
    assert not added.value.skip_sync
    state.commit()  # that note is spent
    state.on_hosts_updated(101.0, REMOVED)
    state.on_hosts_updated(99.0, ADDED)  # older than what was seen: no news
    with pytest.raises(asynclock.HostsUpdatedInterrupt) as removed:
        state.commit()
    assert removed.value.skip_sync


def test_only_a_lost_world_re_forms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLOCK_ON_ERROR", "reform")
    lost = asynclock.RankFailedError("rank 2 left the job")
    assert core_elastic.lost_world(lost) is lost
    try:
        try:
            raise asynclock.BackendError("allgather round 3: rank(s) [2] closed")
        except asynclock.BackendError as cause:
            raise RuntimeError("a bucket failed") from cause
    except RuntimeError as wrapped:
        assert isinstance(core_elastic.lost_world(wrapped), asynclock.RankFailedError)
    assert core_elastic.lost_world(asynclock.MismatchError("shapes differ")) is None
    assert core_elastic.lost_world(ValueError("a bug")) is None
    monkeypatch.setenv("ASYNCLOCK_ON_ERROR", "abort")
    assert core_elastic.lost_world(lost) is None


def test_the_policy_is_reform_under_the_elastic_launcher(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    from asynclock._core.runtime import failure

    monkeypatch.delenv("ASYNCLOCK_ON_ERROR", raising=False)
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert failure.policy() == "reform"
    monkeypatch.delenv("HOROVOD_ELASTIC")
    assert failure.policy() == "abort"


def test_gloo_sockets_ends_only_tcp_connections_opened_since_its_snapshot() -> None:
    """What `hvd.shutdown()` leaves open is ended, the descriptor stays (Horovod closes it);
    sockets that were there before, and local socket pairs, are left alone."""
    import socket

    from asynclock._core.transports.horovod_elastic import GlooSockets

    listener = socket.create_server(("127.0.0.1", 0))
    older = socket.create_connection(listener.getsockname())
    older_peer, _ = listener.accept()
    before = GlooSockets.snapshot()
    pair = socket.socketpair()
    newer = socket.create_connection(listener.getsockname())
    newer_peer, _ = listener.accept()
    sockets = GlooSockets(before)
    assert sockets.end_connections() == 2  # `newer` and the end `accept` made
    assert newer_peer.recv(1) == b"" and os.fstat(newer.fileno())  # ended, still open
    pair[0].sendall(b"x")
    older.sendall(b"y")
    assert pair[1].recv(1) == b"x" and older_peer.recv(1) == b"y"
    for sock in (listener, older, older_peer, newer, newer_peer, *pair):
        sock.close()


def test_launch_elastic_command_line(tmp_path: Path) -> None:
    script = tmp_path / "hosts.sh"
    args = launch.parse_args(["--elastic", "--min-np", "2", "--max-np", "4",
                              "--host-discovery-script", str(script), "train.py"])
    plan = launch.build_plan(args, {"PATH": os.environ.get("PATH", "")})
    argv = plan.argv
    assert plan.runner == "horovodrun" and "--gloo" in argv
    assert argv[argv.index("-np") + 1] == "2"  # starts on --min-np, grows to --max-np
    assert argv[argv.index("--min-np") + 1] == "2" and argv[argv.index("--max-np") + 1] == "4"
    assert argv[argv.index("--host-discovery-script") + 1] == str(script)
    with pytest.raises(SystemExit):
        launch.parse_args(["--min-np", "2", "train.py"])


def test_slurm_recipe_parses_and_lists_usable_nodes(tmp_path: Path) -> None:
    """launch/slurm_elastic.sbatch and its discovery script parse; the script keeps the
    nodes Slurm reports usable, once each, with the task count per node (a stand-in
    `sinfo` prints states as Slurm's does: `*` for not responding)."""
    for script in ("slurm_elastic.sbatch", "slurm_hosts.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True, timeout=30)
    sinfo = tmp_path / "sinfo"
    sinfo.write_text("#!/bin/sh\nprintf 'n1 alloc\\nn2 down*\\nn3 mix\\nn3 mix\\nn4 drain\\n"
                     "n5 idle*\\nn6 idle\\n'\n")
    sinfo.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "n[1-6]", "SLURM_NTASKS_PER_NODE": "2(x6)"}
    listed = subprocess.run(["bash", str(ROOT / "launch" / "slurm_hosts.sh")], env=env,
                            capture_output=True, text=True, timeout=30, check=True).stdout
    assert listed.split() == ["n1:2", "n3:2", "n6:2"]


def test_a_rank_that_cannot_reach_the_driver_is_told_why() -> None:
    """`driver_unreachable`: None without an elastic driver or when its rendezvous server
    accepts; else what failed, naming the address (a cut-off rank then leaves the job)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        env = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
               "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port)}
        assert driver_unreachable(env, 1.0) is None
    why = driver_unreachable(env, 1.0)  # the server is closed: refused
    assert why is not None and f"driver at 127.0.0.1:{port} does not answer" in why
    assert driver_unreachable({}, 1.0) is None
