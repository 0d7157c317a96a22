"""Run a launcher process as a whole: forward its output, signals and end.

Why a watch: some runners never return after a rank stopped the job. MPICH's
hydra `mpiexec` waits for ever for the proxy on a host whose link was cut
(its control connection has no keepalive), although every rank there has
exited. asynclock ranks announce a job-ending failure on stderr
(`asynclock[rank R]: ...; stopping the job (exit N)`); once such a line has
passed and the runner is still running `failure_grace_s` later, the whole
process group is killed and the launch returns the rank's exit code N. A
`timeout` bounds the job whatever happens (exit 124).

Any runner command line can be watched this way:

    python -m asynclock.jobwatch --failure-grace 10 -- mpiexec -n 4 -f hosts python train.py

The runner runs in its own session, so one `killpg` reaches every local
rank and proxy; Ctrl-C and SIGTERM are passed on to that group. A job that
outlives them by `SIGNAL_GRACE_S` is killed (hydra only forwards a Ctrl-C and
waits for a second one, and a rank blocked inside an MPI call never sees
it), a second one kills the job at once, and the launch then exits 128+N
for signal N whatever the runner returned.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import IO, Any

TIMEOUT_EXIT = 124
GRACE_S = 5.0  # SIGTERM, then SIGKILL after this
FAILURE_GRACE_S = 20.0  # a rank stopped the job: the runner must be gone by then
# Ctrl-C or SIGTERM passed on: the job must be gone by then. Room for a rank's checkpoint
# on SIGTERM; with GRACE_S still below Slurm's default KillWait (30 s).
SIGNAL_GRACE_S = 10.0
_POLL_S = 0.2
# horovodrun tags lines itself ("[0]<stdout>:", "[1,0]<stdout>:" under its MPI controller).
_HOROVOD_TAG = re.compile(rb"^\[(?:\d+,)?\d+\]<std(?:out|err|diag)>:")
_STOPPING = re.compile(rb"asynclock\[rank (\d+)\]: .*stopping the job \(exit (\d+)\)")


@dataclass(frozen=True)
class Stopping:
    """A rank's announcement that it ends the job."""

    rank: int
    exit_code: int
    seen_at: float  # time.monotonic()


def strip_tag(line: bytes) -> bytes:
    """Drop horovodrun's own tag from a line our trampoline already tagged."""
    m = _HOROVOD_TAG.match(line)
    return line if m is None else line[m.end():]


def parse_stopping(line: bytes, now: float) -> Stopping | None:
    """The announcement in `line`, if it is one (any launcher tag before it)."""
    m = _STOPPING.search(line)
    return None if m is None else Stopping(int(m[1]), int(m[2]), now)


class _OutputWatch:
    """Pumps one stream line by line; remembers the first stopping announcement."""

    def __init__(self, strip: bool) -> None:
        self.strip = strip
        self.stopping: Stopping | None = None
        self._threads: list[threading.Thread] = []

    def start(self, src: IO[bytes], dst: IO[bytes]) -> None:
        t = threading.Thread(target=self._pump, args=(src, dst), daemon=True)
        self._threads.append(t)
        t.start()

    def _pump(self, src: IO[bytes], dst: IO[bytes]) -> None:
        for line in iter(src.readline, b""):
            if self.stopping is None and b"stopping the job" in line:
                self.stopping = parse_stopping(line, time.monotonic())
            dst.write(strip_tag(line) if self.strip else line)
            dst.flush()
        src.close()

    def join(self, timeout: float) -> None:
        for t in self._threads:
            t.join(timeout)


def kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def terminate(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the job's process group; SIGKILL whatever outlives the grace period."""
    kill_group(proc, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(GRACE_S)
    kill_group(proc, signal.SIGKILL)
    proc.wait()


@dataclass
class Interrupt:
    """The first Ctrl-C / SIGTERM the launch received, and when."""

    signum: int = 0  # 0: none yet
    at: float = 0.0  # time.monotonic()


def _forward_signals(proc: subprocess.Popen[bytes], interrupt: Interrupt) -> dict[int, Any]:
    """The job runs in its own session, so pass Ctrl-C / SIGTERM on to its group;
    a second one SIGKILLs the group (as a runner's "Ctrl-C again to force abort")."""
    def on_signal(sig: int, _frame: object) -> None:
        if interrupt.signum:
            kill_group(proc, signal.SIGKILL)
            return
        interrupt.signum, interrupt.at = sig, time.monotonic()
        kill_group(proc, sig)

    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    return previous


def run_job(argv: list[str], env: dict[str, str] | None, *, strip_tags: bool = False,
            timeout: float | None = None, failure_grace_s: float = FAILURE_GRACE_S) -> int:
    """Run the runner: its exit status (128+N for signal N, 124 on timeout, or a
    stopping rank's exit code when the runner outlived that rank's announcement);
    128+N when the launch itself got signal N (Ctrl-C: 130, SIGTERM: 143), since
    runners report anything from 0 to 255 for a job they were told to end."""
    out = subprocess.PIPE if strip_tags else None  # stdout stays a terminal otherwise
    proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.PIPE,
                            start_new_session=True)
    watch = _OutputWatch(strip_tags)
    for src, dst in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
        if src is not None:
            watch.start(src, dst)
    interrupt = Interrupt()
    previous = _forward_signals(proc, interrupt)
    try:
        rc, ended_by_us = _supervise(proc, watch, timeout, failure_grace_s, interrupt)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    watch.join(GRACE_S)
    if interrupt.signum:
        return 128 + interrupt.signum
    return rc if ended_by_us else job_status(rc, watch.stopping)


def job_status(runner_rc: int, stopping: Stopping | None) -> int:
    """The failed rank's own exit code over the runner's: hydra reports the ranks
    it SIGKILLed afterwards (9), or, racing, 0 although a rank exited with 3."""
    if stopping is None or stopping.exit_code in (0, runner_rc):
        return runner_rc
    say(f"rank {stopping.rank} failed (exit {stopping.exit_code}); "
        f"the runner returned {runner_rc}")
    return stopping.exit_code


def _supervise(proc: subprocess.Popen[bytes], watch: _OutputWatch, timeout: float | None,
               failure_grace_s: float, interrupt: Interrupt) -> tuple[int, bool]:
    """Wait for the runner; kill it on timeout or when it outlives a stopping rank.
    (exit status, whether this watch ended the job)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while (rc := _poll(proc)) is None:
            verdict = _overdue(watch.stopping, deadline, failure_grace_s, timeout, interrupt)
            if verdict is not None:
                say(verdict[1])
                terminate(proc)
                return verdict[0], True
    except BaseException:  # a second Ctrl-C or any error: never leave ranks behind
        terminate(proc)
        raise
    kill_group(proc, signal.SIGKILL)  # ranks a runner left behind when it exited
    return (128 - rc if rc < 0 else rc), False


def _poll(proc: subprocess.Popen[bytes]) -> int | None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(_POLL_S)
    return None


def _overdue(stopping: Stopping | None, deadline: float | None, failure_grace_s: float,
             timeout: float | None, interrupt: Interrupt | None = None) -> tuple[int, str] | None:
    """(exit code, message) when the job must be killed now, else None."""
    now = time.monotonic()
    if interrupt is not None and interrupt.signum and now - interrupt.at >= SIGNAL_GRACE_S:
        name = signal.Signals(interrupt.signum).name
        return 128 + interrupt.signum, (
            f"the job outlived {name} by {SIGNAL_GRACE_S:g} s: killing it")
    if deadline is not None and now >= deadline:
        return TIMEOUT_EXIT, f"timeout after {timeout:g}s: killing the job"
    if stopping is not None and now - stopping.seen_at >= failure_grace_s:
        return stopping.exit_code or 1, (
            f"rank {stopping.rank} stopped the job (exit {stopping.exit_code}) "
            f"{now - stopping.seen_at:.0f} s ago, but the runner has not returned: killing it")
    return None


def say(text: str) -> None:
    print(f"asynclock-launch: {text}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """`python -m asynclock.jobwatch [--timeout S] [--failure-grace S] -- CMD...`"""
    p = argparse.ArgumentParser(prog="python -m asynclock.jobwatch",
                                description="run a launcher command; end it as a whole")
    p.add_argument("--timeout", type=float, default=None)
    p.add_argument("--failure-grace", type=float, default=FAILURE_GRACE_S)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("give the runner's command line after --")
    return run_job(cmd, None, timeout=args.timeout, failure_grace_s=args.failure_grace)


if __name__ == "__main__":
    sys.exit(main())
