"""Build asynclock's C small-message round (`_core/engine/_fastpath.c`) for every MPI here.

Each MPI has its own ABI, so each gets its own build, compiled by that MPI's
`mpicc` in a process whose mpi4py loads that MPI (`mpi_select.environ_for`).
A missing compiler only costs speed: the Python path sends the same bytes.

    python mpi/build_fastpath.py [embedded|system ...]   (default: all available)
    python mpi/build_fastpath.py --can-build [kind]      (default: auto)

A build prints one line per MPI and exits 0 when every MPI built and loads its round.
`--can-build` builds nothing: it exits 0 when `kind` has an MPI compiler wrapper and
Python's headers, so a build is expected to succeed there (`launch/test.sh` then makes
the tests that need the round fail instead of skipping: ASYNCLOCK_REQUIRE_FASTPATH).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mpi_select  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def build(kind: str) -> bool:
    code = "import sys, asynclock._core.engine.fastpath as f; sys.exit(f.main())"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env=mpi_select.environ_for(kind), capture_output=True, text=True,
                          timeout=300, check=False)
    print(f"[fastpath] {kind}: {(done.stdout + done.stderr).strip()}")
    return done.returncode == 0


def can_build(kind: str) -> bool:
    """`kind`'s compiler wrapper (the one the build takes) and Python.h are both here."""
    if not mpi_select.available().get(mpi_select.resolve(kind)):
        return False
    code = ("import os, sys, sysconfig, asynclock._core.engine.fastpath as f; "
            "h = os.path.join(sysconfig.get_paths()['include'], 'Python.h'); "
            "sys.exit(0 if f.compiler() and os.path.exists(h) else 1)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                          env=mpi_select.environ_for(kind), capture_output=True, text=True,
                          timeout=120, check=False)
    return done.returncode == 0


def main(argv: list[str]) -> int:
    if argv[:1] == ["--can-build"]:
        return 0 if can_build(argv[1] if len(argv) > 1 else "auto") else 1
    kinds = argv or [k for k, ok in mpi_select.available().items() if ok]
    results = [build(kind) for kind in kinds]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
