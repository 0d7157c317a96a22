"""Build asynclock's C small-message round (`_core/engine/_fastpath.c`) for every MPI here.

Each MPI has its own ABI, so each gets its own build, compiled by that MPI's
`mpicc` in a process whose mpi4py loads that MPI (`mpi_select.environ_for`).
A missing compiler only costs speed: the Python path sends the same bytes.
Usage: python mpi/build_fastpath.py [embedded|system ...]   (default: all available)
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


def main(argv: list[str]) -> int:
    kinds = argv or [k for k, ok in mpi_select.available().items() if ok]
    results = [build(kind) for kind in kinds]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
