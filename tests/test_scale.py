"""Past 3 ranks: the suites' programs at 4 ranks (collectives, the drop-in, sync
primitives, error recovery, gradients), and a subset at 8.

Everything here runs oversubscribed on a 2-core machine, so the programs are the
quick ones, and CI runs the ones whose 4-rank run adds most (the shared window, process
sets, the lock contract, the primitives); `--long` runs the rest, and the collective
matrix and join at 4 ranks in their own modules.
What only shows past 3 ranks: MPI picks other algorithms (Open MPI's non-blocking
allreduce at 4 ranks checks that every rank agrees on the in-place form), matching
tables and stand-in rounds see more than one other rank disagree.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mpijob import MPI_KIND, assert_all_ok, assert_labels, run_job
from test_sync import CONTRACT, LOCK_KINDS

pytestmark = pytest.mark.mpi

STRAY = {"ASYNCLOCK_STRAY_S": "0.2"}  # names that differ by rank fail after this


@pytest.mark.parametrize("nranks, loop", [pytest.param(4, "asyncio", marks=pytest.mark.slow),
                                          pytest.param(8, "trio", marks=pytest.mark.slow)])
def test_error_trials(nranks: int, loop: str) -> None:
    trials = "100" if nranks == 4 else "40"
    job = run_job("error_trials.py", nranks, "--trials", trials,
                  *(["--trio"] if loop == "trio" else []), timeout=240, env=STRAY)
    assert_all_ok(job, nranks)
    assert f"mpi: {trials} trials" in job.output, job.explain()


@pytest.mark.parametrize("nranks", [pytest.param(4, marks=pytest.mark.slow),
                                    pytest.param(8, marks=pytest.mark.slow)])
def test_small_collectives(nranks: int) -> None:
    job = run_job("small_calls.py", nranks, timeout=240)
    assert_labels(job, nranks, "folds", "hand_off", "mismatch_after_hand_off",
                  "mismatch_in_the_spin", "cancel_after_hand_off")


@pytest.mark.slow
def test_horovod_api_at_4() -> None:
    job = run_job("torch_horovod_api.py", 4, timeout=240)
    assert_labels(job, 4, "allreduce_grad", "grouped_allreduce_grad", "allgather_grad",
                  "broadcast_grad", "alltoall_grad", "reducescatter_grad",
                  "duplicate_names")


def test_lock_contract_at_4(tmp_path: Path) -> None:
    job = run_job("sync_contract.py", 4, str(tmp_path), timeout=240, kind=MPI_KIND)
    assert_labels(job, 4, *[f"{check}_{kind}" for check in [*CONTRACT, "lease"]
                            for kind in LOCK_KINDS])


def test_primitives_at_4(tmp_path: Path) -> None:
    job = run_job("sync_primitives.py", 4, "--trio", str(tmp_path), timeout=240)
    assert_labels(job, 4, "condition_notify", "condition_wait_for", "event", "sequential",
                  "consistency_point", "consistency_mismatch")


def test_process_sets_at_4() -> None:
    job = run_job("process_sets.py", 4, timeout=240)
    assert_all_ok(job, 4)


@pytest.mark.slow  # CI: the same program on the window at 3 ranks (test_torch_mpi)
def test_gradients_over_the_shared_window_at_4() -> None:
    """The Horovod-style optimizer on the node's shared-memory pipeline: 20 steps
    identical on every rank, gated updates bit-identical, sparse gradients."""
    job = run_job("torch_grads.py", 4, timeout=240,
                  env={"ASYNCLOCK_BACKEND": "mpi", "ASYNCLOCK_NODE_WINDOW": "1"})
    assert_labels(job, 4, "transport_shm", "identical_20_steps", "gated_bit_identical",
                  "sparse_gradients", "mismatch_buckets_shm")


@pytest.mark.slow
def test_sharded_optimizer_at_4() -> None:
    job = run_job("torch_sharded.py", 4, timeout=240,
                  env={"ASYNCLOCK_BACKEND": "mpi", "ASYNCLOCK_NODE_WINDOW": "1"})
    assert_labels(job, 4, "sharded_matches_global_batch", "sharded_checkpoint",
                  "sharded_refusals", "sharded_join_refused")
