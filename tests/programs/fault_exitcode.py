"""Run a rank program as a child and print its exit status: `RANK r EXIT code`.

Used with launchers told not to clean up after a failed rank, to show that
every rank leaves on its own, with a non-zero code. SIGUSR1 is ignored here
(and so in the child): MPICH's hydra uses it to tell survivors that a peer
died, and its default action would kill them before asynclock could.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def world_rank() -> str:
    for name in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        if name in os.environ:
            return os.environ[name]
    return "?"


def main() -> None:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = subprocess.run([sys.executable, *sys.argv[1:]], close_fds=False, check=False)
    code = child.returncode if child.returncode >= 0 else 128 - child.returncode
    os.write(1, f"RANK {world_rank()} EXIT {code}\n".encode())
    sys.exit(code)


main()
