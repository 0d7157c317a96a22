"""Slurm for real: a private one-node cluster (tests/slurm_cluster.py) runs
launch/slurm.sbatch, plain `srun -n 2` on each MPI with the plugin it answers to,
and `python -m asynclock.launch` inside an allocation; exit codes and `scancel`
end every rank. Skipped, with the reason, where the daemons cannot start."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import slurm_cluster
from mpijob import DEFAULT_KIND, PROGRAMS, ROOT, Job, processes_with

from asynclock._tools import mpi_select
from asynclock.launch import SRUN_PLUGINS

pytestmark = pytest.mark.mpi

PROGRAM = str(PROGRAMS / "slurm_job.py")
JOB_S = 90  # any one job; a hang fails with the job's output instead of holding CI
CANCEL_S = 20  # scancel to the last process gone: KillWait (5 s) and a margin
VENDOR = {"system": "OpenMPI", "embedded": "MPICH"}  # as mpi4py's get_vendor() spells it
KINDS = [k for k, ok in mpi_select.available().items() if ok]


@pytest.fixture(scope="module")
def cluster() -> Iterator[slurm_cluster.Cluster]:
    try:
        running = slurm_cluster.start()
    except slurm_cluster.Unavailable as exc:
        pytest.skip(f"no private Slurm cluster: {exc}")
    yield running
    left = running.stop()
    assert not left, f"processes of the cluster outlived its daemons (killed): {left}"


def job_env(cluster: slurm_cluster.Cluster, kind: str) -> dict[str, str]:
    """What a user's shell gives sbatch/salloc: the venv, the MPI choice, no MPI set up."""
    env = {k: v for k, v in cluster.env.items()
           if not k.startswith(("OMPI_", "MPI4PY_", "ASYNCLOCK_MPI", "PMIX_", "PMI_"))}
    env.update(ASYNCLOCK_MPI=kind, ASYNCLOCK_VENV=sys.prefix, OMP_NUM_THREADS="1")
    return env


def plugin_missing(cluster: slurm_cluster.Cluster, plugin: str) -> str:
    listed = cluster.run(["srun", "--mpi=list"], timeout=30)
    names = listed.stdout + listed.stderr
    return "" if f"\t{plugin}\n" in names or f" {plugin}\n" in names else \
        f"srun has no {plugin} plugin: {names.strip()}"


