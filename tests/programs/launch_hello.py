"""Rank program for launcher tests: MPI works, each rank writes to stdout and stderr.

`--fail`: rank 1 exits with status 3 after the allreduce. `--fail-stuck`: so
does rank 1, and the others block for ever (as survivors in a collective, or
in hydra's MPI_Finalize after a rank died: 7% of `--fail` jobs). `--hang`: every
rank blocks forever (the launcher's --timeout must end the job). `--hang
--announce`: rank 1 first says it stops the job, as the watchdog does, and the
job still never ends (as hydra after a cut host): the launcher must end it.
`--deadlock`: every rank blocks inside MPI_Recv, where Python never runs a signal
handler (a Ctrl-C to the launcher must still end the job).
"""

from __future__ import annotations

import os
import sys
import threading

from mpi4py import MPI

from asynclock.launch import env_rank, env_size


def main() -> int:
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.rank + 1)
    want = comm.size * (comm.size + 1) // 2
    assert total == want, f"allreduce {total} != {want}: ranks are singletons?"
    print(f"hello from {comm.rank} of {comm.size} env_rank={env_rank()} env_size={env_size()} "
          f"timeline={os.environ.get('ASYNCLOCK_TIMELINE', '-')}", flush=True)
    print(f"note on stderr from {comm.rank}", file=sys.stderr, flush=True)
    if "--announce" in sys.argv and comm.rank == 1:
        print("asynclock[rank 1]: rank 0 is unreachable: no heartbeat for 5.1 s; "
              "stopping the job (exit 3)", file=sys.stderr, flush=True)
    if "--deadlock" in sys.argv:
        print(f"blocked {comm.rank}", flush=True)
        comm.recv(source=(comm.rank + 1) % comm.size)  # nobody sends
    if "--hang" in sys.argv:
        print(f"hanging {comm.rank}", flush=True)
        threading.Event().wait()
    failing = "--fail" in sys.argv or "--fail-stuck" in sys.argv
    if failing and comm.rank == 1:
        os._exit(3)  # no MPI_Finalize: a rank that really failed
    if "--fail-stuck" in sys.argv:
        threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
