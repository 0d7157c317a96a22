"""SyncBatchNorm on CPU: outputs, gradients and running statistics equal BatchNorm's
over the concatenated global batch, with a different batch size on every rank."""

from __future__ import annotations

import pytest
from mpijob import OTHER_KINDS, assert_all_ok, run_job

pytestmark = pytest.mark.mpi


# CI runs each API once at 2 and once at 3 ranks; --long runs all pairs.
SLOW = {(1, "async"), (1, "sync"), (2, "sync"), (3, "async")}


@pytest.mark.parametrize("nranks, api", [
    pytest.param(n, api, marks=[pytest.mark.slow] if (n, api) in SLOW else [])
    for n in (1, 2, 3) for api in ("sync", "async")])
def test_sync_batch_norm_matches_global_batch_norm(nranks: int, api: str) -> None:
    job = run_job("sync_batch_norm.py", nranks, *(["--async"] if api == "async" else []),
                  timeout=120)
    assert_all_ok(job, nranks)
    assert job.ok_lines(f"{api}_api") == set(range(nranks)), job.explain()


def test_sync_batch_norm_with_joined_ranks() -> None:
    """Rank r trains 1 + r steps, then joins: each step's statistics are those of the
    ranks still active (joined ranks stand in on SyncBatchNorm's channel too)."""
    job = run_job("sync_batch_norm.py", 3, "--join", timeout=120)
    assert_all_ok(job, 3)
    assert job.ok_lines("with_join") == {0, 1, 2}, job.explain()


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_sync_batch_norm_other_mpi(kind: str) -> None:
    job = run_job("sync_batch_norm.py", 3, timeout=120, kind=kind)
    assert_all_ok(job, 3)
    assert job.ok_lines("sync_api") == {0, 1, 2}, job.explain()
