"""Communicators and windows made after start-up are agreed calls (`engine.making`):
ranks out of step get an error on every rank within the stray timeout, never a hang
inside MPI, and the job goes on. 3 ranks, on every MPI installed."""

from __future__ import annotations

import pytest
from mpijob import DEFAULT_KIND, OTHER_KINDS, assert_labels, run_job

KINDS = [DEFAULT_KIND, *OTHER_KINDS]
# Short, so that an out-of-step make fails fast; the job's timeout names a hang.
ENV = {"ASYNCLOCK_STRAY_S": "2"}


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_step_process_sets(kind: str) -> None:
    job = run_job("agreed_make.py", 3, timeout=90, env=ENV, kind=kind)
    assert_labels(job, 3, "desync", "differ", "done")


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_step_optimizer(kind: str) -> None:
    job = run_job("agreed_make.py", 3, "--hvd", timeout=90, env=ENV, kind=kind)
    assert_labels(job, 3, "optimizer_desync", "optimizer_after", "done")
