"""The per-rank trampoline (asynclock/_tools/rank_output.py): whole tagged lines, the program's
status and signals passed through, and a failed program announced to the launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asynclock import jobwatch
from asynclock._tools import rank_output

RANK5 = {**os.environ, "PMI_RANK": "5"}


def start(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(rank_output.trampoline([sys.executable, "-u", "-c", code]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=RANK5 if env is None else env)


def announcement(what: str, code: int) -> str:
    return f"[5] asynclock[rank 5]: the program {what}; stopping the job (exit {code})\n"


def test_trampoline_tags_whole_lines_and_passes_the_status_on() -> None:
    proc = start("import os, sys\n"
                 "print('parent', os.getppid())\n"
                 "sys.stdout.write('split '); sys.stdout.flush(); print('line')\n"
                 "print('bad', file=sys.stderr)\n"
                 "sys.stdout.write('no newline at exit'); sys.exit(7)\n")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert out.splitlines() == [f"[5] parent {proc.pid}", "[5] split line",
                                "[5] no newline at exit"]
    assert err == "[5] bad\n" + announcement("exited with status 7", 7)
    stopping = jobwatch.parse_stopping(err.splitlines()[-1].encode(), 0.0)
    assert stopping is not None and (stopping.rank, stopping.exit_code) == (5, 7)


def test_a_clean_exit_announces_nothing() -> None:
    proc = start("print('ok')")
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (0, "[5] ok\n", "")


def test_outside_a_runner_nothing_is_tagged_or_announced() -> None:
    env = {k: v for k, v in os.environ.items() if k not in rank_output.RANK_VARS}
    proc = start("import sys; print('x'); sys.exit(2)", env)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (2, "x\n", "")


def test_the_programs_signal_death_is_mirrored_and_announced() -> None:
    proc = start("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGSEGV
    assert err.endswith(announcement("was killed by SIGSEGV", 128 + signal.SIGSEGV))


def test_the_runners_sigterm_reaches_the_program_and_is_not_a_failure() -> None:
    """A runner ending the job signals the pid it started: the trampoline."""
    proc = start("import signal, sys, threading\n"
                 "signal.signal(signal.SIGTERM, lambda *a: sys.exit(print('got TERM') or 4))\n"
                 "print('ready'); threading.Event().wait()\n")
    assert proc.stdout is not None and proc.stdout.readline() == "[5] ready\n"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 4 and out == "[5] got TERM\n"
    assert "stopping the job" not in err  # the runner asked: not this rank's failure


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_the_program_dies_with_a_sigkilled_trampoline() -> None:
    """hydra SIGKILLs the pids it started; an orphaned rank would keep MPI state alive."""
    proc = start("import os, threading; print(os.getpid()); threading.Event().wait()")
    assert proc.stdout is not None
    line = proc.stdout.readline()
    program = int(line.removeprefix("[5] "))
    proc.kill()
    proc.wait(timeout=60)
    assert _gone(program), f"program {program} outlived its trampoline"


def test_trampoline_reports_a_missing_program() -> None:
    done = subprocess.run(rank_output.trampoline(["/nonexistent/prog"]), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 127 and "cannot run '/nonexistent/prog'" in done.stderr


@pytest.mark.parametrize(("status", "expected"), [
    (0, None),
    (3 << 8, ("exited with status 3", 3)),
    (signal.SIGKILL, ("was killed by SIGKILL", 137)),
])
def test_describe_failure(status: int, expected: tuple[str, int] | None) -> None:
    assert rank_output.describe_failure(status) == expected


def test_a_child_holding_the_output_delays_the_exit_by_the_drain_time_only() -> None:
    """The program's own child (a data-loader worker, a shell) may keep its stdout
    open after it exits: the rank still ends within DRAIN_S."""
    proc = start("import subprocess\n"
                 "print(subprocess.Popen(['sleep', '60']).pid)\n")
    assert proc.stdout is not None
    straggler = int(proc.stdout.readline().removeprefix("[5] "))
    try:
        t0 = time.monotonic()
        proc.wait(timeout=30)
        assert proc.returncode == 0
        assert time.monotonic() - t0 < rank_output.DRAIN_S + 2
    finally:
        os.kill(straggler, signal.SIGKILL)
