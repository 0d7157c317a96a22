"""Mid-size allreduces' data through the node's shared memory (`_fastpath.c`'s NodeData),
in real jobs on both MPIs: every op and dtype it folds against numpy's rank-order fold,
bit-identical on every rank, rounds in flight past the segment's depth, a late rank,
what stays on MPI, and the switch that turns it off."""

from __future__ import annotations

import pytest
from mpijob import assert_labels, crossed, run_job
from test_collectives_mpi import need_fastpath

pytestmark = pytest.mark.mpi
LABELS = ("ops", "in_flight", "left_to_mpi", "done")


@pytest.mark.parametrize("kind, nranks, loop", crossed([(2, "asyncio"), (3, "trio")]))
def test_node_data_allreduce_matches_rank_order_fold(kind: str, nranks: int, loop: str) -> None:
    need_fastpath()
    args = ["--trio"] if loop == "trio" else []
    job = run_job("node_data.py", nranks, *args, timeout=120, kind=kind)
    assert_labels(job, nranks, *LABELS)


def test_node_data_switched_off_leaves_allreduces_to_mpi() -> None:
    job = run_job("node_data.py", 2, "--off", timeout=120,
                  env={"ASYNCLOCK_NODE_DATA_MAX_BYTES": "0"})
    assert_labels(job, 2, *LABELS)
