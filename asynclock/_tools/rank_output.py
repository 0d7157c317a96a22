"""The per-rank trampoline: tags output lines with `[r] ` and reports a failed rank.

    python -I asynclock/_tools/rank_output.py program args...  # asynclock-launch, per rank

Why tag here: MPI runners' own tags (`-prepend-rank`, `--tag-output`) label
each *chunk* a rank writes, and an unbuffered Python `print` is two writes,
so lines come out split ("[1,0]<stdout>:hello[1,0]<stdout>:"). The
trampoline reads the program's output and writes `[r] line`, one write per
whole line.

Why supervise: a runner does not always end the job when a rank fails.
MPICH 5's hydra can leave a survivor in `MPI_Finalize` for ever when one
rank exits with a non-zero status without finalizing (see the benchmarks
page), and plain mpi4py programs do exactly that on a crash. So the program runs as
the trampoline's child: the trampoline sees its status, and on a failure
writes the announcement asynclock-launch acts on (`asynclock[rank R]: ...;
stopping the job (exit N)`: the launcher kills a job whose runner outlives
it by `--failure-grace`). It then ends the same way the program did (status
or signal), passes the runner's signals on to the program, and the program
dies with it (`PR_SET_PDEATHSIG`) if the runner SIGKILLs the trampoline.
stdlib only, never imports the package, so each rank pays no more than a
bare interpreter start.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "SLURM_PROCID", "RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "SLURM_NTASKS", "WORLD_SIZE")
# A progress bar's "\r" ends a segment too, so each redraw is tagged (and still redraws).
_LINE_END = re.compile(rb"(\r\n|\n|\r)")
_MAX_LINE = 1 << 20
# Passed on to the program; the first four mean the runner ends the job, so no announcement.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
                     signal.SIGUSR1, signal.SIGUSR2)
_STOP_SIGNALS = FORWARDED_SIGNALS[:4]
DRAIN_S = 3.0  # after the program exits: how long its own children may hold its output open
_PR_SET_PDEATHSIG = 1


def _first_int(names: Sequence[str], env: Mapping[str, str] | None) -> int | None:
    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def env_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This process's rank as its launcher exported it (MPICH, Open MPI, Horovod, Slurm)."""
    return _first_int(RANK_VARS, env)


def env_size(env: Mapping[str, str] | None = None) -> int | None:
    """The job's size as the launcher exported it; None outside a launcher."""
    return _first_int(SIZE_VARS, env)


def rank_io(argv: list[str]) -> NoReturn:
    """Run `argv` as a child with tagged output; announce a failure; end as it ended.

    The trampoline keeps its copy of the runner's PMI socket: were it closed
    with the program, hydra would see the socket close before the process
    exit, SIGKILL every rank, and lose which rank failed and how."""
    rank = env_rank()
    pipes = [os.pipe(), os.pipe()]
    parent = os.getpid()
    child = os.fork()
    if child == 0:
        _become_program(argv, pipes, parent)
    sources = {r: fd for (r, w), fd in zip(pipes, (1, 2), strict=True)}
    for _, w in pipes:
        os.close(w)
    watch = _ChildWatch(child)
    tag = b"" if rank is None else f"[{rank}] ".encode()
    status = _LinePump(sources, tag).run(watch.exited_fd)
    if rank is not None and not watch.stop_asked:
        _announce_failure(rank, status, tag)
    _end_like(status)


def _become_program(argv: list[str], pipes: list[tuple[int, int]], parent: int) -> NoReturn:
    """In the forked child: output into the pipes, die with the trampoline, exec."""
    try:
        for (r, w), fd in zip(pipes, (1, 2), strict=True):
            os.dup2(w, fd)
            os.close(w)
            os.close(r)
        _die_with(parent)
        os.execvp(argv[0], argv)
    except BaseException as exc:  # never return into the trampoline's code
        os.write(2, f"asynclock-launch: cannot run {argv[0]!r}: {exc}\n".encode())
    os._exit(127)


