"""Ring allreduce of 16-bit floats that keeps them 16-bit on the wire.

Why: MPI has no float16/bfloat16 sum, so a plain MPI allreduce of a
compressed gradient must widen it to float32 first, which doubles the bytes
on the wire and makes `Compression.fp16` slower than no compression at all
(across hosts; figures on the benchmarks page). Here
each rank reduces one chunk: a ring reduce-scatter (N-1 `Sendrecv` steps,
each adding in float32 and rounding once to the 16-bit type), then an
`Allgatherv` of the reduced chunks. Each chunk's value is computed on one
rank and copied to the others, so every rank ends with identical bits.

It runs in the engine's wait thread (bulk stages only), on the channel's
bulk communicator, once every rank has reached it (`BulkChannel._run`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..base.reduce import from_compute, to_compute, torch_half

Array = np.ndarray[Any, Any]
_TAG = 0x4A1C


def chunk_bounds(n: int, size: int) -> list[int]:
    """size+1 boundaries splitting n elements as evenly as possible."""
    base, extra = divmod(n, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + base + (r < extra))
    return bounds


def ring_allreduce_half(comm: Any, data: Array, code: int) -> None:
    """Sum `data` (raw 16-bit storage of dtype `code`) over `comm`, in place."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1 or data.size == 0:
        return
    bounds = chunk_bounds(data.size, size)
    right, left = (rank + 1) % size, (rank - 1) % size
    scratch = np.empty(bounds[1] - bounds[0], data.dtype)  # the largest chunk
    for step in range(size - 1):
        send = (rank - step) % size
        recv = (rank - step - 1) % size
        mine = data[bounds[recv]:bounds[recv + 1]]
        got = scratch[: mine.size]
        comm.Sendrecv(_raw(data[bounds[send]:bounds[send + 1]]), right, _TAG, _raw(got), left,
                      _TAG)
        _add_into(mine, got, code)
    _allgather_chunks(comm, data, bounds)


def _raw(a: Array) -> list[Any]:
    """As bytes: not every MPI has a float16 datatype (Open MPI 4 does not)."""
    from mpi4py import MPI

    return [a.view(np.uint8), MPI.BYTE]


def _add_into(acc: Array, other: Array, code: int) -> None:
    """acc += other, computed in float32, rounded once to the 16-bit type.

    torch (when the program uses it) adds 16-bit tensors that way with SIMD
    conversions; numpy's float16 casts are far slower, so they are only
    the fallback for numpy-only programs.
    """
    torch, dtype = torch_half(code)
    if torch is not None:
        a, b = (torch.from_numpy(x.view(np.int16)).view(dtype) for x in (acc, other))
        torch.add(a, b, out=a)
        return
    total = to_compute(acc, code) + to_compute(other, code)
    from_compute(total, code, acc)


def _allgather_chunks(comm: Any, data: Array, bounds: list[int]) -> None:
    """After the reduce-scatter rank r owns chunk (r+1) mod size: share them all."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    raw = data.view(np.uint8)
    item = data.itemsize
    counts = [(bounds[(r + 1) % size + 1] - bounds[(r + 1) % size]) * item for r in range(size)]
    displs = [bounds[(r + 1) % size] * item for r in range(size)]
    mine = raw[displs[rank]: displs[rank] + counts[rank]].copy()
    comm.Allgatherv([mine, MPI.BYTE], [raw, (counts, displs), MPI.BYTE])
