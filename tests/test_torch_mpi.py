"""Gradient reduction on real mpiexec jobs at 2 and 3 ranks (tiny models).

Each rank program runs many checks and prints `RANK r OK label`; a job is
run once per (program, ranks, backend, transport, loop) and each test
asserts its own labels, so every behaviour has a named test without extra
jobs. `transport` picks how buckets travel after the first round: through
the shared-memory window ("shm", the default when all ranks share a node)
or as one MPI allreduce per bucket ("allreduce", ASYNCLOCK_NODE_WINDOW=0), or over
gloo from the packing thread ("gloo", as across hosts where MPI's blocking call spins).

`backend` runs the same programs on the MPI transport and, where Horovod
loads, on the Horovod transport (ASYNCLOCK_BACKEND=horovod, under the MPI
Horovod was built for); ASYNCLOCK_TEST_BACKENDS=mpi narrows the matrix.
"""

from __future__ import annotations

import functools
import os

import pytest
from mpijob import (
    MPI_KIND,
    OTHER_KINDS,
    Job,
    assert_labels,
    horovod_status,
    run_job,
)

pytestmark = pytest.mark.mpi

BACKENDS = os.environ.get("ASYNCLOCK_TEST_BACKENDS", "mpi,horovod").split(",")


@functools.cache
def job(program: str, nranks: int, backend: str, transport: str, *args: str,
        kind: str = MPI_KIND) -> Job:
    env = {"ASYNCLOCK_BACKEND": backend,
           "ASYNCLOCK_NODE_WINDOW": "1" if transport == "shm" else "0"}
    if transport == "gloo":  # every bucket to gloo, as across hosts where MPI's call spins
        env |= {"ASYNCLOCK_BULK": "gloo", "ASYNCLOCK_GLOO_MIN_BYTES": "1"}
    if backend == "horovod":
        kind, why = horovod_status()
        if why:
            pytest.skip(why)
    return run_job(program, nranks, *args, timeout=180, env=env, kind=kind)


def cases(names: str, rows: list[tuple[object, ...]],
          long_rows: list[tuple[object, ...]] | None = None) -> pytest.MarkDecorator:
    """Parametrize over (backend, ...) rows of the backends under test; `long_rows` run
    with --long only."""
    def marks(row: tuple[object, ...], long: bool) -> list[pytest.MarkDecorator]:
        return ([pytest.mark.horovod] if row[0] == "horovod" else []) + (
            [pytest.mark.slow] if long else [])
    params = [pytest.param(*row, marks=marks(row, long))
              for long, group in ((False, rows), (True, long_rows or []))
              for row in group if row[0] in BACKENDS]
    return pytest.mark.parametrize(names, params)





# -- Horovod API (torch_grads.py) ------------------------------------------------------
# The Horovod transport at 3 ranks in CI, at 2 as well with --long.
# The shared window at 2 ranks runs in CI through the async API and the sharded programs.
grads_cases = cases("backend, nranks, transport", [
    ("mpi", 3, "shm"), ("mpi", 3, "gloo"), ("horovod", 3, "allreduce")],
    long_rows=[("mpi", 2, "shm"), ("mpi", 2, "allreduce"), ("mpi", 2, "gloo"),
               ("horovod", 2, "allreduce")])


def grads(nranks: int, transport: str, backend: str, *labels: str) -> None:
    assert_labels(job("torch_grads.py", nranks, backend, transport), nranks, *labels)


@grads_cases
def test_grads_equal_global_batch_for_every_bucket_cap(nranks: int, transport: str,
                                                       backend: str) -> None:
    grads(nranks, transport, backend, "caps_one_tensor_per_bucket", "caps_tiny_partitions",
          "caps_tiny_default", "caps_tiny_gathered",
          "caps_everything_in_one", "caps_default", "late_peer")


@grads_cases
def test_horovod_groups(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "groups_int", "groups_lists")


@grads_cases
def test_params_identical_after_20_steps(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "identical_20_steps", f"transport_{transport}")


@grads_cases
def test_step_closure_steps_on_the_reduced_gradients(nranks: int, transport: str,
                                                     backend: str) -> None:
    grads(nranks, transport, backend, "step_closure")


@grads_cases
def test_gradients_handed_on_some_ranks_only(nranks: int, transport: str, backend: str) -> None:
    grouped = "yes" if backend == "horovod" else "no"  # shm and MPI never use Horovod groups
    grads(nranks, transport, backend, "handed_some_ranks", f"grouped_{grouped}")


@grads_cases
def test_unused_and_frozen_parameters(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "unused_frozen")


