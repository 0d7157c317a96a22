"""The per-rank trampoline that tags output lines with `[rank] `.

    python -I asynclock/rankio.py program args...     # what asynclock-launch runs per rank

Why: MPI runners' own tags (`-prepend-rank`, `--tag-output`) label each
*chunk* a rank writes, and an unbuffered Python `print` is two writes, so
lines come out split ("[1,0]<stdout>:hello[1,0]<stdout>:"). Here a forked
pump assembles whole lines and writes `[r] line` with one write each, and
the trampoline then execs the program: same pid, so the runner's signals and
exit status reach the program itself, and the program has no extra child
(the pump is double-forked). stdlib only, never imports the package, so it
costs a bare interpreter start (~20 ms) per rank.
"""

from __future__ import annotations

import contextlib
import os
import re
import selectors
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import NoReturn

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK", "SLURM_PROCID", "RANK")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "HOROVOD_SIZE", "SLURM_NTASKS", "WORLD_SIZE")
# A progress bar's "\r" ends a segment too, so each redraw is tagged (and still redraws).
_LINE_END = re.compile(rb"(\r\n|\n|\r)")
_MAX_LINE = 1 << 20


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
    """Tag this rank's output lines with `[r] `, then become the program (same pid)."""
    rank = env_rank()
    pipes = [(os.pipe(), fd) for fd in (1, 2)]
    if os.fork() == 0:  # double fork: the program never sees an unknown child
        if os.fork() == 0:
            sources = {r: fd for (r, _), fd in pipes}
            _close_fds_except({*sources, 1, 2})  # e.g. PMI_FD: the runner's, not ours
            _pump_lines(sources, b"" if rank is None else f"[{rank}] ".encode())
        os._exit(0)
    os.wait()
    for (r, w), fd in pipes:
        os.dup2(w, fd)
        os.close(w)
        os.close(r)
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        os.write(2, f"asynclock-launch: cannot run {argv[0]!r}: {exc}\n".encode())
        os._exit(127)


def _close_fds_except(keep: set[int]) -> None:
    start = 0
    for fd in sorted(keep):
        os.closerange(start, fd)
        start = fd + 1
    os.closerange(start, os.sysconf("SC_OPEN_MAX"))


def _pump_lines(sources: dict[int, int], tag: bytes) -> NoReturn:
    """Copy each source to its target, one whole tagged line per write, until EOF."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # flush until the program is gone
        signal.signal(sig, signal.SIG_IGN)
    sel = selectors.DefaultSelector()
    pending = {src: b"" for src in sources}
    for src in sources:
        sel.register(src, selectors.EVENT_READ)
    while pending:
        for key, _ in sel.select():
            src = int(key.fd)
            data = os.read(src, 65536)
            buf = pending[src] + data
            hold = data.endswith(b"\r")  # maybe the first half of "\r\n"
            parts = _LINE_END.split(buf[:-1] if hold else buf)
            rest = parts.pop()
            for line, end in zip(parts[::2], parts[1::2], strict=True):
                _write_all(sources[src], tag + line + end)
            if len(rest) > _MAX_LINE:  # no newline for a long while: pass it on as is
                _write_all(sources[src], tag + rest)
                rest = b""
            if data:
                pending[src] = rest + (b"\r" if hold else b"")
                continue
            if rest:
                _write_all(sources[src], tag + rest + b"\n")
            sel.unregister(src)
            del pending[src]
    os._exit(0)


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
