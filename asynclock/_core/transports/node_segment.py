"""A small shared-memory segment for a channel whose ranks are all on one node.

The compact header round can then run through memory instead of MPI
(`engine.fastpath`'s node round; the layout is `_fastpath.c`'s). The segment is
a file in /dev/shm that the channel's rank 0 creates and every rank maps; it
is unlinked as soon as all have mapped it, so it disappears with the last
process, whichever way the job ends, and nothing needs freeing collectively
(an `MPI_Win_free` would wait for ranks that died).

Whether a channel gets one is agreed: every rank must want it (the caller's
condition, e.g. the C round loaded), be on the channel's only node and map
the file, or no rank uses it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class NodeSegment:
    """A zeroed mapping shared by every rank of a channel."""

    address: int
    nbytes: int
    rank: int
    size: int
    mapping: mmap.mmap
    view: np.ndarray[Any, Any]  # exports the mapping (its address); keeps it mapped


def make(comm: Any, wanted: bool, rank_bytes: int) -> NodeSegment | None:
    """Collective over `comm`: a segment of `rank_bytes` per rank, or None on every
    rank when any rank does not want one, the ranks span several nodes, or a
    rank cannot map it."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    one_node = node.Get_size() == comm.Get_size()
    node.Free()
    if not comm.allreduce(bool(wanted and one_node and os.path.isdir(SHM_DIR)), op=MPI.LAND):
        return None
    nbytes = rank_bytes * comm.Get_size()
    nbytes += -nbytes % mmap.PAGESIZE
    mapping, _ = share_file(comm.Get_rank(), nbytes, "round", comm.allgather)
    if mapping is None:
        return None
    view = np.frombuffer(mapping, np.uint8)
    return NodeSegment(view.ctypes.data, nbytes, comm.Get_rank(), comm.Get_size(), mapping,
                       view)


def share_file(rank: int, nbytes: int, what: str, allgather: Callable[[Any], list[Any]]
               ) -> tuple[mmap.mmap | None, list[int] | None]:
    """Collective through `allgather` (every rank's object, in rank order): rank 0 makes
    a file of `nbytes` and names it to the others, every rank maps it, and once all said
    whether they could, rank 0 unlinks it, so it goes with the last process however
    the job ends.

    Returns:
        The mapping, or None on every rank when any rank lacks it; and the ranks that
        could not map it (None: rank 0 could not make it).
    """
    path = create_file(nbytes, what) if rank == 0 else None
    try:
        made = allgather(path)[0]
        mapping = map_file(made, nbytes) if made else None
        mapped = allgather(mapping is not None)
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(path)
    if made is None:
        return None, None
    missing = [q for q, ok in enumerate(mapped) if not ok]
    if missing:
        if mapping is not None:
            mapping.close()
        return None, missing
    return mapping, []


def create_file(nbytes: int, what: str = "round", directory: str = SHM_DIR) -> str | None:
    """A new zero-filled file of `nbytes` in /dev/shm (its path), or None where none
    can be made; whoever makes it unlinks it once every rank mapped it.

    Its pages are allocated here (`posix_fallocate`): tmpfs grants a truncated file
    whatever size is asked and raises SIGBUS in whichever rank first touches a page it
    has no room for (a container's /dev/shm is often 64 MiB), so a file that does not
    fit is refused now, on one rank, as None."""
    try:
        fd, path = tempfile.mkstemp(prefix=f"asynclock-{what}-", dir=directory)
    except OSError:
        return None
    try:
        os.ftruncate(fd, nbytes)  # zero-filled: no round written, none read
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, nbytes)
    except OSError:
        os.unlink(path)
        return None
    finally:
        os.close(fd)
    return path


def free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes free in `directory`'s file system (for messages), 0 where it cannot tell."""
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return 0


def map_file(path: str, nbytes: int) -> mmap.mmap | None:
    """`path`'s first `nbytes`, mapped shared and writable, or None where it cannot be."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, nbytes)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