@grads_cases
def test_accumulation_over_passes_and_no_sync(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "accumulate_passes", "accumulate_no_sync")


@grads_cases
def test_fp16_bf16_compression_within_tolerance(nranks: int, transport: str,
                                                backend: str) -> None:
    grads(nranks, transport, backend, "compression_fp16", "compression_bf16")


@grads_cases
def test_predivide_factor_and_sum_op(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "predivide", "sum")


@grads_cases
def test_gated_and_per_bucket_updates_bit_identical(nranks: int, transport: str,
                                                    backend: str) -> None:
    grads(nranks, transport, backend, "gated_bit_identical")


@grads_cases
def test_deferred_update_uses_the_lr_its_step_saw(nranks: int, transport: str,
                                                  backend: str) -> None:
    """Regression: a gated (deferred) update ran after the LR scheduler's step() and
    applied the next step's learning rate (0.022 from single-process training)."""
    grads(nranks, transport, backend, "gated_lr_of_its_step")


@grads_cases
def test_sparse_gradients_travel_dense(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "sparse_gradients")


@grads_cases
def test_too_many_backward_passes_error(nranks: int, transport: str, backend: str) -> None:
    grads(nranks, transport, backend, "too_many_passes")


@grads_cases
def test_different_hook_order_per_rank_still_agrees(nranks: int, transport: str,
                                                    backend: str) -> None:
    grads(nranks, transport, backend, "hook_order_differs")


@grads_cases
def test_mismatches_raise_same_error_on_every_rank(nranks: int, transport: str,
                                                   backend: str) -> None:
    shm = [f"mismatch_buckets_{transport}"] if transport in ("shm", "gloo") else []
    grads(nranks, transport, backend, "mismatch_params", "mismatch_options", "mismatch_buckets",
          "mismatch_buckets_allreduce", *shm)


# -- async API (torch_async.py) --------------------------------------------------------
async_cases = cases("backend, nranks, loop, transport", [
    ("mpi", 2, "asyncio", "shm"), ("mpi", 3, "trio", "allreduce"), ("mpi", 2, "asyncio", "gloo"),
    ("horovod", 3, "trio", "allreduce")], long_rows=[("horovod", 2, "asyncio", "allreduce")])


def async_labels(nranks: int, loop: str, transport: str, backend: str, *labels: str) -> None:
    args = ["--trio"] if loop == "trio" else []
    assert_labels(job("torch_async.py", nranks, backend, transport, *args), nranks, *labels)


@async_cases
def test_train_step_matches_single_process(nranks: int, loop: str, transport: str,
                                           backend: str) -> None:
    async_labels(nranks, loop, transport, backend, "basic", "no_sync", f"transport_{transport}")


@async_cases
def test_horovod_calls_from_a_worker_thread_inside_the_async_api(
        nranks: int, loop: str, transport: str, backend: str) -> None:
    async_labels(nranks, loop, transport, backend, "horovod_calls_from_a_thread")


@async_cases
def test_loop_stays_live_during_backward(nranks: int, loop: str, transport: str,
                                         backend: str) -> None:
    async_labels(nranks, loop, transport, backend, "loop_live_during_backward")


@async_cases
def test_train_step_modes_bit_identical(nranks: int, loop: str, transport: str,
                                        backend: str) -> None:
    async_labels(nranks, loop, transport, backend, "modes_bit_identical")


@async_cases
def test_sparse_gradients_and_a_refused_gate_in_the_train_step(
        nranks: int, loop: str, transport: str, backend: str) -> None:
    async_labels(nranks, loop, transport, backend, "sparse_gated_refused_gate")


@async_cases
def test_train_step_sharded_or_refused(nranks: int, loop: str, transport: str,
                                       backend: str) -> None:
    """The train step's shard_optimizer: unsharded bits on the shared window, the same
    clear ValueError on every rank without one."""
    shared = backend == "mpi" and transport == "shm"
    async_labels(nranks, loop, transport, backend,
                 "sharded_train_step" if shared else "sharded_refused")


@async_cases
def test_cancel_during_backward_keeps_ranks_consistent(nranks: int, loop: str, transport: str,
                                                      backend: str) -> None:
    async_labels(nranks, loop, transport, backend, "cancel_during_backward")



@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_train_step_on_the_other_mpi(kind: str) -> None:
    """The async API's whole program on the shared window of the other MPI: plain,
    gated and sharded train steps, cancellation during backward, and sharded steps
    closed right after a gated flush() (peers may still be ending that round)."""
    assert_labels(job("torch_async.py", 2, "mpi", "shm", kind=kind), 2, "basic", "no_sync",
                  "transport_shm", "loop_live_during_backward", "modes_bit_identical",
                  "cancel_during_backward", "sparse_gated_refused_gate", "sharded_train_step")

