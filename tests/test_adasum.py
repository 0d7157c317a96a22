"""hvd.allreduce(op=hvd.Adasum): results equal a float64 reference tree on every rank,
and the same checks pass on Horovod 0.28.1 (so they are Horovod's semantics)."""

from __future__ import annotations

import re

import pytest
from mpijob import OTHER_KINDS, assert_all_ok, horovod_status, run_job

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("nranks", [pytest.param(1, marks=pytest.mark.slow), 2, 4])
def test_adasum_matches_the_reference_tree(nranks: int) -> None:
    job = run_job("adasum.py", nranks, timeout=180)
    assert_all_ok(job, nranks)
    assert job.ok_lines("adasum") == set(range(nranks)), job.explain()
    assert job.ok_lines("names") == set(range(nranks)), job.explain()
    assert job.ok_lines("ints") == set(range(nranks)), job.explain()


def test_adasum_refuses_a_size_that_is_not_a_power_of_two() -> None:
    job = run_job("adasum.py", 3, timeout=120)
    assert_all_ok(job, 3)
    assert job.ok_lines("refused") == {0, 1, 2}, job.explain()


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_adasum_other_mpi(kind: str) -> None:
    job = run_job("adasum.py", 2, timeout=120, kind=kind)
    assert_all_ok(job, 2)
    assert job.ok_lines("adasum") == {0, 1}, job.explain()


@pytest.mark.horovod
@pytest.mark.parametrize("nranks", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_adasum_checks_pass_on_real_horovod(nranks: int) -> None:
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    job = run_job("adasum.py", nranks, "--horovod", timeout=240, kind=kind)
    assert_all_ok(job, nranks)
    assert job.ok_lines("adasum") == set(range(nranks)), job.explain()


def _optimizer_values(job_output: str) -> list[float]:
    m = re.search(r"RANK 0 OK optimizer ([-0-9. ]+)", job_output)
    assert m, job_output[-3000:]
    return [float(v) for v in m.group(1).split()]


@pytest.mark.horovod
@pytest.mark.parametrize("nranks", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_adasum_optimizer_ends_where_horovods_does(nranks: int) -> None:
    """DistributedOptimizer(op=Adasum), SGD with momentum, 3 steps from the same start and
    data: asynclock's parameters equal Horovod 0.28.1's (each rank's own optimizer step,
    then the changes combined with Adasum)."""
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    ours = run_job("adasum.py", nranks, "--optimizer", timeout=180, kind=kind)
    theirs = run_job("adasum.py", nranks, "--optimizer", "--horovod", timeout=240, kind=kind)
    for job in (ours, theirs):
        assert_all_ok(job, nranks)
        assert job.ok_lines("optimizer") == set(range(nranks)), job.explain()
    assert _optimizer_values(ours.output) == pytest.approx(_optimizer_values(theirs.output),
                                                           abs=2e-6)
