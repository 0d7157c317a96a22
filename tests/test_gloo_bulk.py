"""Bulk allreduces over asynclock's private gloo group (asynclock._core.transports.gloo_bulk).

Across hosts `auto` measures MPI against gloo and agrees on one; these
tests force each choice on one node (`ASYNCLOCK_BULK`), lower the size from
which gloo takes over to 1 MiB, and check values, the path taken (gloo call
counts) and that every rank made the same choice. tests/test_netrig.py runs
the measured choice across two hosts.
"""

from __future__ import annotations

from typing import Any

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
    bulk_job("measure", "gloo from |gloo for every bulk allreduce: |mpi (allreduce 4 MiB")


def test_no_rank_uses_gloo_unless_every_rank_imported_torch() -> None:
    bulk_job("gloo", "mpi (torch with gloo not imported on every rank)", 2,
              "--no-torch-on-rank0")


@pytest.mark.parametrize(("mpi_alone", "gloo_alone", "mpi_beside", "gloo_beside", "mpi_cpu",
                          "gloo_cpu", "wins"), [
    (10.0, 8.5, 10.5, 9.0, 10.0, 9.0, True),     # faster either way
    (10.0, 9.5, 10.5, 10.0, 10.0, 9.0, False),   # 5% faster beside compute, as much CPU: MPI
    (7.0, 10.5, 14.9, 12.0, 7.0, 3.0, True),     # the rig's 4 MiB: MPI faster alone, its spin
                                                 # no core to spare
    (10.0, 14.0, 10.5, 14.2, 10.0, 4.0, False),  # a spare core (or IPoIB against InfiniBand)
    (10.0, 25.0, 20.0, 15.0, 10.0, 2.0, False),  # beside compute better, but 2.5x slower alone
    (10.0, 10.0, 12.0, 11.5, 10.0, 9.0, False),  # about as fast both ways, as much CPU: MPI
    (12.6, 7.2, 27.3, 26.1, 12.6, 2.5, True),    # the rig's 4 MiB under a short load: alike
                                                 # beside it, but MPI spins a core throughout
    (12.6, 7.2, 27.3, 30.5, 12.6, 2.5, False),   # lighter, but 12% slower beside compute
    (7.0, 7.6, 13.6, 13.2, 7.0, 4.2, True),      # the rig's 4 MiB on MPICH: alike, 60% of
                                                 # MPI's CPU
    (7.0, 7.6, 13.6, 13.2, 7.0, 5.6, False),     # alike, 80% of MPI's CPU: MPI
])
def test_gloo_wins_beside_compute_without_losing_much_alone(
        mpi_alone: float, gloo_alone: float, mpi_beside: float, gloo_beside: float,
        mpi_cpu: float, gloo_cpu: float, wins: bool) -> None:
    """The probe's rule. Regressions: an idle-machine rule, and later a short probe
    load that hid the spin, chose MPI for 4 MiB buckets on the 2-host rig, and MPI's
    spinning wait thread took the core its own backward needed: ~100 ms of CPU per
    MLP step."""
    from asynclock._core.transports.gloo_bulk import _gloo_wins

    assert _gloo_wins(mpi_alone, gloo_alone, mpi_beside, gloo_beside, mpi_cpu,
                      gloo_cpu) is wins


MiB = 1 << 20


