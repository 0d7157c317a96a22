"""Bulk data stages wait for MPI without spinning (`transports.settle`): a rank whose
peer issues its data stage late spends a small share of a core meanwhile, over MPI
(the node window off), for an allreduce, the 16-bit ring and a broadcast, on both MPIs."""

from __future__ import annotations

import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_all_ok, run_job

pytestmark = pytest.mark.mpi

ENV = {"ASYNCLOCK_NODE_WINDOW": "0", "ASYNCLOCK_SPIN_US": "0", "ASYNCLOCK_BULK": "mpi"}


@pytest.mark.parametrize("kind", [MPI_KIND, *OTHER_KINDS])
@pytest.mark.parametrize("nranks, args", [(2, ()), (3, ("--trio", "--fp16")), (2, ("--bcast",))])
def test_bulk_stage_waits_for_a_late_peer_without_a_core(kind: str, nranks: int,
                                                         args: tuple[str, ...]) -> None:
    job = run_job("bulk_wait_cpu.py", nranks, *args, timeout=90, kind=kind, env=ENV)
    assert_all_ok(job, nranks)
