"""Bulk data stages wait for MPI without spinning (`transports.settle`): a rank whose
peer issues its data stage late spends a small share of a core meanwhile, over MPI
(the node window off), for an allreduce, the 16-bit ring and a broadcast, on both MPIs."""

from __future__ import annotations

import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_all_ok, run_job

pytestmark = pytest.mark.mpi

ENV = {"ASYNCLOCK_NODE_WINDOW": "0", "ASYNCLOCK_SPIN_US": "0", "ASYNCLOCK_BULK": "mpi"}
# The wait thread's path, which MPICH's loop band (`mpi.MPICH_LOOP_HI`) skips otherwise.
THREAD = {**ENV, "ASYNCLOCK_THREAD_MIN_BYTES": str(1 << 20)}


@pytest.mark.parametrize("kind", [MPI_KIND, *OTHER_KINDS])
@pytest.mark.parametrize("nranks, args", [(2, ()), (3, ("--trio", "--fp16")), (2, ("--bcast",))])
def test_bulk_stage_waits_for_a_late_peer_without_a_core(kind: str, nranks: int,
                                                         args: tuple[str, ...]) -> None:
    job = run_job("bulk_wait_cpu.py", nranks, *args, timeout=90, kind=kind, env=THREAD)
    assert_all_ok(job, nranks)


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_a_late_peer_costs_no_core_in_mpichs_loop_band(kind: str) -> None:
    """MPICH on one node keeps a mid-size allreduce on the loop (`Channel.loop_band`): its
    data stage starts after the header round has seen the late peer, so the wait for it
    is the header round's, asleep, and no stage goes to the wait thread."""
    job = run_job("bulk_wait_cpu.py", 2, "--on-loop", timeout=90, kind=kind, env=ENV)
    assert_all_ok(job, 2)
