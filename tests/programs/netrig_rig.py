"""Drive the netrig test cluster (../shared/netrig) from Python: shared by
tests/test_netrig.py and bench/netrig.py (not a rank program).

netrig makes hosts nr1..nrN, each a network namespace joined by a switch
whose links can be rate-limited or cut, so every byte between MPI ranks on
different hosts crosses real TCP. The namespaces have fixed names, so only
one rig can exist on a machine: `Rig` holds an exclusive file lock for its
whole life, and `close()` always ends what is left inside the namespaces
(processes this rig's jobs started there) before `netrig down`.

Launchers hang when a host is cut off: Open MPI's mpirun waits for the
unreachable orted and MPICH's mpiexec for its unreachable proxy, for ever
(no heartbeat on their control connections). `LiveJob.finish` therefore
takes a deadline, and reports whether the launcher returned by itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from netrig_live import LiveJob, cmdline, wait_gone

from asynclock._tools import mpi_select

ROOT = Path(__file__).resolve().parents[2]

SUBNET = "10.77.0.0/24"  # netrig's hosts
SSH_SHIM = """#!/bin/sh
host=
while [ $# -gt 0 ]; do
  case "$1" in
    -[oilpFJ]) shift 2 ;;
    -*) shift ;;
    *) if [ -n "$host" ]; then break; fi; host=$1; shift ;;
  esac
