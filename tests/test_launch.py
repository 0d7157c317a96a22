"""asynclock-launch: command lines, the rank-tagging trampoline, and real 2-rank jobs
through every runner this machine has (embedded MPICH, system Open MPI, horovodrun)."""

from __future__ import annotations

import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mpijob import PROGRAMS, ROOT, processes_with

from asynclock import jobwatch, launch
from asynclock._tools import mpi_select, rank_output

# Launcher jobs here are timed, and killed, as wholes: they run in launch/test.sh's serial
# phase, beside at most one other of them (most of their time is a timeout or a signal's
# grace running out), not beside the parallel phase's jobs.
pytestmark = pytest.mark.serial

KINDS = [k for k, ok in mpi_select.available().items() if ok]
HELLO = str(PROGRAMS / "launch_hello.py")
HVD = str(PROGRAMS / "launch_hvd.py")


def run_launcher(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "asynclock.launch", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


def dry(*args: str) -> list[str]:
    plan = launch.build_plan(launch.parse_args(list(args)), os.environ)
    for path in plan.temp_files:
        os.unlink(path)
    return plan.argv


def explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"


# -- command lines ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_mpi_command_runs_program_behind_trampoline(kind: str) -> None:
    argv = dry("-n", "3", "--runner", kind, "--timeline", "/tmp/x", "train.py", "--lr", "1")
    assert argv[:len(mpi_select.launcher(kind, 3))] == mpi_select.launcher(kind, 3)
    tail = [sys.executable, "-I", str(Path(rank_output.__file__).resolve()), sys.executable,
            "train.py", "--lr", "1"]
    assert argv[-len(tail):] == tail
    if kind == "system":  # Open MPI forwards only what -x names to remote ranks
        assert argv[argv.index("ASYNCLOCK_TIMELINE") - 1] == "-x"


def test_other_runners_command_lines() -> None:
    gloo = dry("-n", "2", "--gloo", "-m", "pkg.train", "a")
    assert Path(gloo[0]).name == "horovodrun" and gloo[1:4] == ["-np", "2", "--gloo"]
    assert gloo[-4:] == [sys.executable, "-m", "pkg.train", "a"]
    srun = dry("--runner", "srun", "-n", "4", "--no-prefix", "-H", "a:2,b:2", "./a.out")
    assert srun == ["srun", "--kill-on-bad-exit=1", "-n", "4", "--nodelist", "a,b", "./a.out"]
    assert launch.choose_runner(launch.parse_args(["x.py"]), {"SLURM_JOB_ID": "7", "PATH": ""}) \
        == "mpiexec"  # Slurm job id but no srun on PATH: not under Slurm after all


@pytest.mark.parametrize("kind", KINDS)
def test_srun_gets_the_plugin_of_the_chosen_mpi(kind: str) -> None:
    """`--mpi KIND` under srun: Open MPI answers to pmix, MPICH to pmi2 (tests/test_slurm.py
    runs both); a plugin the user names wins; without --mpi Slurm's default stays."""
    plugin = {"system": "pmix", "embedded": "pmi2"}[kind]
    assert dry("--runner", "srun", "--mpi", kind, "x.py")[:3] == [
        "srun", "--kill-on-bad-exit=1", f"--mpi={plugin}"]
    named = dry("--runner", "srun", "--mpi", kind, "--launcher-arg=--mpi=cray_shasta", "x.py")
    assert [a for a in named if a.startswith("--mpi")] == ["--mpi=cray_shasta"]
    assert not any(a.startswith("--mpi") for a in dry("--runner", "srun", "x.py"))


def test_launcher_plans_the_projects_mpi_without_the_repository(tmp_path: Path) -> None:
    """From an installed wheel there is no mpi/ folder: the selector the launcher takes
    is the package's own (`_tools.mpi_select`), so a copy of the package alone, away
    from the repository, still plans a job on the project's MPI."""
    shutil.copytree(ROOT / "asynclock", tmp_path / "asynclock",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    code = ("import sys; from asynclock import launch; "
            "print(launch.__file__); print(launch.mpi_select.__file__); "
            "sys.exit(launch.main(['--dry-run', '-n', '2', '--no-prefix', 'x.py']))")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, explain(done)
    where, selector, command = done.stdout.strip().splitlines()
    assert Path(where).is_relative_to(tmp_path) and Path(selector).is_relative_to(tmp_path)
    argv, prefix = shlex.split(command), mpi_select.launcher("auto", 2)
    assert argv[:len(prefix)] == prefix and argv[-2:] == [sys.executable, "x.py"], argv


def test_hostfile_is_converted_for_each_runner(tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two nodes\nnode1 slots=2\nnode2:4  # hydra style\nnode3\n")
    hosts = launch.read_hosts(str(hostfile))
    assert hosts == [("node1", 2), ("node2", 4), ("node3", None)]
    hydra = launch.write_hosts(hosts, "hydra")
    ompi = launch.write_hosts(hosts, "openmpi")
    try:
        assert Path(hydra).read_text() == "node1:2\nnode2:4\nnode3\n"
        assert Path(ompi).read_text() == "node1 slots=2\nnode2 slots=4\nnode3\n"
    finally:
        os.unlink(hydra)
        os.unlink(ompi)
    flag = "--hostfile" if mpi_select.resolve("auto") == "system" else "-f"
    assert flag in dry("-n", "2", "--hostfile", str(hostfile), "x.py")


def test_module_keeps_the_arguments_after_it() -> None:
    """As after `python -m` (and torchrun's -m): flags after the module are the module's,
    even ones the launcher also has."""
    argv = dry("-n", "2", "-m", "pkg.train", "--timeout", "5", "-n", "3", "--sort-keys")
    assert argv[-7:] == [sys.executable, "-m", "pkg.train", "--timeout", "5", "-n", "3",
                         "--sort-keys"][-7:]
    assert "5" not in argv[:argv.index("-m")] and "3" not in argv[:argv.index("-m")]


@pytest.mark.parametrize("line", ["badhost:abc", "node1 slots=two", "node1 node2"])
def test_a_bad_hostfile_line_is_a_clear_error(tmp_path: Path, line: str) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"node0 slots=2\n{line}\n")
    done = run_launcher("-n", "2", "--hostfile", str(hostfile), HELLO, timeout=60)
    assert done.returncode == 2, explain(done)
    assert f"asynclock-launch: error: hostfile {hostfile}:2: {line!r}" in done.stderr, \
        explain(done)
    assert "Traceback" not in done.stderr, explain(done)
    missing = run_launcher("--hostfile", str(tmp_path / "none"), HELLO, timeout=60)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr, explain(missing)


def test_recipes() -> None:
    """launch/: the scripts parse, the example hostfile reads, the sbatch line is sound."""
    for script in ("slurm.sbatch", "horovodrun.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True, timeout=30)
    assert launch.read_hosts(str(ROOT / "launch" / "hostfile.example")) == [
        ("node01", 4), ("node02", 4)]
    argv = dry("--runner", "srun", "--launcher-arg=--mpi=pmix", "--timeout", "60", "t.py")
    assert argv[:3] == ["srun", "--kill-on-bad-exit=1", "--mpi=pmix"]  # no -n: Slurm's count


def test_env_rank_reads_every_launcher() -> None:
    assert rank_output.env_rank is launch.env_rank
    assert launch.env_rank({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert launch.env_rank({"SLURM_PROCID": "5", "HOROVOD_RANK": "1"}) == 1
    assert launch.env_rank({}) is None and launch.env_size({"PMI_SIZE": "3"}) == 3


def test_horovodrun_tags_are_stripped() -> None:
    assert launch.strip_tag(b"[1,0]<stdout>:[0] hi\n") == b"[0] hi\n"
    assert launch.strip_tag(b"[1]<stderr>:[1] err\n") == b"[1] err\n"
    assert launch.strip_tag(b"[0] plain\n") == b"[0] plain\n"


# -- real jobs --------------------------------------------------------------------------------
def assert_tagged_hello(done: subprocess.CompletedProcess[str], nranks: int) -> None:
    for rank in range(nranks):
        assert f"[{rank}] hello from {rank} of {nranks} env_rank={rank}" in done.stdout, \
            explain(done)
        assert f"[{rank}] note on stderr from {rank}\n" in done.stderr, explain(done)
    program_lines = [ln for ln in done.stdout.splitlines() if "hello" in ln or "note" in ln]
    assert all(ln.startswith(("[0] ", "[1] ")) for ln in program_lines), explain(done)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_two_rank_job_lines_are_tagged(kind: str) -> None:
    done = run_launcher("-n", "2", "--runner", kind, "--timeout", "120", HELLO)
    assert done.returncode == 0, explain(done)
    assert_tagged_hello(done, 2)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_failing_rank_fails_the_launch(kind: str) -> None:
    done = run_launcher("-n", "2", "--runner", kind, "--timeout", "120", HELLO, "--fail")
    assert done.returncode == 3, explain(done)  # the rank's own code, whatever hydra says
    assert "[1] asynclock[rank 1]: the program exited with status 3; stopping the job (exit 3)" \
        in done.stderr, explain(done)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_sys_exit_gives_the_job_its_status_without_a_traceback(kind: str) -> None:
    """`sys.exit(5)` inside `async with asynclock.start()` on every rank: status 5 and
    no traceback, as Python gives (the runners' own notes about it may remain)."""
    done = run_launcher("-n", "2", "--runner", kind, "--timeout", "120",
                        str(PROGRAMS / "fault_sysexit.py"))
    assert done.returncode == 5, explain(done)
    assert "[0] RANK 0 OK exiting 5" in done.stdout, explain(done)
    assert "Traceback" not in done.stderr and "uncaught" not in done.stderr, explain(done)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_rank_ends_a_job_whose_survivors_hang(kind: str) -> None:
    """Regression (CI, hydra 5.0.2): rank 1 exited with 3 without MPI_Finalize, rank 0
    waited in MPI_Finalize for ever and hydra never ended the job (timeout, 124). The
    trampoline announces the failure, so the launch ends with 3 after --failure-grace."""
    token = f"stuck-{uuid.uuid4().hex}"
    done = run_launcher("-n", "3", "--runner", kind, "--timeout", "100", "--failure-grace", "2",
                        HELLO, "--fail-stuck", token)
    assert done.returncode == 3, explain(done)
    assert "the program exited with status 3; stopping the job (exit 3)" in done.stderr, \
        explain(done)
    assert not _wait_gone(token)


def _wait_gone(token: str) -> list[int]:
    """Processes still carrying `token` after up to 5 s (SIGKILLed ones need a
    moment to be reaped)."""
    for _ in range(50):
        if not processes_with(token):
            break
        subprocess.run(["sleep", "0.1"], check=True)
    return processes_with(token)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_timeout_kills_the_whole_job(kind: str) -> None:
    token = f"hang-{uuid.uuid4().hex}"
    done = run_launcher("-n", "2", "--runner", kind, "--timeout", "8", HELLO, "--hang", token)
    assert done.returncode == launch.TIMEOUT_EXIT, explain(done)
    assert "[0] hanging 0" in done.stdout and "[1] hanging 1" in done.stdout, explain(done)
    assert "timeout after 8s" in done.stderr
    assert not _wait_gone(token)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_runner_that_outlives_a_stopping_rank_is_killed(kind: str) -> None:
    """Hydra never returns once a host is cut off: a rank's 'stopping the job'
    line plus --failure-grace must end the launch with that rank's exit code."""
    token = f"hang-{uuid.uuid4().hex}"
    done = run_launcher("-n", "2", "--runner", kind, "--timeout", "100", "--failure-grace", "2",
                        HELLO, "--hang", "--announce", token)
    assert done.returncode == 3, explain(done)
    assert "asynclock-launch: rank 1 stopped the job (exit 3)" in done.stderr, explain(done)
    assert "the runner has not returned: killing it" in done.stderr, explain(done)
    assert not _wait_gone(token)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", KINDS)
def test_ctrl_c_ends_a_job_blocked_in_mpi(kind: str) -> None:
    """Ctrl-C to the launcher ends a job whose ranks sit inside MPI_Recv (hydra only
    forwards it and waits for a second one) and exits 130, whatever the runner says."""
    token = f"deadlock-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-m", "asynclock.launch", "-n", "2", "--runner",
                             kind, "--timeout", "45", HELLO, "--deadlock", token],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        blocked = set()
        for line in proc.stdout:  # the launcher's --timeout ends this loop at the latest
            blocked |= {line.split()[-1]} if " blocked " in line else set()
            if len(blocked) == 2:
                break
        time.sleep(0.5)  # both ranks inside MPI_Recv
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, len(blocked)) == (130, 2), f"exit {proc.returncode}\n{out}\n{err}"
    assert not _wait_gone(token)


@pytest.mark.mpi
def test_console_script_and_timeline_flag(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("asynclock-launch")
    if not script.exists():
        pytest.skip("console script not installed (pip install -e . again)")
    done = subprocess.run([str(script), "-n", "2", "--timeout", "120", "--timeline",
                           str(tmp_path / "tl"), HELLO], capture_output=True, text=True,
                          timeout=180, cwd=ROOT)
    assert done.returncode == 0, explain(done)
    assert f"timeline={tmp_path / 'tl'}" in done.stdout, explain(done)
    # the program records nothing: the merge says so instead of failing the job
    assert "timeline not merged: no timeline files" in done.stderr, explain(done)


# -- horovodrun -------------------------------------------------------------------------------
@functools.cache
def horovod_missing() -> str:
    """Why horovodrun jobs cannot run here ('' when they can)."""
    if not Path(sys.executable).with_name("horovodrun").exists() and not shutil.which(
            "horovodrun"):
        return "horovodrun is not on the venv PATH"
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True,
                           text=True, timeout=120)
    if probe.returncode != 0:
        return f"import horovod.torch fails: {probe.stderr.strip().splitlines()[-1:]}"
    return ""


HOROVOD_MODES = [("--gloo",), ()] if "system" in KINDS else [("--gloo",)]


@pytest.mark.mpi
@pytest.mark.horovod
@pytest.mark.parametrize("mode", HOROVOD_MODES, ids=lambda m: "gloo" if m else "mpi")
def test_horovodrun_two_ranks(mode: tuple[str, ...]) -> None:
    if reason := horovod_missing():
        pytest.skip(reason)
    done = run_launcher("-n", "2", "--runner", "horovodrun", *mode, "--timeout", "240", HVD,
                        timeout=300)
    assert done.returncode == 0, explain(done)
    for rank in (0, 1):
        assert f"[{rank}] hvd hello from {rank} of 2\n" in done.stdout, explain(done)
    assert "<stdout>" not in done.stdout, explain(done)


@pytest.mark.mpi
@pytest.mark.horovod
def test_horovodrun_failing_rank_fails_the_launch() -> None:
    if reason := horovod_missing():
        pytest.skip(reason)
    done = run_launcher("-n", "2", "--gloo", "--timeout", "240", HVD, "--fail", timeout=300)
    assert done.returncode not in (0, launch.TIMEOUT_EXIT), explain(done)


def test_stopping_announcement_is_parsed_behind_any_tag() -> None:
    line = b"[1,1]<stderr>:asynclock[rank 1]: rank 0 is unreachable: ...; stopping the job (exit 3)"
    seen = jobwatch.parse_stopping(line, 7.0)
    assert seen == jobwatch.Stopping(rank=1, exit_code=3, seen_at=7.0)
    assert jobwatch.parse_stopping(b"[0] stopping the job (exit 3)", 0.0) is None


def test_overdue_verdicts() -> None:
    now = time.monotonic()
    late = jobwatch.Stopping(2, 4, now - 30)
    assert jobwatch._overdue(None, None, 20, None) is None
    assert jobwatch._overdue(jobwatch.Stopping(2, 4, now), None, 20, None) is None
    code, text = jobwatch._overdue(late, None, 20, None) or (0, "")
    assert code == 4 and text.startswith("rank 2 stopped the job (exit 4) 30 s ago")
    code, text = jobwatch._overdue(late, now - 1, 20, 5.0) or (0, "")
    assert (code, text) == (launch.TIMEOUT_EXIT, "timeout after 5s: killing the job")


def test_job_status_prefers_the_failed_ranks_code(capsys: pytest.CaptureFixture[str]) -> None:
    """hydra reports 9 for the survivors it SIGKILLed, or (a race) 0 after a rank's 3."""
    failed = jobwatch.Stopping(1, 3, time.monotonic())
    assert jobwatch.job_status(9, failed) == 3
    assert "rank 1 failed (exit 3); the runner returned 9" in capsys.readouterr().err
    assert jobwatch.job_status(0, failed) == 3
    assert jobwatch.job_status(3, failed) == 3 and capsys.readouterr().err.count("failed") == 1
    assert jobwatch.job_status(9, None) == 9 and jobwatch.job_status(0, None) == 0
