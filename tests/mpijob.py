"""Start real MPI jobs from tests, with a hard timeout and every rank's output.

Each rank program prints `RANK <r> OK <label>` lines; tests assert on them,
so a job that exits 0 without doing the work still fails.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = Path(__file__).resolve().parent / "programs"
from asynclock._tools import mpi_select  # noqa: E402

MPI_KIND = os.environ.get("ASYNCLOCK_TEST_MPI", "auto")
DEFAULT_KIND = mpi_select.resolve(MPI_KIND)
# The other MPI, when installed: core tests run on it too (the README's promise
# is "the MPI setup installs, and Open MPI 4").
OTHER_KINDS = [k for k, ok in mpi_select.available().items() if ok and k != DEFAULT_KIND]



def crossed(cases: list[tuple[object, ...]], default: str = MPI_KIND) -> list[object]:
    """pytest params (kind, *case) for every MPI and case: CI runs `default` with the
    first case and each other MPI with the second; the other pairings run with --long."""
    import pytest

    return [pytest.param(kind, *case, marks=[] if (kind == default) == (i == 0)
                         else [pytest.mark.slow])
            for kind in (default, *OTHER_KINDS) for i, case in enumerate(cases)]


_OK = re.compile(r"RANK (\d+) OK (\S+)")


@dataclass
class Job:
    """Outcome of one mpiexec run."""

    returncode: int
    output: str
    cmd: list[str]

    def ok_lines(self, label: str) -> set[int]:
        """Ranks that printed `RANK r OK label`, also where another rank's unfinished
        line (a `print` is two writes) ran into it: ranks share one pipe."""
        return {int(m.group(1)) for m in _OK.finditer(self.output) if m.group(2) == label}

    def explain(self) -> str:
        return (f"command: {' '.join(self.cmd)}\nexit: {self.returncode}\n"
                f"--- output ---\n{self.output}")


def run_job(program: str, nranks: int, *args: str, timeout: float = 120,
            env: dict[str, str] | None = None, kind: str = MPI_KIND,
            launcher: list[str] | None = None) -> Job:
    """Run tests/programs/<program> on `nranks` ranks; kill the job on timeout."""
    full_env = mpi_select.environ_for(kind)
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                     "PYTHONPATH": str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")})
    full_env.update(env or {})
    prefix = launcher if launcher is not None else mpi_select.launcher(kind, nranks)
    cmd = [*prefix, sys.executable, str(PROGRAMS / program), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        return Job(-9, out + f"\n*** TIMEOUT after {timeout}s: job killed ***", cmd)
    return Job(proc.returncode, out, cmd)


def assert_all_ok(job: Job, nranks: int, label: str = "done") -> None:
    """Exit 0 and every rank reported `label`."""
    assert job.returncode == 0, job.explain()
    missing = set(range(nranks)) - job.ok_lines(label)
    assert not missing, f"ranks {sorted(missing)} did not report {label!r}\n" + job.explain()


def assert_labels(job: Job, nranks: int, *labels: str) -> None:
    """`assert_all_ok`, and every rank reported each of `labels`."""
    assert_all_ok(job, nranks)
    for label in labels:
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"


# -- Horovod: plain mpirun with ASYNCLOCK_BACKEND=horovod, or horovodrun -----------------
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
_HOROVOD_TAG = re.compile(r"^\[[\d,]+\]<std(?:out|err)>:", re.MULTILINE)


@functools.cache
def horovod_status() -> tuple[str, str]:
    """(MPI kind Horovod was built for, "") or ("", why Horovod jobs cannot run here).

    Probed in a subprocess: importing Horovod loads its libmpi, which must not
    land in the pytest process.
    """
    probe = subprocess.run([sys.executable, "-c", "import horovod.torch"], capture_output=True,
                           text=True, timeout=180, env=mpi_select.environ_for(DEFAULT_KIND))
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return "", f"import horovod.torch fails: {last}"
    stamp = Path(sys.prefix) / "asynclock-horovod-key.json"
    kind = json.loads(stamp.read_text()).get("mpi_kind") if stamp.exists() else DEFAULT_KIND
    if not mpi_select.available().get(kind, False):
        return "", f"Horovod was built for the {kind} MPI, which is not installed"
    return kind, ""


def horovodrun_missing(gloo: bool) -> str:
    """Why `horovodrun [--gloo]` jobs cannot run here ("" when they can)."""
    kind, why = horovod_status()
    if why:
        return why
    if not HOROVODRUN.exists():
        return f"{HOROVODRUN} does not exist"
    if not gloo and kind != "system":
        return f"horovodrun's MPI controller needs Open MPI; Horovod is built for {kind}"
    return ""


def __getattr__(name: str) -> object:
    """`HOROVOD_AVAILABLE` / `HOROVOD_MPI` are probed on first use, not at import."""
    if name == "HOROVOD_AVAILABLE":
        return not horovod_status()[1]
    if name == "HOROVOD_MPI":
        return horovod_status()[0] or DEFAULT_KIND
    raise AttributeError(name)


def activated_venv_env() -> dict[str, str]:
    """The environment of a shell after `source .venv/bin/activate`: the venv's bin/
    (MPICH's mpirun included) first on PATH, and no MPI set up by the kit."""
    venv = Path(sys.prefix)
    ours = {str(venv / "bin"), str(mpi_select.shim_dir())}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "MPI4PY_", "ASYNCLOCK_MPI"))}
    rest = [p for p in env.get("PATH", os.defpath).split(os.pathsep) if p and p not in ours]
    env.update(PATH=os.pathsep.join([str(venv / "bin"), *rest]), VIRTUAL_ENV=str(venv))
    return env


def run_horovodrun(program: str, nranks: int, *args: str, gloo: bool = False,
                   timeout: float = 180, env: dict[str, str] | None = None,
                   activated: bool = False) -> Job:
    """Run tests/programs/<program> under `horovodrun -np N [--gloo]`; kill it on timeout.

    The MPI controller needs Open MPI's mpirun first on PATH (the kit's shim
    dir); the gloo controller needs no MPI at all. `activated`: as a user types
    it with the venv active, `horovodrun ... python prog.py` found on PATH and
    nothing else set up. Output tags such as `[1,0]<stdout>:` are stripped so
    `Job.ok_lines` reads the rank lines.
    """
    if activated:
        full_env = activated_venv_env()
    else:
        full_env = dict(os.environ) if gloo else mpi_select.environ_for("system")
    full_env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                     "PYTHONPATH": str(ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")})
    full_env.update(env or {})
    exe, python = ("horovodrun", "python") if activated else (str(HOROVODRUN), sys.executable)
    cmd = [exe, "-np", str(nranks), *(["--gloo"] if gloo else []),
           python, str(PROGRAMS / program), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=full_env, cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = _stop_horovodrun(proc)
        return Job(-9, out + f"\n*** TIMEOUT after {timeout}s: job killed ***", cmd)
    return Job(proc.returncode, _HOROVOD_TAG.sub("", out), cmd)


def _stop_horovodrun(proc: subprocess.Popen[str]) -> str:
    """SIGTERM first: horovodrun then stops the ranks it started in their own
    process groups, which a SIGKILL of its group alone would leave running."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
    return out


def processes_with(token: str) -> list[int]:
    """Pids of the processes whose command line holds `token` (a job's own marker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