done
exec {netrig_ssh} "$host" "$@"
"""
LOCK_PATH = Path(os.environ.get("ASYNCLOCK_NETRIG_LOCK", "/tmp/asynclock-netrig.lock"))
KEEPALIVE_PROBES = 3  # Open MPI's control connections: probes 1 s apart after the idle time


def find_netrig() -> Path | None:
    """$ASYNCLOCK_NETRIG, else ../shared/netrig/netrig next to the repo, else PATH."""
    forced = os.environ.get("ASYNCLOCK_NETRIG")
    candidates = [Path(forced)] if forced else [ROOT.parent / "shared" / "netrig" / "netrig"]
    on_path = shutil.which("netrig")
    candidates += [Path(on_path)] if on_path and not forced else []
    return next((p for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def unavailable() -> str | None:
    """Why no rig can be made here (None: it can)."""
    if not sys.platform.startswith("linux"):
        return "netrig needs Linux network namespaces"
    if os.geteuid() != 0:
        return "netrig needs root (network namespaces, veth, tc)"
    missing = [t for t in ("ip", "unshare", "tc") if shutil.which(t) is None]
    if missing:
        return f"netrig needs {', '.join(missing)} (iproute2, util-linux)"
    if find_netrig() is None:
        return "netrig script not found (set ASYNCLOCK_NETRIG or check out ../shared/netrig)"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True,
                           timeout=30, check=False)
    if probe.returncode != 0:
        return f"cannot make network namespaces here: {probe.stderr.strip()[:200]}"
    return None


def ompi_keepalive(env: Mapping[str, str]) -> dict[str, str]:
    """Open MPI's mpirun and orteds notice a lost host only by TCP keepalive on their
    control connections (default: 300 s idle, then 9 probes 20 s apart). Set it to
    fire a few seconds after asynclock's watchdog has stopped the ranks (dead after
    + failure grace): earlier, mpirun kills every rank before any says what happened."""
    dead = float(env.get("ASYNCLOCK_DEAD_AFTER_S") or 10.0)
    grace = float(env.get("ASYNCLOCK_FAILURE_GRACE_S") or 2.0)
    return {"OMPI_MCA_oob_tcp_keepalive_time": str(math.ceil(dead + grace)),
            "OMPI_MCA_oob_tcp_keepalive_intvl": "1",
            "OMPI_MCA_oob_tcp_keepalive_probes": str(KEEPALIVE_PROBES)}


def mpi_vendor(kind: str) -> str:
    """'openmpi' (netrig mpirun) or 'hydra' (netrig mpiexec) for an MPI kind."""
    return "openmpi" if mpi_select.describe(kind)["vendor"] == "Open MPI" else "hydra"


class Rig:
    """One netrig cluster, held exclusively; use as a context manager."""

    def __init__(self, netrig: Path | None = None, lock_timeout: float = 900.0) -> None:
        found = netrig or find_netrig()
        if found is None:
            raise RuntimeError(unavailable() or "netrig not found")
        self.netrig = found
        self.hosts: list[str] = []
        self._lock_file: IO[str] | None = None
        self._lock_timeout = lock_timeout
        self._shims: str | None = None

    def __enter__(self) -> Rig:
        self._lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- life cycle -------------------------------------------------------------------
    def _lock(self) -> None:
        """Wait for any other rig user on this machine (bounded)."""
        self._lock_file = open(LOCK_PATH, "a")  # noqa: SIM115 - held until close()
        deadline = time.monotonic() + self._lock_timeout
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock_file.close()
                    self._lock_file = None
                    raise TimeoutError(f"another netrig user holds {LOCK_PATH}") from None
                time.sleep(0.5)

    def up(self, n: int, rate: str | None = None, tcp_retries2: int | None = None) -> list[str]:
        """Make hosts nr1..nrN. `tcp_retries2` shortens how long a host's TCP keeps
        retrying an unreachable peer (a launcher daemon on a cut host then exits)."""
        out = self._netrig("up", str(n), *([rate] if rate else []))
        self.hosts = out.strip().split(",")
        if tcp_retries2 is not None:
            for host in self.hosts:
                self._in(host, "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={tcp_retries2}")
        return self.hosts

    def close(self) -> list[str]:
        """End what is left in the namespaces, remove them, release the lock."""
        try:
            left = self.reap()
            self._netrig("down")
            self.hosts = []
            return left
        finally:
            if self._shims is not None:
                shutil.rmtree(self._shims, ignore_errors=True)
                self._shims = None
            if self._lock_file is not None:
                self._lock_file.close()
                self._lock_file = None

    def common_nic(self, name: str = "hvd0") -> None:
        """Give every host an interface called `name` (a macvlan on its link, address
        10.77.0.(100+i)): horovodrun wants one NIC name common to all hosts, and
        netrig names each host's link differently (nr1e, nr2e, ...)."""
        for i, host in enumerate(self.hosts, 1):
            for cmd in (f"link add link {host}e name {name} type macvlan mode bridge",
                        f"addr add 10.77.0.{100 + i}/24 dev {name} noprefixroute",
                        f"link set {name} up"):
                subprocess.run(["ip", "-n", host, *cmd.split()], check=True, timeout=30,
                               capture_output=True)

    # -- links --------------------------------------------------------------------------
    def cut(self, host: str) -> None:
        self._netrig("cut", host)

    def heal(self, host: str) -> None:
        self._netrig("heal", host)

    def rate(self, rate: str | None) -> None:
        self._netrig("rate", rate or "none")

    def rx_bytes(self, host: str) -> int:
        return int(self._netrig("bytes", host).strip() or 0)

    # -- processes inside the namespaces ----------------------------------------------------
    def pids(self) -> dict[str, list[int]]:
        """Processes running inside each host's namespace (all started by our jobs)."""
        found: dict[str, list[int]] = {}
        for host in self._existing_hosts():
            out = subprocess.run(["ip", "netns", "pids", host], capture_output=True, text=True,
                                 timeout=30, check=False).stdout
            found[host] = [int(p) for p in out.split()]
        return found

    def leftovers(self) -> list[str]:
        """`host pid command` of every process still inside a host."""
        return [f"{host} {pid} {cmdline(pid)}" for host, pids in self.pids().items()
                for pid in pids]

    def reap(self) -> list[str]:
        """SIGKILL every process still inside a host; what was there."""
        left = self.leftovers()
        pids = [pid for found in self.pids().values() for pid in found]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_gone(pids, 5.0)
        return left

    def _existing_hosts(self) -> list[str]:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                             timeout=30, check=False).stdout
        return [n for n in (line.split()[0] for line in out.splitlines() if line.strip())
                if re.fullmatch(r"nr\d+", n)]

    # -- jobs -------------------------------------------------------------------------------
    def environ(self, kind: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The MPI kind's environment (mpi_select) for ranks on every host."""
        env: dict[str, str] = dict(mpi_select.environ_for(kind))
        env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                env.get("PYTHONPATH")]))})
        env.update(extra or {})
        if mpi_vendor(kind) == "openmpi":
            env.update({k: v for k, v in ompi_keepalive(env).items() if k not in env})
        return env

    def launcher_env(self, kind: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """For a launcher started inside a host (`run_on`) that reaches the others by
        "ssh": what `netrig mpiexec` / `netrig mpirun` put on their command lines, as
        environment, and an `ssh` on PATH that enters a host (for horovodrun)."""
        env = self.environ(kind, extra)
        ssh = str(self.netrig.with_name("netrig-ssh"))
        env.update(HYDRA_LAUNCHER="ssh", HYDRA_LAUNCHER_EXEC=ssh, UCX_TLS="tcp,self",
                   MPIR_CVAR_CH4_NETMOD="ucx", MPIR_CVAR_NOLOCAL="1",
                   OMPI_MCA_plm_rsh_agent=ssh, OMPI_MCA_btl="tcp,self", OMPI_MCA_pml="ob1",
                   OMPI_MCA_btl_tcp_if_include=SUBNET, OMPI_MCA_oob_tcp_if_include=SUBNET)
        env["PATH"] = f"{self._ssh_dir(ssh)}{os.pathsep}{env.get('PATH', '')}"
        return env

    def _ssh_dir(self, ssh: str) -> str:
        """A dir with an `ssh` that takes options after the host too (horovodrun puts
        `-o ConnectTimeout=10` there), then enters the host through netrig-ssh."""
        if self._shims is None:
            self._shims = tempfile.mkdtemp(prefix="netrig-ssh-")
            path = Path(self._shims) / "ssh"
            path.write_text(SSH_SHIM.format(netrig_ssh=ssh))
            path.chmod(0o755)
        return self._shims

    def launch_argv(self, kind: str, nranks: int, argv: Sequence[str],
                    per_host: int = 1) -> list[str]:
        """`per_host` ranks on each host, in host order (ranks 0..per_host-1 on nr1),
        through netrig's launcher."""
        used = self.hosts[:math.ceil(nranks / per_host)]
        if mpi_vendor(kind) == "openmpi":
            hosts = ",".join(f"{h}:{per_host}" if per_host > 1 else h for h in used)
            return [str(self.netrig), "mpirun", "-np", str(nranks), "-H", hosts, *argv]
        return [str(self.netrig), "mpiexec", "-n", str(nranks), "-ppn", str(per_host), *argv]

    def start(self, kind: str, nranks: int, argv: Sequence[str],
              env: Mapping[str, str] | None = None,
              failure_grace: float | None = None, per_host: int = 1) -> LiveJob:
        """Start `argv` (e.g. [python, prog.py, ...]) as `nranks` ranks, `per_host`
        on each host."""
        if nranks > per_host * len(self.hosts):
            raise ValueError(f"{nranks} ranks at {per_host} per host need more hosts than "
                             f"{self.hosts}")
        cmd = self.launch_argv(kind, nranks, argv, per_host)
        if failure_grace is not None:  # the runner under asynclock's job watch
            cmd = [sys.executable, "-m", "asynclock.jobwatch", "--failure-grace",
                   str(failure_grace), "--", *cmd]
        return LiveJob(cmd, self.environ(kind, env))

    def run_on(self, host: str, argv: Sequence[str], env: Mapping[str, str] | None = None,
               timeout: float = 300) -> LiveJob:
        """Run a command inside one host (e.g. a launcher that ssh-es to the others)."""
        job = LiveJob([str(self.netrig), "exec", host, *argv], dict(env or os.environ))
        job.finish(timeout)
        return job

    def _netrig(self, *args: str) -> str:
        proc = subprocess.run([str(self.netrig), *args], capture_output=True, text=True,
                              timeout=120, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"netrig {' '.join(args)} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()[-400:]}")
        return proc.stdout

    def _in(self, host: str, *argv: str) -> None:
        subprocess.run(["ip", "netns", "exec", host, *argv], check=True, timeout=30,
                       capture_output=True)
