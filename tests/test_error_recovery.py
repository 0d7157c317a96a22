"""An error is local to the call that failed (issue: conformance and error recovery).

`programs/error_trials.py` runs 200 randomized trials per job: one bad call on a
random subset of ranks (a shape, dtype, op or kind mismatch, names that differ,
invalid input, a named call issued early by some ranks, a cancelled wait, a
duplicate name in flight, named calls issued in different orders), then 20
ordinary collectives that must give exact results on every rank, with nothing
left in flight after each trial.
"""

from __future__ import annotations

import pytest
from mpijob import OTHER_KINDS, assert_all_ok, horovod_status, run_job

STRAY = {"ASYNCLOCK_STRAY_S": "0.2"}  # names that differ by rank fail after this


def loops_and_sizes(in_ci: set[tuple[str, int]]) -> pytest.MarkDecorator:
    """Both loops at 2 and 3 ranks; the pairs not `in_ci` run with --long (CI runs each
    loop and each size once per backend)."""
    return pytest.mark.parametrize("loop, nranks", [
        pytest.param(loop, n, marks=[] if (loop, n) in in_ci else [pytest.mark.slow])
        for loop in ("asyncio", "trio") for n in (2, 3)])


@loops_and_sizes({("asyncio", 2), ("trio", 3)})
def test_error_trials_mpi(nranks: int, loop: str, request: pytest.FixtureRequest) -> None:
    trials = "200" if request.config.getoption("--long") else "100"
    args = ["--trials", trials] + (["--trio"] if loop == "trio" else [])
    job = run_job("error_trials.py", nranks, *args, timeout=180, env=STRAY)
    assert_all_ok(job, nranks)
    assert f"mpi: {trials} trials" in job.output, job.explain()


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_error_trials_on_the_other_mpi(kind: str) -> None:
    """A sample on the MPI the default does not pick: 3 ranks (where ranks that fall
    out of step meet MPICH's communicator creation), asyncio, 100 trials from a seed of
    their own, so they draw other errors than the runs above."""
    job = run_job("error_trials.py", 3, "--trials", "100", "--seed", "2", timeout=150,
                  env=STRAY, kind=kind)
    assert_all_ok(job, 3)
    assert "mpi: 100 trials" in job.output, job.explain()


@loops_and_sizes({("trio", 2), ("asyncio", 3)})
def test_error_trials_horovod(nranks: int, loop: str, request: pytest.FixtureRequest) -> None:
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    # Each trial costs Horovod's negotiation cycle, so CI draws a quarter as many here.
    trials = "200" if request.config.getoption("--long") else "50"
    args = ["--trials", trials] + (["--trio"] if loop == "trio" else [])
    job = run_job("error_trials.py", nranks, *args, timeout=180, kind=kind,
                  env={**STRAY, "ASYNCLOCK_BACKEND": "horovod"})
    assert_all_ok(job, nranks)
    assert f"horovod: {trials} trials" in job.output, job.explain()
