"""The Horovod backend: real jobs under plain mpirun (ASYNCLOCK_BACKEND=horovod),
`horovodrun --gloo`, and in-process checks of its pure parts (row splits,
the TCP mailbox used when there is no MPI world).

The collective matrix on this backend lives in test_collectives_mpi.py.
Jobs skip with the reason when Horovod cannot be imported here.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from mpijob import (
    Job,
    assert_all_ok,
    horovod_status,
    horovodrun_missing,
    mpi_select,
    run_horovodrun,
    run_job,
)

from asynclock._core.base.errors import BackendError
from asynclock._core.transports.handshake import MeshKey
from asynclock._core.transports.horovod import _row_width, _split
from asynclock._core.transports.horovod_mpi import (
    MPIName,
    check_launcher,
    check_mpi4py,
    launcher_mpi,
)
from asynclock._core.transports.mailbox import AGREE, HEADERS, Mailbox

BACKEND_LABELS = ["widened", "cancel_detaches", "mismatch_poll", "mismatch_wait", "alive",
                  "small_never_horovod", "horovod_down"]
HVD_ENV = {"ASYNCLOCK_BACKEND": "horovod"}


def need_horovod(gloo: bool | None = None) -> str:
    """Skip (with the reason) unless Horovod jobs can run; return its MPI kind."""
    kind, why = horovod_status()
    why = why or (horovodrun_missing(gloo) if gloo is not None else "")
    if why:
        pytest.skip(why)
    return kind


def labels_ok(job: Job, nranks: int, labels: list[str]) -> None:
    assert_all_ok(job, nranks)
    for label in labels:
        assert job.ok_lines(label) == set(range(nranks)), f"{label}\n{job.explain()}"


# -- pure parts ----------------------------------------------------------------------------
def test_reduce_scatter_uses_horovods_split_only_when_it_matches() -> None:
    assert _split(5, 2) == [3, 2] and _split(1, 3) == [1, 0, 0]
    assert _row_width([12, 8], 2) == 4  # rows [3, 2] of width 4: Horovod's own split
    assert _row_width([8, 8, 8], 3) == 8
    assert _row_width([40, 0], 2) == 40  # one row over two ranks
    assert _row_width([4, 8], 2) is None  # the larger share last: not Horovod's split
    assert _row_width([0, 0], 2) is None


def _mesh(size: int) -> list[Mailbox]:
    """`size` mailboxes in threads of this process, sharing one key; the exchange is a
    shared list."""
    key = MeshKey(bytes(range(32)), "test.mailbox")
    addrs: list[tuple[str, int] | None] = [None] * size
    gate = threading.Barrier(size)
    boxes: list[Mailbox | None] = [None] * size

    def exchange(rank: int, addr: tuple[str, int]) -> list[tuple[str, int]]:
        addrs[rank] = addr
        gate.wait(timeout=30)
        return [a for a in addrs if a is not None]

    def make(rank: int) -> None:
        boxes[rank] = Mailbox(rank, size, key, "127.0.0.1", lambda a: exchange(rank, a))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert all(b is not None for b in boxes), "mesh set-up failed"
    return [b for b in boxes if b is not None]


def _recv(port: object, buf: np.ndarray, what: str) -> tuple[int, int]:
    for _ in range(20_000):
        hit = port.try_recv(buf)  # type: ignore[attr-defined]
        if hit is not None:
            return hit  # type: ignore[no-any-return]
        threading.Event().wait(0.0005)
    raise AssertionError(f"no message: {what}")


def test_mailbox_routes_by_channel_and_source() -> None:
    boxes = _mesh(3)
    try:
        ports = [[b.port(ch) for ch in range(2)] for b in boxes]
        big = np.arange(300_000, dtype=np.int64)  # larger than a socket buffer: partial sends
        req = ports[2][1].isend(big, 0)
        assert ports[1][0].isend(np.array([7, 8], np.int64), 0).Test() in (True, False)
        assert ports[0][0].isend(np.array([5], np.int64), 0).Test()  # to itself: done at once
        buf = np.zeros(300_000, np.int64)
        got = sorted([_recv(ports[0][0], buf, "ch0")[0], _recv(ports[0][0], buf, "ch0")[0]])
        assert got == [0, 1]
        for _ in range(20_000):  # the receiver drains, so the sender can write the rest
            if req.Test():
                break
            boxes[0].pump()
        assert req.Test(), "big frame never fully written"
        assert _recv(ports[0][1], buf, "big") == (2, big.nbytes) and np.array_equal(buf, big)
        assert ports[0][0].try_recv(buf) is None
    finally:
        for b in boxes:
            b.close()


def test_mailbox_allgather_rounds_match_by_order_not_by_polling_order() -> None:
    """Round k takes each peer's k-th message on the stream, even when round 1 is
    tested before round 0; streams (headers, agreement) do not mix."""
    boxes = _mesh(3)
    try:
        ports = [b.port(0) for b in boxes]
        outs = [[np.zeros(3 * 2, np.int64) for _ in range(2)] for _ in boxes]
        reqs = [[ports[r].iallgather(np.array([r, k], np.int64), outs[r][k]) for k in range(2)]
                for r in range(3)]
        maxed = [np.zeros(2, np.int64) for _ in boxes]
        rows = [np.zeros((3, 2), np.int64) for _ in boxes]
        agree = [ports[r].iallgather(np.array([r, -r], np.int64), rows[r], AGREE,
                                     lambda r=r: np.max(rows[r], axis=0, out=maxed[r]))
                 for r in range(3)]
        pending = [req for r in range(3) for req in (reqs[r][1], reqs[r][0], agree[r])]
        for _ in range(20_000):
            pending = [req for req in pending if not req.Test()]
            if not pending:
                break
        assert not pending, "allgather rounds never completed"
        for r in range(3):
            for k in range(2):
                assert outs[r][k].tolist() == [0, k, 1, k, 2, k], (r, k, outs[r][k])
            assert maxed[r].tolist() == [2, 0], maxed[r]
    finally:
        for b in boxes:
            b.close()


def test_mailbox_keeps_a_round_that_arrives_before_its_channel_opens() -> None:
    """Regression: a peer that opens a channel first (a second DistributedOptimizer's
    gradient lane, made on every rank but not at the same moment) sends its first
    header round before this rank has the channel. The frame used to land in a
    point-to-point inbox, and the round hung (`horovodrun --gloo`, ~half the runs)."""
    boxes = _mesh(2)
    try:
        rows = [np.zeros((2, 1), np.int64) for _ in boxes]
        early = boxes[1].port(5).iallgather(np.array([11], np.int64), rows[1])
        for _ in range(20_000):  # rank 0 drains the frame while it has no channel 5 yet
            boxes[0].pump()
            if boxes[0].gathers.get(4 * 5 + HEADERS) is not None:
                break
        assert not boxes[0].inboxes.get(4 * 5 + HEADERS), "header frame taken for a message"
        late = boxes[0].port(5).iallgather(np.array([10], np.int64), rows[0])
        pending = [early, late]
        for _ in range(20_000):
            pending = [req for req in pending if not req.Test()]
            if not pending:
                break
        assert not pending, "the round that arrived early never completed"
        assert [r.ravel().tolist() for r in rows] == [[10, 11], [10, 11]], rows
    finally:
        for b in boxes:
            b.close()


def test_mailbox_reports_a_closed_peer() -> None:
    boxes = _mesh(2)
    try:
        pending = boxes[0].port(1).iallgather(np.ones(1, np.int64), np.zeros(2, np.int64))
        boxes[1].close()
        for _ in range(20_000):
            boxes[0].pump()
            if 1 in boxes[0].dead:
                break
            threading.Event().wait(0.0005)
        with pytest.raises(BackendError, match="rank 1 closed its connection"):
            boxes[0].port(0).isend(np.ones(2, np.int64), 1)
        with pytest.raises(BackendError, match=r"rank\(s\) \[1\] closed their connection"):
            pending.Test()
    finally:
        boxes[0].close()


def test_message_larger_than_the_buffer_is_an_error() -> None:
    boxes = _mesh(2)
    try:
        boxes[1].port(0).isend(np.ones(4, np.int64), 0)
        with pytest.raises(BackendError, match="32-byte message from rank 1"):
            _recv(boxes[0].port(0), np.zeros(2, np.int64), "too big")
    finally:
        for b in boxes:
            b.close()


# -- real jobs --------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.horovod
@pytest.mark.parametrize("nranks, loop", [pytest.param(2, "asyncio", marks=pytest.mark.slow),
                                          (3, "trio")])
def test_backend_under_mpirun(nranks: int, loop: str, tmp_path: Path) -> None:
    """Widened dtypes, Horovod errors on every rank, small ops never reach Horovod
    (checked in Horovod's own timeline, so HOROVOD_TIMELINE passes through)."""
    kind = need_horovod()
    timeline = tmp_path / "horovod-timeline.json"
    args = ["--trio"] if loop == "trio" else []
    job = run_job("hvd_backend.py", nranks, *args, timeout=150, kind=kind,
                  env={**HVD_ENV, "HOROVOD_TIMELINE": str(timeline)})
    labels_ok(job, nranks, BACKEND_LABELS)
    assert "(mpi controller; headers over Open MPI" in job.output or kind != "system", job.output
    names = set(re.findall(r'"name": "allreduce\.(asynclock\d+\.[^"]+)"', timeline.read_text()))
    # The 50 small sync-lane allreduces never reached Horovod: the only sync-lane data op is
    # the one 4 KB allreduce (the program counts it exactly). Its own timeline entry may be
    # missing: it is the last op before hvd.shutdown(), and Horovod's timeline writer
    # dropped it once in CI under load, so the timeline may hold it or nothing.
    sync = {n for n in names if ".sync." in n}
    assert sync <= {"asynclock0.sync.allreduce.sum.float32.1000.s0"}, names
    # The timeline records the grad lane's ops (so the check above is not vacuous): the two
    # mismatched allreduces, whose errors the program checks by name on every rank. Under
    # load Horovod's writer has dropped one of their entries too, so one must be there.
    assert {"asynclock0.grad.allreduce.sum.float32.6.s0",
            "asynclock0.grad.allreduce.max.float64.1000.s0"} & names, names
    assert '"name": "ERROR"' in timeline.read_text()


@pytest.mark.mpi
@pytest.mark.horovod
def test_backend_under_horovodrun_gloo() -> None:
    """No MPI world: headers, agreement and p2p over the TCP mesh; `auto` picks Horovod."""
    need_horovod(gloo=True)
    job = run_horovodrun("hvd_backend.py", 2, gloo=True, timeout=150)
    labels_ok(job, 2, BACKEND_LABELS)
    assert "(gloo controller; headers over a TCP mesh" in job.output, job.explain()


@pytest.mark.mpi
@pytest.mark.horovod
@pytest.mark.parametrize("program, args, label", [
    ("launch_hvd.py", (), None), ("auto_backend.py", ("--expect", "mpi"), "auto_backend")])
def test_horovodrun_mpi_controller_in_the_activated_venv(program: str, args: tuple[str, ...],
                                                        label: str | None) -> None:
    """`source .venv/bin/activate; horovodrun -np 2 python train.py`, as Horovod's docs
    say: MPICH's mpirun comes first on that PATH, and horovodrun stopped with "Unknown
    MPI implementation"; the venv's horovodrun now runs Open MPI's, and the ranks load
    its libmpi (mpi4py too: auto_backend.py)."""
    need_horovod(gloo=False)
    job = run_horovodrun(program, 2, *args, activated=True, timeout=150)
    assert job.returncode == 0, job.explain()
    if label is None:
        assert all(f"hvd hello from {r} of 2" in job.output for r in (0, 1)), job.explain()
    else:
        labels_ok(job, 2, [label])
        assert job.output.count("2 ranks on mpi (Open MPI") == 2, job.explain()


VENDORS = {"system": "Open MPI", "embedded": "MPICH"}


@pytest.mark.mpi
@pytest.mark.horovod
def test_backend_refuses_the_launcher_of_another_mpi() -> None:
    """Horovod built for one MPI, ranks started by the other MPI's launcher: the backend
    refuses on every rank, naming both, instead of running N worlds of size 1."""
    kind = need_horovod()
    other = [k for k, ok in mpi_select.available().items() if ok and k != kind]
    if not other:
        pytest.skip(f"only {kind}, the MPI Horovod is built for, is installed")
    job = run_job("clean_exit.py", 2, timeout=120, kind=other[0], env=HVD_ENV)
    assert job.returncode != 0 and not job.ok_lines("leaving"), job.explain()
    refusal = (f"BackendError: the Horovod backend cannot run here: Horovod is built for "
               f"{VENDORS[kind]} (")
    assert job.output.count(refusal) == 2, job.explain()
    assert f"but this rank was started by {VENDORS[other[0]]} (" in job.output, job.explain()


def test_horovod_mpi_checks_name_both_mpis() -> None:
    built = MPIName("Open MPI", "v4")
    hydra = {"PMI_SIZE": "2", "PMI_FD": "9"}
    assert launcher_mpi(hydra) == MPIName("MPICH", "hydra's mpiexec, PMI_SIZE=2")
    assert launcher_mpi({"OMPI_COMM_WORLD_SIZE": "2"}) is not None
    assert launcher_mpi({**hydra, "SLURM_JOB_ID": "7"}) is None  # srun: not judged
    with pytest.raises(BackendError, match=r"built for Open MPI \(v4\), but this rank was "
                                           r"started by MPICH \(hydra"):
        check_launcher(built, hydra)
    check_launcher(built, {"OMPI_COMM_WORLD_SIZE": "2"})
    check_launcher(None, hydra)  # a Horovod without MPI we know: not judged
    with pytest.raises(BackendError, match="but mpi4py loaded MPICH Version: 5"):
        check_mpi4py(built, "MPICH Version: 5.0.2\nMPICH Release date: ...")
    check_mpi4py(built, "Open MPI v4.1.4, package: Debian OpenMPI")


@pytest.mark.mpi
@pytest.mark.horovod
def test_clean_exit_under_horovodrun_gloo_prints_nothing_alarming() -> None:
    """Ranks that shut down together close their heartbeat meshes while a peer still
    says goodbye over them (`Connection reset by peer`): that is no error to print."""
    need_horovod(gloo=True)
    job = run_horovodrun("clean_exit.py", 3, gloo=True, timeout=150)
    assert_all_ok(job, 3)
    noisy = [line for line in job.output.splitlines()
             if "asynclock[rank" in line or "Error" in line or "Traceback" in line]
    assert not noisy, job.explain()


@pytest.mark.mpi
@pytest.mark.horovod
def test_auto_picks_mpi_under_horovodrun_with_an_mpi_world() -> None:
    """`horovodrun` (MPI controller) starts the ranks with mpirun: `auto` takes the MPI
    backend and never imports Horovod, whose idle thread would tax every rank."""
    need_horovod(gloo=False)
    job = run_horovodrun("auto_backend.py", 2, "--expect", "mpi", timeout=120)
    labels_ok(job, 2, ["auto_backend"])
    assert job.output.count("auto_backend 2 ranks on mpi (Open MPI") == 2, job.explain()


GLOO_TRAINING = {
    "torch_grads.py": ["caps_tiny_partitions", "caps_tiny_default", "identical_20_steps",
                       "handed_some_ranks", "grouped_yes", "grouped_in_thread",
                       "accumulate_passes", "gated_bit_identical", "mismatch_options",
                       "transport_shm", "mismatch_buckets_shm"],
    "torch_async.py": ["basic", "loop_live_during_backward", "modes_bit_identical",
                       "cancel_during_backward"],
    "join.py": ["hvd_allreduce", "hvd_optimizer"],
}


@pytest.mark.horovod
@pytest.mark.parametrize("program", sorted(GLOO_TRAINING))
def test_training_under_horovodrun_gloo(program: str) -> None:
    """`import asynclock.torch as hvd` under `horovodrun --gloo` (no MPI world): the
    gradient checks (each a new DistributedOptimizer with a new gradient lane, buckets
    as Horovod groups of handed gradients in the profiling round, then through the
    node's shared-memory file), the async API, and join with uneven steps
    (joined rounds settle their buckets). Regression: a peer's first header round on
    a new lane used to get lost (torch_grads.py hung in ~half the runs). Horovod groups
    are waited for in the lane's wait thread, small ones too (`grouped_in_thread`)."""
    need_horovod(gloo=True)
    args = ["--hvd"] if program == "join.py" else []
    job = run_horovodrun(program, 2, *args, gloo=True, timeout=150)
    labels_ok(job, 2, [*GLOO_TRAINING[program], "done"])


@pytest.mark.horovod
def test_gated_and_plain_updates_bit_identical_at_3_ranks_under_horovodrun_gloo() -> None:
    """3 ranks sum in an order that follows the layout of Horovod's fusion buffer: with
    buckets fused across groups it followed timing, and gated, per-bucket and plain
    updates differed in the last bits (4 of 4 runs). asynclock now initializes Horovod
    with HOROVOD_DISABLE_GROUP_FUSION=1 unless the user set it. The node's shared
    memory is off here, so every round's buckets go through Horovod, as across hosts."""
    need_horovod(gloo=True)
    job = run_horovodrun("torch_grads.py", 3, gloo=True, timeout=150,
                         env={"ASYNCLOCK_NODE_WINDOW": "0"})
    labels_ok(job, 3, ["gated_bit_identical", "identical_20_steps", "handed_some_ranks",
                       "transport_allreduce", "done"])


@pytest.mark.slow
@pytest.mark.horovod
def test_gradients_through_a_shared_file_at_3_ranks_under_horovodrun_gloo() -> None:
    """The same checks with buckets through the mapped /dev/shm file, over 3 ranks."""
    need_horovod(gloo=True)
    job = run_horovodrun("torch_grads.py", 3, gloo=True, timeout=150)
    labels_ok(job, 3, ["gated_bit_identical", "identical_20_steps", "handed_some_ranks",
                       "transport_shm", "mismatch_buckets_shm", "done"])


@pytest.mark.mpi
@pytest.mark.horovod
def test_sync_primitives_under_horovodrun_gloo(tmp_path: Path) -> None:
    """Condition, Event, sequential sections and consistency points (and their
    mismatch error) over the TCP mesh."""
    need_horovod(gloo=True)
    job = run_horovodrun("sync_primitives.py", 2, str(tmp_path), gloo=True, timeout=150)
    labels_ok(job, 2, ["condition_notify", "condition_wait_for", "condition_cancel", "event",
                       "event_timeout_cancel", "sequential", "sequential_cancel",
                       "consistency_point", "consistency_mismatch"])


@pytest.mark.mpi
@pytest.mark.horovod
def test_collectives_matrix_on_horovod() -> None:
    """Every collective x dtype x op with data stages on Horovod's handles; float16
    past the bulk threshold is summed by Horovod itself (16-bit on the wire)."""
    kind = need_horovod()
    job = run_job("collectives_matrix.py", 2, "--expect-backend", "horovod", timeout=240,
                  kind=kind, env=HVD_ENV)
    labels_ok(job, 2, ["check_allreduce", "check_half_bulk", "check_broadcast", "done"])


@pytest.mark.slow  # real Horovod on our script: it changes only with the script
@pytest.mark.horovod
def test_the_drop_in_script_passes_on_real_horovod_too() -> None:
    """Conformance: the script `asynclock.torch` runs unchanged (grouped and async
    collectives, join, broadcast_object...) passes the same checks on Horovod 0.28.1,
    so the semantics it asserts are Horovod's, not ours (with --long)."""
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    job = run_job("torch_hvd_script.py", 2, "--horovod", "--epochs", "1", timeout=240,
                  kind=kind)
    assert_all_ok(job, 2)
    assert job.ok_lines("collectives") == {0, 1}, job.explain()


@pytest.mark.horovod
def test_every_public_horovod_torch_name_exists_in_asynclock_torch() -> None:
    """After `import asynclock.torch as hvd`, no Horovod 0.28 name a script may use is
    missing (probed in a subprocess: importing Horovod loads its libmpi)."""
    kind, why = horovod_status()
    if why:
        pytest.skip(why)
    code = ("import types, horovod.torch as h, asynclock.torch as a\n"
            "names = {n for n in dir(h) if not n.startswith('_')\n"
            "         and not isinstance(getattr(h, n), types.ModuleType)}\n"
            "print(sorted(names - set(dir(a)) - {'check_extension'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=180, env=mpi_select.environ_for(kind))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