def _die_with(parent: int) -> None:
    """SIGKILL the program when the trampoline dies: a runner's SIGKILL reaches
    only the pid it started, and an orphaned rank would hold the job's MPI state."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the trampoline died before prctl took effect
        os._exit(137)


class _ChildWatch:
    """Reaps the program in a thread (its wait status arrives on `exited_fd`) and
    passes the runner's signals on to it."""

    def __init__(self, child: int) -> None:
        self.child, self.stop_asked, self.reaped = child, False, False
        self.exited_fd, self._write_fd = os.pipe()
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._forward)
        threading.Thread(target=self._reap, name="asynclock-rankio-reap", daemon=True).start()

    def _reap(self) -> None:
        _, status = os.waitpid(self.child, 0)
        self.reaped = True
        os.write(self._write_fd, status.to_bytes(4, "little"))

    def _forward(self, sig: int, _frame: object) -> None:
        self.stop_asked = self.stop_asked or sig in _STOP_SIGNALS
        if not self.reaped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, sig)


class _LinePump:
    """Copies each source to its target, one whole tagged line per write."""

    def __init__(self, sources: dict[int, int], tag: bytes) -> None:
        self.sources, self.tag = sources, tag
        self.pending = {src: b"" for src in sources}
        self.sel = selectors.DefaultSelector()
        for src in sources:
            self.sel.register(src, selectors.EVENT_READ)

    def run(self, exited_fd: int) -> int:
        """Pump until the program has exited and its output ended (or DRAIN_S
        passed since the exit): the program's wait status."""
        self.sel.register(exited_fd, selectors.EVENT_READ)
        status: int | None = None
        deadline = float("inf")
        while status is None or (self.pending and time.monotonic() < deadline):
            timeout = None if status is None else max(0.0, deadline - time.monotonic())
            for key, _ in self.sel.select(timeout):
                if key.fd == exited_fd:
                    status = int.from_bytes(os.read(exited_fd, 4), "little")
                    self.sel.unregister(exited_fd)
                    deadline = time.monotonic() + DRAIN_S
                else:
                    self._read(int(key.fd))
        for src in list(self.pending):
            self._finish(src)
        return status

    def _read(self, src: int) -> None:
        data = os.read(src, 65536)
        buf = self.pending[src] + data
        hold = data.endswith(b"\r")  # maybe the first half of "\r\n"
        parts = _LINE_END.split(buf[:-1] if hold else buf)
        rest = parts.pop()
        for line, end in zip(parts[::2], parts[1::2], strict=True):
            _write_all(self.sources[src], self.tag + line + end)
        if len(rest) > _MAX_LINE:  # no newline for a long while: pass it on as is
            _write_all(self.sources[src], self.tag + rest)
            rest = b""
        self.pending[src] = rest + (b"\r" if hold else b"")
        if not data:
            self._finish(src)

    def _finish(self, src: int) -> None:
        """The source ended (or the drain time ran out): its last partial line goes out."""
        rest = self.pending.pop(src)
        if rest:
            _write_all(self.sources[src], self.tag + rest + b"\n")
        self.sel.unregister(src)


def describe_failure(status: int) -> tuple[str, int] | None:
    """(what happened, the shell-style exit code) for a failed program, else None."""
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return None
    if code > 0:
        return f"exited with status {code}", code
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    return f"was killed by {name}", 128 - code


def _announce_failure(rank: int, status: int, tag: bytes) -> None:
    """The line asynclock-launch acts on when the runner does not end the job. In an
    elastic job (Horovod's elastic driver sets HOROVOD_ELASTIC) the others go on
    without this rank, so the line says that and nobody acts on it."""
    failure = describe_failure(status)
    if failure is not None:
        what, code = failure
        ending = ("the elastic job goes on without it" if os.environ.get("HOROVOD_ELASTIC") == "1"
                  else f"stopping the job (exit {code})")
        _write_all(2, tag + f"asynclock[rank {rank}]: the program {what}; {ending}\n".encode())


def _end_like(status: int) -> NoReturn:
    """Exit with the program's status, or die of its signal (without a core file)."""
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        with contextlib.suppress(Exception):
            import resource

            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(
                resource.RLIMIT_CORE)[1]))
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the reader went away: nothing left to tell
        while data:
            data = data[os.write(fd, data):]


def trampoline(prog: list[str]) -> list[str]:
    """argv that runs `prog` behind the trampoline. -I: this file runs as a plain
    script (no package import, no script dir or user site on sys.path)."""
    return [sys.executable, "-I", os.path.abspath(__file__), *prog]


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -I rankio.py program [args...]")
    rank_io(sys.argv[1:])
