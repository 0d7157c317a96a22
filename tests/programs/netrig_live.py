"""A launcher process seen from outside: its output line by line as it comes
(with arrival times), the `RANK r OK label` lines behind any launcher's tag,
and the rank processes it started. Used by netrig_rig / tests / bench.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class LiveJob:
    """A launcher process whose merged output is read line by line as it comes."""

    def __init__(self, cmd: list[str], env: Mapping[str, str]) -> None:
        self.cmd = cmd
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.times: list[float] = []  # when each line arrived (monotonic)
        self.returncode: int | None = None
        self.returned_by_itself = False
        self.ended_at: float | None = None
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=dict(env), cwd=ROOT,
                                     start_new_session=True, errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self.times.append(time.monotonic())
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    @property
    def output(self) -> str:
        with self._cond:
            return "\n".join(self.lines)

    def ok_ranks(self, label: str) -> set[int]:
        """Ranks that printed `RANK r OK label ...` (behind any launcher's tag)."""
        pat = re.compile(rf"^RANK (\d+) OK {re.escape(label)}(?: |$)")
        return {int(m.group(1)) for line in self.lines if (m := pat.match(untag(line)))}

    def first(self, pattern: str) -> tuple[float, str] | None:
        """When the first line matching `pattern` (re.search) arrived, and the line."""
        with self._cond:
            return next(((t, line) for t, line in zip(self.times, self.lines, strict=True)
                         if re.search(pattern, line)), None)

    def detail(self, rank: int, label: str) -> str | None:
        """The text after `RANK r OK label `."""
        prefix = f"RANK {rank} OK {label} "
        lines = (untag(line) for line in self.lines)
        return next((line[len(prefix):] for line in lines if line.startswith(prefix)), None)

    def wait_for(self, label: str, ranks: Iterable[int], timeout: float) -> bool:
        """Until every rank in `ranks` printed `label`, the job ended, or `timeout`."""
        want, deadline = set(ranks), time.monotonic() + timeout
        with self._cond:
            while not want <= self.ok_ranks(label):
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    return want <= self.ok_ranks(label)
                self._cond.wait(min(left, 0.5))
            return True

    def finish(self, timeout: float) -> int:
        """Wait up to `timeout` for the launcher; past it, kill its session.

        `returned_by_itself` says which happened; the code is the launcher's,
        or -9 when it had to be killed."""
        try:
            self.returncode = self.proc.wait(max(timeout, 0.0))
            self.returned_by_itself = True
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            self.returncode = -9
        self.ended_at = time.monotonic()
        self._reader.join(10)
        return self.returncode

    def explain(self) -> str:
        how = "returned" if self.returned_by_itself else "killed"
        return (f"command: {' '.join(self.cmd)}\nlauncher {how}, exit {self.returncode}\n"
                f"--- output ---\n{self.output}")


_TAG = re.compile(r"^\[[\d,]+\](?:<std\w+>:)? ?")


def untag(line: str) -> str:
    """Drop a launcher's rank tag: `[1] `, `[1,0]<stdout>:` (asynclock-launch, horovodrun)."""
    return _TAG.sub("", line, count=1)


# -- processes ------------------------------------------------------------------------------
def rank_pids(job: LiveJob) -> dict[int, int]:
    """Ranks report `RANK r OK pid <pid> <host>` first thing."""
    out = {}
    for line in job.lines:
        m = re.match(r"^RANK (\d+) OK pid (\d+) ", untag(line))
        if m:
            out[int(m.group(1))] = int(m.group(2))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: Iterable[int], timeout: float) -> list[int]:
    """Wait until the processes exit; those still alive at the deadline."""
    pids, deadline = list(pids), time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:160]
