"""A private one-node Slurm for tests: munged, slurmctld and slurmd, started as root.

Everything lives in one temporary folder: the munge key and socket, slurm.conf,
the controller's state, slurmd's spool, the pid and log files. The daemons use
free ports and their own munge socket, so a Slurm or munge already running on
the machine is neither used nor disturbed; clients find this cluster through
`SLURM_CONF` in `Cluster.env`.

    cluster = slurm_cluster.start()       # raises Unavailable(why) when it cannot
    cluster.run(["sinfo"])
    cluster.stop()                         # cancels jobs, ends every process it started

`launch/setup.sh` installs Debian's slurm-wlm and munge as root
(`launch/install_slurm.sh`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "salloc", "scancel", "sinfo", "squeue", "scontrol")
START_S = 30.0  # the node reports idle within this, or the cluster is unavailable
STOP_S = 15.0
# Tasks a job may start on the node whatever its core count: tests run 2-3 ranks on
# 2 cores, and a cancelled job that is still completing must not hold the next one.
NODE_CPUS = 8


class Unavailable(Exception):
    """Slurm cannot run here; the message says exactly why."""


def missing() -> str:
    """Why no private Slurm can start here ('' when it can be tried)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the daemons run as root (SlurmUser=root) and this is not root"
    absent = [name for name in DAEMONS + CLIENTS + ("munge",) if not _which(name)]
    if absent:
        return (f"not installed: {', '.join(absent)} (as root: bash launch/install_slurm.sh, "
                "or launch/setup.sh with ASYNCLOCK_SETUP_SYSTEM_MPI=1)")
    return ""


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join(
        [os.environ.get("PATH", os.defpath), "/usr/sbin", "/sbin"]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Cluster:
    """A running private cluster; `env` is the environment its clients need."""

    root: Path
    node: str
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def run(self, argv: Sequence[str], timeout: float = 60, cwd: str | Path | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """A client command against this cluster; stdout and stderr kept apart."""
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              cwd=cwd, env={**self.env, **(env or {})})

    def logs(self, lines: int = 12) -> str:
        """Each daemon's last log lines (its console output where it logged nothing, as
        when it cannot read its configuration), for failure messages."""
        out = []
        for name in DAEMONS:
            for path in (self.root / "log" / f"{name}.log", self.root / "log" / f"{name}.out"):
                text = path.read_text(errors="replace").splitlines() if path.exists() else []
                if text:
                    out.append(f"--- {path.name} (last {lines} lines) ---\n"
                               + "\n".join(text[-lines:]))
                    break
        return "\n".join(out)

    def node_state(self) -> str:
        done = self.run(["sinfo", "-h", "-N", "-n", self.node, "-o", "%T"], timeout=15)
        return done.stdout.strip() if done.returncode == 0 else f"sinfo failed: {done.stderr}"

    def stop(self) -> list[int]:
        """Cancel every job, stop the daemons, kill whatever they left; the pids killed."""
        if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
            try:
                self.run(["scancel", "--full", "--user", "root"], timeout=15)
                deadline = time.monotonic() + STOP_S
                while time.monotonic() < deadline and self.run(
                        ["squeue", "-h", "-o", "%i"], timeout=15).stdout.strip():
                    time.sleep(0.2)
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(DAEMONS):
            proc = self.daemons.get(name)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(STOP_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        leftovers = self.processes()
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)
        return leftovers

    def processes(self) -> list[int]:
        """Processes of this cluster: slurmstepd and every job process inherit
        SLURM_CONF naming this cluster's file, which nothing else has."""
        mark = f"SLURM_CONF={self.conf}".encode() + b"\0"
        found = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    if mark in (entry / "environ").read_bytes():
                        found.append(int(entry.name))
                except OSError:
                    continue
        return found


def _write_conf(root: Path, node: str) -> None:
    ctld_port, slurmd_port = _free_port(), _free_port()
    # A fresh range of job ids each start: runs/<jobid>/ of an earlier run is never reused.
    first_job = 100_000 + secrets.randbelow(50_000_000)
    # proctrack/linuxproc and task/none need no cgroups (containers, VMs without systemd);
    # linuxproc still finds every descendant of a step, so scancel reaches each rank.
    # KillWait=5: scancel's SIGKILL follows its SIGTERM after 5 s, not 30.
    # MinJobAge=4: `sbatch --wait` polls after 2 s and quadruples the interval while it is
    # below MinJobAge / 2 (2, 8, 8 s with the default), so it stays at 2 s.
    # config_overrides: NODE_CPUS is taken as given, not checked against the hardware.
    (root / "slurm.conf").write_text(f"""\
ClusterName=asynclock-test
SlurmctldHost={node}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root / 'munge' / 'munge.socket'}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd.pid'}
SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
SlurmdLogFile={root / 'log' / 'slurmd.log'}
FirstJobId={first_job}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
SlurmdParameters=config_overrides
KillWait=5
MinJobAge=4
InactiveLimit=0
MailProg=/bin/true
NodeName={node} NodeAddr=127.0.0.1 CPUs={NODE_CPUS} State=UNKNOWN
PartitionName=test Nodes={node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")


def _spawn(cluster: Cluster, name: str, argv: list[str]) -> None:
    log = open(cluster.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 (the daemon keeps it)
    cluster.daemons[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, env=cluster.env,
                                             start_new_session=True)
    log.close()


def _check_alive(cluster: Cluster) -> None:
    for name, proc in cluster.daemons.items():
        if proc.poll() is not None:
            raise Unavailable(f"{name} exited with status {proc.returncode}\n" + cluster.logs())


def start() -> Cluster:
    """Start munged, slurmctld and slurmd; return once the node is idle."""
    if why := missing():
        raise Unavailable(why)
    root = Path(tempfile.mkdtemp(prefix="asynclock-slurm-"))
    node = socket.gethostname().split(".")[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_",
                                                                     "SALLOC_", "SRUN_"))}
    env["SLURM_CONF"] = str(root / "slurm.conf")
    cluster = Cluster(root, node, env)
    try:
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir()
        munge = root / "munge"
        munge.mkdir(mode=0o711)  # clients reach the socket inside
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o600)
        _write_conf(root, node)
        _spawn(cluster, "munged", [
            str(_which("munged")), "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
            f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={root / 'log' / 'munged.log'}", f"--seed-file={munge / 'seed'}"])
        _wait_for(cluster, lambda: (munge / "munge.socket").exists(), "munged's socket")
        conf = str(cluster.conf)
        _spawn(cluster, "slurmctld", [str(_which("slurmctld")), "-D", "-i", "-f", conf])
        _spawn(cluster, "slurmd", [str(_which("slurmd")), "-D", "-f", conf])
        _wait_for(cluster, lambda: cluster.node_state() == "idle", f"node {node} idle in sinfo")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _wait_for(cluster: Cluster, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        _check_alive(cluster)
        if time.monotonic() > deadline:
            state = cluster.node_state() if "slurmctld" in cluster.daemons else "-"
            raise Unavailable(f"no {what} after {START_S:.0f} s (node state: {state})\n"
                              + cluster.logs())
        time.sleep(0.2)
