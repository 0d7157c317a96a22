"""Bulk allreduces over asynclock's private gloo group (asynclock.backends.gloo_bulk).

Across hosts `auto` measures MPI against gloo and agrees on one; these
tests force each choice on one node (`ASYNCLOCK_BULK`), lower the size from
which gloo takes over to 1 MiB, and check values, the path taken (gloo call
counts) and that every rank made the same choice. tests/test_netrig.py runs
the measured choice across two hosts.
"""

from __future__ import annotations

import pytest
from mpijob import MPI_KIND, OTHER_KINDS, assert_all_ok, run_job

pytestmark = pytest.mark.mpi
SMALL = {"ASYNCLOCK_GLOO_MIN_BYTES": str(1 << 20)}


def bulk_job(mode: str, expect: str, nranks: int = 2, *args: str, kind: str | None = None
             ) -> None:
    job = run_job("gloo_bulk.py", nranks, expect, *args, timeout=180,
                  env={"ASYNCLOCK_BULK": mode, **SMALL}, kind=kind or MPI_KIND)
    assert_all_ok(job, nranks)
    choices = {line.split(" OK done ")[1].split(" | ")[0] for line in job.output.splitlines()
               if " OK done " in line}
    assert len(choices) == 1, job.explain()


@pytest.mark.parametrize("nranks, loop", [(2, "asyncio"), (3, "trio")])
def test_gloo_bulk_allreduce_values_every_op_and_dtype(nranks: int, loop: str) -> None:
    bulk_job("gloo", "gloo", nranks, *(["--trio"] if loop == "trio" else []))


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_gloo_bulk_on_the_other_mpi(kind: str) -> None:
    bulk_job("gloo", "gloo", 2, kind=kind)


def test_auto_keeps_mpi_within_one_node() -> None:
    bulk_job("auto", "mpi (one node)")


def test_measured_choice_is_the_same_on_every_rank() -> None:
    bulk_job("measure", "gloo from |mpi (allreduce 4 MiB")


def test_no_rank_uses_gloo_unless_every_rank_imported_torch() -> None:
    bulk_job("gloo", "mpi (torch with gloo not imported on every rank)", 2,
              "--no-torch-on-rank0")


@pytest.mark.parametrize(("mpi_wall", "gloo_wall", "mpi_cpu", "gloo_cpu", "wins"), [
    (10.0, 8.5, 10.0, 10.0, True),   # 15% faster: time alone decides
    (10.0, 9.5, 10.0, 10.0, False),  # 5% faster at the same CPU: not worth a second path
    (9.0, 9.2, 9.0, 6.5, True),      # the rig's 4 MiB on a bad day: as fast, MPI spinning
    (10.0, 12.0, 10.0, 7.0, True),   # 20% slower at 70% of the CPU
    (10.0, 14.0, 10.0, 1.0, False),  # 40% slower (say IPoIB against InfiniBand): MPI
    (10.0, 10.0, 10.0, 8.0, False),  # as fast at 80% of the CPU: MPI
])
def test_gloo_wins_on_time_or_on_cpu_at_little_cost_in_time(
        mpi_wall: float, gloo_wall: float, mpi_cpu: float, gloo_cpu: float, wins: bool) -> None:
    """The probe's rule (regression: a wall-time-only rule chose MPI for 4 MiB
    buckets on the 2-host rig when both took about as long, and MPI's spinning
    wait thread cost ~85 ms of CPU per MLP step)."""
    from asynclock.backends.gloo_bulk import _gloo_wins

    assert _gloo_wins(mpi_wall, gloo_wall, mpi_cpu, gloo_cpu) is wins
