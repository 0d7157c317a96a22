"""The shared windows the gradient engine allocates, counted until they are freed.

`MPI_Win_allocate_shared` and `MPI_Win_free` are collective over the node's
communicator: freeing waits for every peer, so it runs on a thread of its own
(`Reducer.release`), never on the loop or the training thread.
"""

from __future__ import annotations

from typing import Any

_OPEN: set[int] = set()  # ids of the shared windows this process holds


def allocate_shared(nbytes: int, node: Any) -> Any:
    """`MPI_Win_allocate_shared` over `node` (collective), counted until `free_shared`."""
    from mpi4py import MPI

    win = MPI.Win.Allocate_shared(nbytes, 1, comm=node)
    _OPEN.add(id(win))
    return win


def free_shared(win: Any) -> None:
    """Free a window from `allocate_shared` (collective over its node)."""
    _OPEN.discard(id(win))
    win.Unlock_all()
    win.Free()


def open_windows() -> int:
    """Shared windows this process made and has not freed (tests hold it flat)."""
    return len(_OPEN)
