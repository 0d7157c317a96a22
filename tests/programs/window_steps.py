"""The node window's loop steps in C (`_fastpath.c`'s WindowSteps) beside Python's.

    window_steps.py

Every rank of the job is on one node, with the C extension built for its MPI. A
`NodeWindow` over the world runs allreduces on its loop path (`on_loop`, each
request tested until it finishes); before each one every rank picks C or Python
steps by a pattern that differs between ranks, so in some allreduces all ranks
run C, in some all run Python, and in the rest the two meet on one window.
Checks, each reported by every rank:

* `mixed`: every result equals numpy's rank-order fold bit for bit, for every
  dtype and op the C steps fold (and int16, which only Python's fold, with the
  C steps armed), at sizes whose slices differ in length; both paths ran here;
* `abort`: the last rank aborts its window; every other rank's C steps, already
  under way, raise BackendError naming it or a rank that failed on seeing it
  (a rank whose steps fail aborts too, and peers scan in rank order).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
from _common import report, run_or_abort
from mpi4py import MPI

from asynclock._core.base.errors import BackendError
from asynclock._core.base.ops import ReduceOp
from asynclock._core.engine import fastpath
from asynclock._core.transports.node_window import NodeWindow

Array = np.ndarray[Any, Any]
DTYPES = [np.float32, np.float64, np.int32, np.int64, np.int16]
OPS = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
       ReduceOp.PRODUCT: np.multiply}
SIZES = [70_001, 4099]  # items: slices of unequal length


def contribution(rank: int, n: int, dtype: Any, op: ReduceOp) -> Array:
    rng = np.random.default_rng(500 + rank)
    if np.issubdtype(dtype, np.floating):
        return (rng.standard_normal(n) * (1.0 if op is ReduceOp.PRODUCT else 1000.0)).astype(dtype)
    high = 3 if op is ReduceOp.PRODUCT else 100
    return rng.integers(-high, high, n).astype(dtype)


def reference(op: ReduceOp, n: int, dtype: Any, size: int) -> Array:
    acc = contribution(0, n, dtype, op)
    for r in range(1, size):
        acc = OPS[op](acc, contribution(r, n, dtype, op))
    return acc


def finish(request: Any) -> None:
    while not request.Test():  # the peers step in their own processes
        pass


def uses_c(rank: int, i: int) -> bool:
    """All C, all Python, then C and Python on alternate ranks, in turn."""
    mode = i % 4
    return mode == 0 or (mode > 1 and (rank + i) % 2 == 0)


def check_mixed(window: NodeWindow, steps: Any, rank: int, size: int) -> None:
    i = 0
    for n in SIZES:
        for dtype in DTYPES:
            for op in OPS:
                for in_place in (False, True):
                    window.use_c_steps(steps if uses_c(rank, i) else None)
                    i += 1
                    src = contribution(rank, n, dtype, op)
                    out = src if in_place else np.empty_like(src)
                    request = window.on_loop(None if in_place else src, out, op)
                    assert request is not None, "the loop path refused an allreduce"
                    finish(request)
                    want = reference(op, n, dtype, size)
                    what = f"{op.name} {np.dtype(dtype).name} n={n} in_place={in_place}"
                    assert np.array_equal(out, want), f"{what}: {out[:4]} != {want[:4]}"
    assert window.c_calls > 0, "no allreduce ran the C steps"
    assert window.loop_calls > window.c_calls, "no allreduce ran the Python steps"


def check_abort(window: NodeWindow, steps: Any, rank: int, size: int, comm: Any) -> None:
    last = size - 1
    window.use_c_steps(steps)
    n, op = 70_001, ReduceOp.SUM
    src = contribution(rank, n, np.float32, op)
    request = window.on_loop(src, np.empty_like(src), op) if rank != last else None
    comm.Barrier()  # every other rank's allreduce is under way before the abort
    if rank == last:
        window._abort()
    comm.Barrier()
    named = last
    if request is not None:
        try:
            finish(request)
        except BackendError as exc:  # the last rank, or a rank that failed on seeing it
            named = int(str(exc).split("node rank ")[1].split()[0])
            assert f"node rank {named} failed in a shared-window allreduce" in str(exc), exc
        else:
            raise AssertionError("the C steps waited on an aborted rank without an error")
    comm.Barrier()
    assert window._win is not None
    failed = window._win.aborted()
    assert last in failed and named in failed, (named, failed)


def main() -> None:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    mod = fastpath.module()
    assert mod is not None, "the C extension is not built for this MPI (launch/setup.sh)"
    window = NodeWindow(comm, 1, lambda op: MPI.SUM)
    first = np.ones(max(SIZES), np.float64)  # makes the window, large enough for all
    assert window.allreduce(None, first, ReduceOp.SUM), "one node, two ranks at least"
    assert (first == size).all()
    check_mixed(window, mod.WindowSteps, rank, size)
    report(rank, "mixed", f"{window.c_calls} of {window.loop_calls} in C")
    check_abort(window, mod.WindowSteps, rank, size, comm)
    report(rank, "abort")
    window.close()
    report(rank, "done")
    sys.stdout.flush()


if __name__ == "__main__":
    run_or_abort(main)