def wait_gone(token: str, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while (left := processes_with(token)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def run_client(cluster: slurm_cluster.Cluster, argv: list[str], env: dict[str, str],
               token: str, timeout: float = JOB_S) -> Job:
    """salloc/srun/`sbatch --wait` in the foreground; on timeout the job named `token`
    is cancelled and the test fails with what it printed."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        cluster.run(["scancel", f"--name={token}"], timeout=30)
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{argv[0]} did not return within {timeout} s (job cancelled)\n"
                    f"--- output ---\n{out}\n{cluster.logs()}")
    return Job(proc.returncode, out, argv)


def sbatch_recipe(cluster: slurm_cluster.Cluster, tmp_path: Path, token: str, kind: str,
                  *program: str, wait: bool = True) -> tuple[str, Job]:
    """`sbatch [--wait] launch/slurm.sbatch ...` from the repository, as the recipe says,
    sized to one node with 2 tasks; the job id and sbatch's outcome."""
    argv = ["sbatch", "--parsable", f"--job-name={token}", "--nodes=1", "--ntasks-per-node=2",
            "--cpus-per-task=1", f"--output={tmp_path}/%x-%j.out",
            *(["--wait"] if wait else []), "launch/slurm.sbatch", *program]
    job = run_client(cluster, argv, job_env(cluster, kind), token)
    found = re.search(r"^(\d+)(?:;\S*)?$", job.output, re.MULTILINE)
    assert found, job.explain()
    return found.group(1), job


def job_output(tmp_path: Path, token: str, jobid: str) -> str:
    path = tmp_path / f"{token}-{jobid}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"


def remove_run_folder(jobid: str) -> None:
    shutil.rmtree(ROOT / "runs" / jobid, ignore_errors=True)
    with contextlib.suppress(OSError):  # only when no other run is kept there
        (ROOT / "runs").rmdir()


def check_ranks(job: Job, kind: str, nranks: int = 2) -> None:
    """Every rank saw a world of `nranks` on `kind`'s MPI and finished."""
    assert job.returncode == 0, job.explain()
    want = f"size={nranks} sum={nranks * (nranks + 1) // 2}"
    for rank in range(nranks):
        line = next((ln for ln in job.output.splitlines() if f"RANK {rank} OK allreduce" in ln),
                    "")
        assert want in line and f"mpi={VENDOR[kind]}" in line, job.explain()
    assert job.ok_lines("done") == set(range(nranks)), job.explain()


# -- the recipe ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(JOB_S + 30)
def test_sbatch_recipe_runs_quickstart(cluster: slurm_cluster.Cluster, tmp_path: Path,
                                       kind: str) -> None:
    """`ASYNCLOCK_MPI=KIND sbatch launch/slurm.sbatch examples/quickstart.py`: both ranks'
    tagged lines in the job's output file, and the merged timeline under runs/<jobid>/."""
    token = f"quick-{uuid.uuid4().hex[:8]}"
    jobid, job = sbatch_recipe(cluster, tmp_path, token, kind, "examples/quickstart.py")
    try:
        out = job_output(tmp_path, token, jobid)
        assert job.returncode == 0, job.explain() + out
        for rank in (0, 1):
            assert f"[{rank}] [rank {rank}/2] sum=[3.0, 3.0, 3.0, 3.0] mean=1.50 50 in-flight " \
                   "ok=True" in out, out
        assert f"[0] summary: 2 ranks on mpi ({VENDOR[kind][:4]}" in out, out
        merged = ROOT / "runs" / jobid / "timeline.json"
        assert f"timeline runs/{jobid}/timeline.json: " in out, out
        info = json.loads(merged.read_text())["otherData"]["asynclock"]
        assert info["ranks"] == [0, 1], info
    finally:
        remove_run_folder(jobid)


@pytest.mark.timeout(JOB_S + 30)
def test_failed_rank_gives_the_job_its_exit_code(cluster: slurm_cluster.Cluster,
                                                 tmp_path: Path) -> None:
    """A rank that exits 3 ends the whole job with 3 (`srun --kill-on-bad-exit` stops the
    step; the launcher returns the failed rank's own code) and no rank outlives it."""
    token = f"fail-{uuid.uuid4().hex[:8]}"
    jobid, job = sbatch_recipe(cluster, tmp_path, token, DEFAULT_KIND, PROGRAM,
                               "--fail-rank", "1", "--code", "3", token)
    try:
        out = job_output(tmp_path, token, jobid)
        assert job.returncode == 3, job.explain() + out
        assert "[1] asynclock[rank 1]: the program exited with status 3; stopping the job " \
               "(exit 3)" in out, out
        assert not wait_gone(token, 10), out
    finally:
        remove_run_folder(jobid)


@pytest.mark.timeout(JOB_S + 60)
def test_scancel_ends_every_rank(cluster: slurm_cluster.Cluster, tmp_path: Path) -> None:
    """`scancel` of a running recipe job: the launcher, srun and every rank are gone
    within KillWait (5 s) and a margin, and the launcher, sent SIGTERM with the ranks,
    still merges their timeline under runs/<jobid>/."""
    token = f"cancel-{uuid.uuid4().hex[:8]}"
    jobid, _ = sbatch_recipe(cluster, tmp_path, token, DEFAULT_KIND, PROGRAM, "--hang", token,
                             wait=False)
    try:
        deadline = time.monotonic() + JOB_S
        while Job(0, job_output(tmp_path, token, jobid), []).ok_lines("hanging") != {0, 1}:
            ended = not cluster.run(["squeue", "-h", "-j", jobid], timeout=30).stdout.strip()
            if ended or time.monotonic() > deadline:
                why = "the job ended" if ended else f"not within {JOB_S} s"
                pytest.fail(f"the ranks never reported hanging: {why}\n"
                            + job_output(tmp_path, token, jobid) + cluster.logs())
            time.sleep(0.2)
        running = processes_with(token)
        assert len(running) >= 5, running  # the launcher, srun, 2 x (trampoline, program)
        cancelled = cluster.run(["scancel", jobid], timeout=30)
        assert cancelled.returncode == 0, cancelled.stderr
        left = wait_gone(token, CANCEL_S)
        assert not left, f"still running {CANCEL_S} s after scancel: {left}\n" + job_output(
            tmp_path, token, jobid)
        out = job_output(tmp_path, token, jobid)
        assert f"timeline runs/{jobid}/timeline.json: " in out, out  # merged by the launcher
        merged = json.loads((ROOT / "runs" / jobid / "timeline.json").read_text())
        assert merged["otherData"]["asynclock"]["ranks"] == [0, 1], out
    finally:
        cluster.run(["scancel", jobid], timeout=30)
        remove_run_folder(jobid)


# -- srun and the launcher on each MPI -----------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(JOB_S + 30)
def test_srun_two_ranks(cluster: slurm_cluster.Cluster, kind: str) -> None:
    """`srun -n 2 --mpi=<plugin> python prog`: a world of 2 on Open MPI with pmix, on the
    venv's MPICH with pmi2."""
    plugin = SRUN_PLUGINS[mpi_select.describe(kind)["vendor"]]
    if why := plugin_missing(cluster, plugin):
        pytest.skip(why)
    token = f"srun-{uuid.uuid4().hex[:8]}"
    env = mpi_select.environ_for(kind, job_env(cluster, kind))
    job = run_client(cluster, ["srun", "-n", "2", f"--mpi={plugin}", "--kill-on-bad-exit=1",
                               f"--job-name={token}", sys.executable, PROGRAM, token], env, token)
    check_ranks(job, kind)


@pytest.mark.timeout(JOB_S + 30)
def test_mpich_without_its_plugin_runs_singletons(cluster: slurm_cluster.Cluster) -> None:
    """Why the launcher names the plugin: under srun's default (MpiDefault=none here)
    MPICH starts every rank as a world of its own, and says nothing."""
    if "embedded" not in KINDS:
        pytest.skip("the venv's MPICH is not installed")
    token = f"none-{uuid.uuid4().hex[:8]}"
    env = mpi_select.environ_for("embedded", job_env(cluster, "embedded"))
    job = run_client(cluster, ["srun", "-n", "2", "--mpi=none", f"--job-name={token}",
                               sys.executable, PROGRAM, token], env, token)
    assert job.returncode == 0, job.explain()
    assert job.output.count("OK allreduce size=1 sum=1") == 2, job.explain()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.timeout(JOB_S + 30)
def test_launcher_inside_an_allocation_runs_srun(cluster: slurm_cluster.Cluster, kind: str,
                                                 tmp_path: Path) -> None:
    """`salloc -n 2 python -m asynclock.launch --mpi KIND prog`: the launcher sees the
    allocation, runs the ranks as an srun step with KIND's plugin, tags their lines
    and merges their timeline."""
    token = f"salloc-{uuid.uuid4().hex[:8]}"
    argv = ["salloc", "-n", "2", f"--job-name={token}", sys.executable, "-m", "asynclock.launch",
            "--mpi", kind, "--timeout", "60", "--timeline", str(tmp_path / "tl"), PROGRAM, token]
    job = run_client(cluster, argv, job_env(cluster, kind), token)
    check_ranks(job, kind)
    for rank in (0, 1):  # an srun step (SLURM_STEP_ID), behind the launcher's tags
        assert any(ln.startswith(f"[{rank}] RANK {rank} OK allreduce") and ".0 mpi=" in ln
                   for ln in job.output.splitlines()), job.explain()
    assert f"timeline {tmp_path / 'tl'}.json: " in job.output, job.explain()