@pytest.mark.parametrize(("rows", "gloo_from"), [
    # the rig's MPICH: MPI faster beside compute, but its blocking call spins a core
    ([[7.2, 7.1, 11.2, 13.5, 7.2, 3.3, 7.2], [29.0, 29.4, 41.0, 41.3, 29.0, 9.0, 29.0]], 0),
    # the rig's Open MPI: gloo wins outright, and MPI spins
    ([[12.4, 7.5, 22.8, 16.0, 12.4, 4.4, 12.4], [50.0, 28.5, 80.0, 62.4, 50.0, 12.0, 50.0]], 0),
    # the rig's MPICH on a loaded machine (CI): the spinning call gets half a core, its
    # CPU time alone reads as sleeping, its run-queue wait shows the spin
    ([[11.9, 14.2, 32.2, 34.4, 5.6, 5.1, 11.8], [27.5, 28.0, 138.5, 107.3, 17.8, 16.1, 27.4]],
     0),
    # MPI spins, but gloo alone is 2.5x slower (IPoIB against InfiniBand): MPI
    ([[4.0, 10.0, 5.0, 11.0, 4.0, 2.0, 4.0], [16.0, 40.0, 20.0, 44.0, 16.0, 8.0, 16.0]], None),
    # MPI sleeps in its call: only where gloo wins beside compute (16 MiB here)
    ([[10.0, 10.0, 12.0, 11.5, 2.0, 2.0, 2.1], [40.0, 36.0, 48.0, 40.0, 8.0, 4.0, 8.1]],
     16 * MiB),
    ([[10.0, 10.0, 12.0, 11.5, 2.0, 2.0, 2.1], [40.0, 40.0, 48.0, 47.0, 8.0, 8.0, 8.1]], None),
])
def test_gloo_takes_every_bulk_allreduce_where_mpis_blocking_call_spins(
        rows: list[list[float]], gloo_from: int | None) -> None:
    """Issue 37: no wait thread spins a core. A spinning MPI call takes a core for its
    whole length at any size, so the choice is all bulk allreduces, not a size."""
    from asynclock._core.transports.gloo_bulk import _decide

    assert _decide(rows) == gloo_from


def test_a_spin_reads_as_a_spin_on_a_loaded_machine() -> None:
    """The probe's spin test reads the calling thread's run and run-queue time: a
    thread polling beside twice as many busy processes as cores gets a third of a
    core, so its CPU time alone reads as sleeping (a CI run chose MPI that way),
    while a thread asleep in the kernel reads as asleep however loaded the machine."""
    import os
    import subprocess
    import sys
    import time

    from asynclock._core.transports.gloo_bulk import SPIN_SHARE, _runnable, _spins

    def measured(fn: Any) -> tuple[float, float, float]:
        t0, c0, r0 = time.perf_counter(), time.thread_time(), _runnable()
        fn()
        return time.perf_counter() - t0, time.thread_time() - c0, _runnable() - r0

    def poll() -> None:
        end = time.perf_counter() + 0.3
        while time.perf_counter() < end:
            pass

    cores = len(os.sched_getaffinity(0))
    load = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(2 * cores)]
    try:
        time.sleep(0.3)
        wall, cpu, runnable = measured(poll)
        assert cpu < SPIN_SHARE * wall, "the machine was not loaded: the test shows nothing"
        assert _spins(wall, runnable), (wall, cpu, runnable)
        wall, cpu, runnable = measured(lambda: time.sleep(0.3))
        assert not _spins(wall, runnable), (wall, cpu, runnable)
    finally:
        for proc in load:
            proc.kill()
            proc.wait()


def test_the_probe_load_runs_beside_the_call_and_is_waited_for() -> None:
    """`beside` returns only once both the call and the load are done, and the load
    is sized from a time (so a slow call meets a proportionate load). Counted, not
    timed: a CI run measured 0.9 ms for a nominal 20 ms load (calibration on a busy core)."""
    pytest.importorskip("torch")
    import time

    from asynclock._core.transports.gloo_bulk import _Load

    assert _Load(0.02, chunk_seconds=0.001).chunks == 20
    assert _Load(0.0001, chunk_seconds=0.001).chunks == 1
    load = _Load(0.02, chunk_seconds=0.001)
    load.beside(lambda: None)
    assert load.done == 20  # every chunk ran before `beside` returned
    t0 = time.perf_counter()
    load.beside(lambda: time.sleep(0.1))
    assert time.perf_counter() - t0 >= 0.1 and load.done == 20
    assert _Load(0.02).chunks >= 1  # the measured size
