"""Horovod API details of `asynclock.torch` on a real 2-rank job
(tests/programs/torch_horovod_api.py): what Horovod's own test file checks."""

from __future__ import annotations

import functools

import pytest
from mpijob import Job, assert_all_ok, run_job

pytestmark = pytest.mark.mpi


@functools.cache
def job() -> Job:
    return run_job("torch_horovod_api.py", 2, timeout=120)


@pytest.mark.parametrize("label", [
    "allreduce_grad", "grouped_allreduce_grad", "allgather_grad", "broadcast_grad",
    "alltoall_grad", "reducescatter_grad", "no_grad_plain", "integer_scaling",
    "handles_and_parameters",
    "optimizer_state_created", "parameter_names", "duplicate_names"])
def test_horovod_api(label: str) -> None:
    j = job()
    assert_all_ok(j, 2)
    assert j.ok_lines(label) == {0, 1}, f"{label}\n{j.explain()}"
