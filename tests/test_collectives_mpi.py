"""Real multi-rank jobs: every collective, dtype and op at 1, 2 and 3 ranks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from mpijob import (
    MPI_KIND,
    OTHER_KINDS,
    assert_all_ok,
    horovod_status,
    horovodrun_missing,
    mpi_select,
    run_horovodrun,
    run_job,
)

pytestmark = pytest.mark.mpi


LONG = pytest.mark.slow  # with --long: CI covers each loop and size in the other cases


@pytest.mark.parametrize("nranks, loop", [(1, "asyncio"), pytest.param(1, "trio", marks=LONG),
                                          (2, "asyncio"), pytest.param(2, "trio", marks=LONG),
                                          pytest.param(3, "asyncio", marks=LONG), (3, "trio"),
                                          pytest.param(4, "asyncio", marks=LONG)])
def test_collectives_matrix(nranks: int, loop: str) -> None:
    args = ["--trio"] if loop == "trio" else []
    job = run_job("collectives_matrix.py", nranks, *args, timeout=240)
    assert_all_ok(job, nranks)
    for label in ("check_allreduce", "check_mixed_in_place", "check_broadcast", "check_allgather",
                  "check_reduce_scatter_alltoall", "check_many_in_flight"):
        assert job.ok_lines(label) == set(range(nranks)), job.explain()


@pytest.mark.parametrize("kind", OTHER_KINDS)
@pytest.mark.parametrize("nranks, loop", [(2, "asyncio"), (3, "trio")])
def test_collectives_matrix_other_mpi(kind: str, nranks: int, loop: str) -> None:
    args = ["--trio"] if loop == "trio" else []
    job = run_job("collectives_matrix.py", nranks, *args, timeout=240, kind=kind)
    assert_all_ok(job, nranks)


@pytest.mark.parametrize("nranks", [1, 2, 3])
def test_bad_input_errors_on_every_rank(nranks: int) -> None:
    # a name that differs by rank waits out the stray timeout, then UnmatchedError
    job = run_job("bad_input.py", nranks, timeout=120, env={"ASYNCLOCK_STRAY_S": "0.5"})
    assert_all_ok(job, nranks)
    labels = ["dtype_unsupported", "root", "not_tensor", "after_shutdown", "not_initialized"]
    if nranks > 1:
        labels += ["noncontiguous", "shape", "shape_big", "dtype", "op", "op_name", "kind",
                   "name", "device", "unpicklable", "unpicklable_root"]
    for label in labels:
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"


def test_start_refuses_settings_that_differ_across_ranks() -> None:
    job = run_job("config_mismatch.py", 2, timeout=60)
    assert_all_ok(job, 2, "refused")


# -- the same matrix on the Horovod backend -------------------------------------------------
HOROVOD_LAUNCHES = [("mpirun", 2, "asyncio"), ("mpirun", 3, "trio"), ("horovodrun", 2, "asyncio"),
                    ("horovodrun-gloo", 2, "trio")]


@pytest.mark.horovod
@pytest.mark.parametrize("launch, nranks, loop", [
    # CI: 3 ranks under mpirun and horovodrun's gloo controller; its MPI controller and
    # 2 ranks under mpirun with --long (test_horovod's matrix runs those 2 ranks in CI).
    pytest.param(*case, marks=LONG if case[:2] in (("mpirun", 2), ("horovodrun", 2)) else [],
                 id="-".join(map(str, case))) for case in HOROVOD_LAUNCHES])
def test_collectives_matrix_horovod(launch: str, nranks: int, loop: str) -> None:
    """Data stages over Horovod handles, headers over MPI (over Horovod under gloo).

    Under horovodrun's gloo controller `auto` must pick Horovod by itself; its
    MPI controller exports no HOROVOD_* variables, so the job names the backend.
    """
    kind, why = horovod_status()
    why = why or (horovodrun_missing(launch.endswith("gloo")) if launch != "mpirun" else "")
    if why:
        pytest.skip(why)
    args = ["--expect-backend", "horovod", *(["--trio"] if loop == "trio" else [])]
    env = {} if launch == "horovodrun-gloo" else {"ASYNCLOCK_BACKEND": "horovod"}
    if launch == "mpirun":
        job = run_job("collectives_matrix.py", nranks, *args, timeout=240, kind=kind, env=env)
    else:
        job = run_horovodrun("collectives_matrix.py", nranks, *args, timeout=240, env=env,
                             gloo=launch.endswith("gloo"))
    assert_all_ok(job, nranks)
    for label in ("backend", "check_allreduce", "check_broadcast", "check_allgather",
                  "check_reduce_scatter_alltoall", "check_many_in_flight"):
        assert job.ok_lines(label) == set(range(nranks)), job.explain()


SMALL_LABELS = ("folds", "mixed_paths", "deep_rounds", "broadcast_barrier", "mid_size",
                "changed_tensor", "hot_call", "cancelled_scope_still_issues", "yields")


def fastpath_built(kind: str = MPI_KIND) -> bool:
    """Whether setup built the C round for this MPI (then the job must use it)."""
    code = "import asynclock._core.engine.fastpath as f; print(f.load() is not None)"
    env = {k: v for k, v in mpi_select.environ_for(kind).items() if k != "ASYNCLOCK_FASTPATH"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=False)
    return out.stdout.strip() == "True"


def need_fastpath() -> None:
    """Skip where the C round is not built; with ASYNCLOCK_REQUIRE_FASTPATH=1 fail instead
    (`launch/test.sh` sets it where setup had what the build needs, so a build that broke
    shows as a failure, not as a skip)."""
    if fastpath_built():
        return
    why = "the C small-message round is not built here (mpi/build_fastpath.py)"
    if os.environ.get("ASYNCLOCK_REQUIRE_FASTPATH") == "1":
        pytest.fail(f"{why}, and ASYNCLOCK_REQUIRE_FASTPATH=1 requires it")
    pytest.skip(why)


# Whether a round runs whole in C depends on every rank arriving within the spin: these
# run last in launch/test.sh, alone on the machine.
@pytest.mark.alone
@pytest.mark.parametrize("nranks, loop", [(1, "asyncio"), (2, "asyncio"), (3, "trio")])
@pytest.mark.parametrize("path", ["C", "python"])
def test_small_allreduce_path(nranks: int, loop: str, path: str) -> None:
    """The small-call path (`engine.small_calls`): agrees with the general path (allreduce,
    broadcast, barrier),
    hands off to the engine when a rank is late, follows changed tensors, yields; the
    C round (`_fastpath.c`, when built) and the Python one alike."""
    if path == "C":
        need_fastpath()
    job = run_job("small_calls.py", nranks, *(["--trio"] if loop == "trio" else []),
                  timeout=120, env={"ASYNCLOCK_FASTPATH": "1" if path == "C" else "0"})
    assert_all_ok(job, nranks)
    assert f"OK folds {path}" in job.output, job.explain()
    # One node, C built: compact rounds through shared memory (`_fastpath.c`'s node round).
    rounds = "round_node" if path == "C" else "round_python"
    assert job.ok_lines(rounds) == set(range(nranks)), job.explain()
    assert f"OK hot_call {path}" in job.output, job.explain()
    labels = SMALL_LABELS + (("hand_off", "mismatch_after_hand_off", "rows_only_when_asked",
                              "mismatch_in_the_spin", "cancel_after_hand_off")
                             if nranks > 1 else ())
    for label in labels:
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"


def test_small_allreduce_path_c_round_over_mpi() -> None:
    """`ASYNCLOCK_NODE_ROUND=0`: the C compact round over MPI, as across nodes."""
    need_fastpath()
    job = run_job("small_calls.py", 2, timeout=120, env={"ASYNCLOCK_NODE_ROUND": "0"})
    assert_all_ok(job, 2)
    assert job.ok_lines("round_c") == {0, 1}, job.explain()
    for label in SMALL_LABELS + ("hand_off", "mismatch_after_hand_off", "cancel_after_hand_off"):
        assert job.ok_lines(label) == {0, 1}, f"{label}\n{job.explain()}"


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_small_allreduce_path_other_mpi(kind: str) -> None:
    job = run_job("small_calls.py", 2, timeout=120, kind=kind)
    assert_all_ok(job, 2)
    assert f"OK folds {'C' if fastpath_built(kind) else 'python'}" in job.output, job.explain()
    assert job.ok_lines("cancel_after_hand_off") == {0, 1}, job.explain()


def test_small_path_hands_slow_data_stages_to_the_engine() -> None:
    """A 920 KB allreduce outlasting a 50 us spin: the engine finishes its data stage."""
    job = run_job("small_calls.py", 2, "--short-spin", timeout=120,
                  env={"ASYNCLOCK_SPIN_US": "50"})
    assert_all_ok(job, 2)
    assert job.ok_lines("mid_size") == {0, 1}, job.explain()


@pytest.mark.parametrize("nranks, loop", [(1, "asyncio"), (2, "asyncio"), (3, "trio")])
def test_process_sets_async_api(nranks: int, loop: str) -> None:
    """Sets beside the world: values, set-numbered roots, non-members refused by name,
    a mismatch inside a set, removal."""
    job = run_job("process_sets.py", nranks, *(["--trio"] if loop == "trio" else []),
                  timeout=120)
    assert_all_ok(job, nranks)
    assert job.ok_lines("async_api") == set(range(nranks)), job.explain()


@pytest.mark.parametrize("nranks", [1, pytest.param(2, marks=LONG), 3])
def test_process_sets_horovod_api(nranks: int) -> None:
    """hvd.ProcessSet, init(process_sets=...), add/remove, process_set= on collectives;
    root_rank stays a world rank, as in Horovod."""
    job = run_job("process_sets.py", nranks, "--hvd", timeout=120)
    assert_all_ok(job, nranks)
    assert job.ok_lines("hvd_api") == set(range(nranks)), job.explain()


@pytest.mark.parametrize("kind", OTHER_KINDS)
def test_process_sets_other_mpi(kind: str) -> None:
    job = run_job("process_sets.py", 3, timeout=120, kind=kind)
    assert_all_ok(job, 3)


@pytest.mark.parametrize("kind", [MPI_KIND, *OTHER_KINDS])
@pytest.mark.parametrize("nranks, loop", [(2, "asyncio"), (3, "trio")])
def test_bulk_stages_on_two_lanes_in_opposite_orders_do_not_deadlock(
        kind: str, nranks: int, loop: str) -> None:
    """Regression: one shared wait thread blocked lanes crosswise (stall, exit 4)."""
    args = ["--trio"] if loop == "trio" else []
    job = run_job("cross_lane_bulk.py", nranks, *args, timeout=120, kind=kind,
                  env={"ASYNCLOCK_STALL_ABORT_S": "20",  # the wait threads, not MPICH's
                       "ASYNCLOCK_THREAD_MIN_BYTES": str(1 << 20)})  # loop band
    assert_all_ok(job, nranks)
