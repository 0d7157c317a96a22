"""`asynclock.start()` under `horovodrun --gloo` with and without a crowd of idle connections.

Run: python bench/crowd.py [--np 2] [--runs 3] [--held 200] [--every | --hold] [--launcher]
                           [--json PATH]

Each run starts tests/programs/start_time.py twice, plain and crowded, and
reads every rank's `start <seconds>`. Crowded: a foreign client on the same
host watches the listeners of the job's ranks and of every process they
start (read from /proc, tests/listeners.py) and holds `--held` idle
connections open on each as soon as it appears (non-blocking connects, so
the watch never waits).

By default the ranks initialise Horovod first and the crowd comes after:
it meets every listener asynclock's start-up opens, its own and any other
(an MPI singleton's), and the time is asynclock's alone. A mesh listener
lives only until the rank's peers joined, so the watch may see some of them
too late; `--hold` makes sure of all: the ranks announce their mesh
listeners and hold (ASYNCLOCK_MESH_HOLD) until the crowd holds its
connections on every one of them (in plain runs, until it has seen them), so
every peer queues behind the crowd. `--every` crowds from the job's start,
Horovod's gloo pair listeners included (an idle connection there aborts a
rank in Horovod's init, which asynclock cannot prevent:
docs/guide/security.md); `--launcher` crowds horovodrun's own listener too
(its rendezvous server). It prints each run's start times, the medians of
the slowest rank's, the listeners it crowded and whether every job finished.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from listeners import Listener, listeners, without_launcher  # noqa: E402
from mpijob import Job, processes_with, run_horovodrun  # noqa: E402
from timing import median  # noqa: E402

WATCH_S = 0.002  # the crowd looks for new listeners this often
_START = re.compile(r"RANK (\d+) OK start ([\d.]+)")


MESHES = ("mailbox", "heartbeat")


class Crowd:
    """Holds `held` idle connections on every listener of the processes that carry
    `token` on their command line and of their descendants."""

    def __init__(self, token: str, held: int, launcher: bool, after: Path | None,
                 hold: Path | None, nranks: int) -> None:
        """`after`: crowd only once every rank wrote `after`/horovod.<rank>; touch
        `after`/go then. `hold`: the ranks' ASYNCLOCK_MESH_HOLD folder; touch each
        mesh's go once every rank's listener of it is crowded."""
        self.token, self.held, self.launcher = token, held, launcher
        self.after, self.hold, self.nranks = after, hold, nranks
        self.crowded: dict[int, Listener] = {}  # by inode
        self._ports: set[int] = set()
        self._sockets: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _pids(self) -> list[int]:
        pids = processes_with(self.token)
        return pids if self.launcher else without_launcher(pids)

    def _watch(self) -> None:
        spared: set[int] = set()
        if self.after is not None:
            ready = [self.after / f"horovod.{r}" for r in range(self.nranks)]
            while not all(p.exists() for p in ready) and not self._stop.is_set():
                time.sleep(WATCH_S)
            spared = {listener.inode for listener in listeners(self._pids())}
            (self.after / "go").touch()
        while not self._stop.is_set():
            try:
                found = listeners(self._pids())
            except OSError:  # a process ended while it was read
                continue
            for listener in found:
                if listener.inode not in self.crowded and listener.inode not in spared:
                    self.crowded[listener.inode] = listener
                    self._hold(listener)
            self._release_meshes()
            time.sleep(WATCH_S)

    def _release_meshes(self) -> None:
        """Touch each held mesh's go once all its listeners are crowded (or seen)."""
        if self.hold is None:
            return
        for mesh in MESHES:
            go = self.hold / f"go.asynclock0.{mesh}"
            announced = [self.hold / f"asynclock0.{mesh}.{r}" for r in range(self.nranks)]
            if go.exists() or not all(p.exists() for p in announced):
                continue
            ports = {int(p.read_text().split()[1]) for p in announced}
            if ports <= self._ports:
                go.touch()

    def _hold(self, listener: Listener) -> None:
        self._ports.add(listener.port)
        family = socket.AF_INET6 if ":" in listener.address else socket.AF_INET
        host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(listener.address, listener.address)
        for _ in range(self.held):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            sock.connect_ex((host, listener.port))
            self._sockets.append(sock)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._sockets:
            sock.close()


def one_job(nranks: int, held: int, every: bool, hold: bool,
            launcher: bool) -> tuple[Job, list[float], list[Listener]]:
    with tempfile.TemporaryDirectory(prefix="crowd-") as token:
        folder = None if every else Path(token)
        env = {}
        if hold:
            (Path(token) / "hold").mkdir()
            env["ASYNCLOCK_MESH_HOLD"] = str(Path(token) / "hold")
        watcher = Crowd(token, held, launcher, folder, Path(token) / "hold" if hold else None,
                        nranks)
        first = [] if every else ["--horovod-first", token]
        try:
            job = run_horovodrun("start_time.py", nranks, *first, token, gloo=True, timeout=180,
                                 env=env)
        finally:
            watcher.release()
    starts = sorted(float(s) for _, s in _START.findall(job.output))
    return job, starts, list(watcher.crowded.values()) if held else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--held", type=int, default=200)
    parser.add_argument("--every", action="store_true")
    parser.add_argument("--hold", action="store_true")
    parser.add_argument("--launcher", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    slowest: dict[str, list[float]] = {"plain": [], "crowded": []}
    failures: list[str] = []
    for run in range(args.runs):
        for kind, held in (("plain", 0), ("crowded", args.held)):
            job, starts, crowded = one_job(args.np, held, args.every, args.hold,
                                           args.launcher)
            ok = job.returncode == 0 and len(starts) == args.np
            if not ok:
                failures.append(f"run {run} {kind}: exit {job.returncode}\n{job.output[-2000:]}")
            slowest[kind].append(max(starts) if starts else float("nan"))
            print(f"run {run} {kind:7s} start {', '.join(f'{s:.2f}' for s in starts)} s "
                  f"({'ok' if ok else 'FAILED'})")
            for listener in crowded:
                print(f"    held {held} on {listener.row()}")
    medians = {kind: median(times) for kind, times in slowest.items()}
    print(f"median of the slowest rank's start(): plain {medians['plain']:.2f} s, crowded "
          f"{medians['crowded']:.2f} s ({args.np} ranks, {args.held} idle connections per "
          "listener)")
    for failure in failures:
        print(failure)
    if args.json:
        args.json.write_text(json.dumps({"slowest": slowest, "medians": medians,
                                         "failures": failures}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
