"""Large allreduces through the node's shared window (`transports.node_window`),
in real jobs on both MPIs: every op and dtype against numpy's rank-order fold,
bit-identical on every rank, in place and not, a cancelled await, a mismatch,
a process set, and the switch that turns it off; the loop's steps in C and in
Python, on one window within one allreduce, and a peer's abort under the C steps."""

from __future__ import annotations

import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_labels, crossed, run_job

pytestmark = pytest.mark.mpi

# Small sizes take the window here, so odd sizes and every dtype stay quick.
SMALL = {"ASYNCLOCK_THREAD_MIN_BYTES": "4096", "ASYNCLOCK_WINDOW_MIN_BYTES": "4096"}
LABELS = ("ops", "cancelled", "together", "mismatch", "process_set")


@pytest.mark.parametrize("kind, nranks, loop", crossed([(2, "asyncio"), (4, "trio")]))
def test_window_allreduce_matches_rank_order_fold(kind: str, nranks: int, loop: str) -> None:
    args = ["--trio"] if loop == "trio" else []
    job = run_job("node_window.py", nranks, *args, timeout=120, kind=kind, env=SMALL)
    assert_labels(job, nranks, *LABELS)


@pytest.mark.parametrize("kind", [MPI_KIND, *OTHER_KINDS])
@pytest.mark.parametrize("nranks", [2, 3])
def test_c_and_python_steps_meet_on_one_window(kind: str, nranks: int) -> None:
    job = run_job("window_steps.py", nranks, timeout=60, kind=kind)
    assert_labels(job, nranks, "mixed", "abort")


def test_window_switched_off_leaves_allreduces_to_mpi() -> None:
    job = run_job("node_window.py", 2, "--off", timeout=120,
                  env={**SMALL, "ASYNCLOCK_NODE_WINDOW": "0"})
    assert_labels(job, 2, *LABELS)


@pytest.mark.parametrize("kind", [MPI_KIND, *OTHER_KINDS])
def test_default_sizes_take_the_window_on_the_loop_or_in_the_thread(kind: str) -> None:
    job = run_job("window_band.py", 2, timeout=120, kind=kind)
    assert_labels(job, 2, "band")