# -- an unchanged Horovod script (torch_hvd_script.py) ---------------------------------
@cases("backend, nranks, flags", [
    ("mpi", 3, ("--fp16-allreduce", "--gradient-predivide-factor", "2.0")), ("horovod", 2, ())],
    long_rows=[("mpi", 2, ())])
def test_horovod_script_runs_unchanged(nranks: int, flags: tuple[str, ...], backend: str) -> None:
    j = job("torch_hvd_script.py", nranks, backend, "shm", *flags)
    assert_labels(j, nranks, "trained", "identical", "collectives", "done")


# -- the shared window on the other MPI ---------------------------------------------------
# MPICH checks RMA synchronization (MPI_Win_sync only inside a passive-target epoch) where
# Open MPI lets it pass, so the window's users run on both MPIs: one 3-rank job each.
@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_shm_pipeline_on_the_other_mpi(kind: str) -> None:
    assert_labels(job("torch_grads.py", 3, "mpi", "shm", kind=kind), 3, "transport_shm",
                  "identical_20_steps", "caps_default", "handed_some_ranks",
                  "gated_bit_identical", "mismatch_buckets_shm")


# -- shard_optimizer (torch_sharded.py) ------------------------------------------------
sharded_cases = pytest.mark.parametrize("nranks, kind", [
    pytest.param(2, MPI_KIND, marks=pytest.mark.slow), (3, MPI_KIND),
    *[(2, kind) for kind in OTHER_KINDS]])


def sharded(nranks: int, kind: str, *labels: str) -> None:
    assert_labels(job("torch_sharded.py", nranks, "mpi", "shm", kind=kind), nranks, *labels)


@sharded_cases
def test_sharded_optimizer_trains_like_one_process(nranks: int, kind: str) -> None:
    """SGD (nesterov, weight decay), Adam (amsgrad), AdamW in two param groups under
    an LR scheduler, plain and gated: the single-process result; each rank keeps
    state for its pieces only; the parameters are the node window's one copy."""
    sharded(nranks, kind, "sharded_matches_global_batch")


@sharded_cases
def test_sharded_checkpoint_on_one_rank_and_resume(nranks: int, kind: str) -> None:
    sharded(nranks, kind, "sharded_checkpoint")


@sharded_cases
def test_sharded_accumulation_over_passes_and_no_sync(nranks: int, kind: str) -> None:
    sharded(nranks, kind, "sharded_accumulation")


@sharded_cases
def test_sharded_synchronize_then_clip_then_step(nranks: int, kind: str) -> None:
    sharded(nranks, kind, "sharded_synchronize_clip")


@sharded_cases
def test_sharded_step_skipped_after_synchronize(nranks: int, kind: str) -> None:
    """GradScaler skips step() after synchronize() where it finds inf or NaN: the next
    step neither hangs on the skipped round's release nor applies its update."""
    sharded(nranks, kind, "sharded_step_skipped")


@sharded_cases
def test_sharded_refuses_what_it_cannot_do_exactly(nranks: int, kind: str) -> None:
    sharded(nranks, kind, "sharded_refusals")


@sharded_cases
def test_sharded_refuses_a_joined_rank_on_every_other_rank(nranks: int, kind: str) -> None:
    sharded(nranks, kind, "sharded_join_refused")


@sharded_cases
def test_sharded_model_usable_after_shutdown(nranks: int, kind: str) -> None:
    sharded(nranks, kind, "sharded_usable_after_shutdown")


# -- torch.compile (torch_compiled.py) -------------------------------------------------
def test_compiled_models_train_like_eager_ones() -> None:
    """A compiled model trains to the eager global-batch result, plain and gated (the
    gated optimizer comes after the same model class was compiled: its hooks must not
    be skipped); SyncBatchNorm works inside one; Dynamo never traces asynclock's hooks;
    tied weights gate bit-identically; a gated parameter read before its update is an
    error on every rank."""
    j = run_job("torch_compiled.py", 2, timeout=240)
    assert_labels(j, 2, "compiled_plain_gated", "compiled_sync_batch_norm",
                  "tied_weights_gated", "stale_read_error")
    for noise in ("Dynamo does not know how to trace", "record_function", "Graph break"):
        assert noise not in j.output, f"{noise!r} in the output\n{j.explain()}"
