"""asynclock.cuda and asynclock._core.engine.staging on a machine without CUDA.

What must hold everywhere: every CUDA helper is a no-op or a clear error,
importing asynclock never imports torch, `cuda.wait` lets other tasks run
while it waits (tested against the event protocol, `query()` /
`synchronize()`, with plain Python event objects), and the staging gate
keeps caller order on a lane. GPU behaviour is in tests/gpu/.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading

import anyio
import numpy as np
import pytest
import torch
from mpijob import DEFAULT_KIND, OTHER_KINDS, assert_all_ok, run_job

from asynclock import cuda
from asynclock._core.base.errors import CollectiveTimeout, InvalidInputError
from asynclock._core.base.header import Call
from asynclock._core.base.ops import Kind, ReduceOp
from asynclock._core.base.tensors import InputFault, InputRejected, as_buffer
from asynclock._core.device.paths import horovod_gpu, ompi_info_says_cuda
from asynclock._core.device.waiting import WaitPolicy
from asynclock._core.engine import staging
from asynclock._core.engine.collective_ops import AllreduceOp, BarrierOp
from asynclock._core.runtime.coordinator import Coordinator
from asynclock._core.transports.local import LocalBackend

LOOPS = ["asyncio", "trio"]


class FlipEvent:
    """The CUDA event protocol in plain Python: `query()` is False `n` times."""

    def __init__(self, n: int, log: list[str] | None = None) -> None:
        self.left = n
        self.queries = 0
        self.log = log

    def query(self) -> bool:
        self.queries += 1
        if self.log is not None:
            self.log.append("q")
        if self.left > 0:
            self.left -= 1
            return False
        return True


class GateEvent:
    """An event completed by the test itself (`done = True`)."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class BlockingEvent:
    """`synchronize()` blocks its thread until `release()`, like cudaEventSynchronize."""

    def __init__(self) -> None:
        self._flag = threading.Event()
        self.synchronized_in: str | None = None

    def query(self) -> bool:
        return self._flag.is_set()

    def synchronize(self) -> None:
        self.synchronized_in = threading.current_thread().name
        if not self._flag.wait(30):
            raise TimeoutError("test event was never released")

    def release(self) -> None:
        self._flag.set()


# -- import hygiene and no-ops ---------------------------------------------------------
def test_import_asynclock_does_not_import_torch() -> None:
    code = ("import sys, asynclock, asynclock.cuda, asynclock._core.engine.staging; "
            "from asynclock import cuda; cuda.record(); cuda.stream_wait(None, None); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "False"


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


def test_record_is_none_until_cuda_is_initialised() -> None:
    """In a fresh process that imported torch but never used CUDA: no events."""
    code = ("import torch; from asynclock import cuda; "
            "assert cuda.record() is None; assert cuda.record('cuda') is None; "
            "assert not torch.cuda.is_initialized(); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "ok"


def test_cpu_things_never_get_events() -> None:
    assert cuda.record(torch.ones(3)) is None
    assert cuda.record("cpu") is None
    assert cuda.record(torch.device("cpu")) is None
    cuda.stream_wait(None, None)  # no event: nothing to order
    cuda.stream_wait("cpu", None)


def test_bucket_sync_is_a_no_op_on_cpu() -> None:
    sync = cuda.BucketSync()
    sync.mark_ready(torch.ones(1))  # a CPU gradient
    assert sync.ready is None and sync.done is None
    with sync.comm() as same:
        assert same is sync
    sync.consume()
    anyio.run(sync.wait_done)


@NO_CUDA
def test_available_and_set_device_without_cuda() -> None:
    assert cuda.available() is False
    assert cuda.set_device(3) is None


@NO_CUDA
def test_stream_wait_with_event_but_no_cuda_is_a_clear_error() -> None:
    with pytest.raises(RuntimeError, match="CUDA is not initialised"):
        cuda.stream_wait(None, GateEvent())


# -- awaiting GPU work -------------------------------------------------------------------
@pytest.mark.parametrize("loop", LOOPS)
def test_wait_none_returns(loop: str) -> None:
    before = cuda.statistics()
    anyio.run(cuda.wait, None, backend=loop)
    after = cuda.statistics()
    assert after.immediate == before.immediate + 1 and after.in_progress == 0


def test_wait_rejects_what_is_not_an_event() -> None:
    with pytest.raises(TypeError, match="CUDA event or a CUDA stream, got int"):
        anyio.run(cuda.wait, 42)


@pytest.mark.parametrize("loop", LOOPS)
def test_polling_wait_does_not_block_other_tasks(loop: str) -> None:
    """While the event is pending, a side task keeps running between polls."""
    log: list[str] = []
    event = FlipEvent(40, log)

    async def side() -> None:
        while True:
            log.append("s")
            await anyio.sleep(0)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(side)
            with anyio.fail_after(10):
                await cuda.wait(event)
            tg.cancel_scope.cancel()

    anyio.run(main, backend=loop)
    assert event.queries == 41 and event.left == 0
    first, last = log.index("q"), len(log) - 1 - log[::-1].index("q")
    assert "s" in log[first:last], "the side task never ran while we waited"
    assert log[-1] in ("q", "s")


@pytest.mark.parametrize("loop", LOOPS)
def test_thread_wait_does_not_block_the_loop(loop: str) -> None:
    """The helper thread blocks in synchronize(); the loop runs the releaser."""
    event = BlockingEvent()
    ticks = 0

    async def releaser() -> None:
        nonlocal ticks
        while event.synchronized_in is None:  # the helper thread is now blocked
            await anyio.sleep(0.001)
        for _ in range(5):
            ticks += 1
            await anyio.sleep(0)
        event.release()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(releaser)
            with anyio.fail_after(20):
                await cuda.wait(event, policy=WaitPolicy(mode="thread"))

    before = cuda.statistics().thread_waits
    anyio.run(main, backend=loop)
    assert ticks == 5
    assert event.synchronized_in is not None
    assert event.synchronized_in.startswith("asynclock-cuda-wait")
    assert cuda.statistics().thread_waits == before + 1


@pytest.mark.parametrize("marked", [True, False])
def test_auto_hands_blocking_events_to_the_thread_after_the_tight_phase(marked: bool) -> None:
    """Blocking-sync events go to the helper thread; others keep polling."""
    event = BlockingEvent()
    if marked:
        event.asynclock_blocking = True  # type: ignore[attr-defined]

    async def releaser() -> None:
        for _ in range(50):
            if event.synchronized_in is not None:
                break
            await anyio.sleep(0.001)
        event.release()

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(releaser)
            with anyio.fail_after(20):
                await cuda.wait(event, policy=WaitPolicy(mode="auto", busy_s=0.0))

    anyio.run(main)
    assert (event.synchronized_in is not None) is marked


def test_wait_timeout_names_the_event() -> None:
    with pytest.raises(CollectiveTimeout, match="GateEvent.*passed its 0.05 s deadline"):
        anyio.run(lambda: cuda.wait(GateEvent(), timeout=0.05))
    assert cuda.statistics().in_progress == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_cancelled_wait_leaves_nothing_behind(loop: str) -> None:
    """Cancellation regression: a cancelled poller stops and is not counted as waiting."""
    event = GateEvent()

    async def main() -> None:
        with anyio.move_on_after(0.02):
            await cuda.wait(event)

    anyio.run(main, backend=loop)
    assert cuda.statistics().in_progress == 0 and not event.done


def test_backoff_policy_is_tight_then_grows_then_caps() -> None:
    p = WaitPolicy(busy_s=1e-3, min_sleep_s=1e-4, max_sleep_s=2e-3, sleep_fraction=0.05)
    assert p.next_sleep(0.0) == 0.0 and p.next_sleep(0.9e-3) == 0.0
    assert p.next_sleep(1.5e-3) == pytest.approx(1e-4)  # floor
    assert p.next_sleep(20e-3) == pytest.approx(1e-3)  # 5% of the wait
    assert p.next_sleep(10.0) == pytest.approx(2e-3)  # cap


def test_wait_policy_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCLOCK_CUDA_WAIT", "thread")
    monkeypatch.setenv("ASYNCLOCK_CUDA_BUSY_US", "250")
    p = WaitPolicy.from_env()
    assert p.mode == "thread" and p.busy_s == pytest.approx(250e-6)
    monkeypatch.setenv("ASYNCLOCK_CUDA_WAIT", "spin")
    with pytest.raises(ValueError, match="use one of auto, poll, thread"):
        WaitPolicy.from_env()
    monkeypatch.delenv("ASYNCLOCK_CUDA_WAIT")
    assert WaitPolicy.from_env().mode == "auto"


# -- device errors and staging -------------------------------------------------------------
def test_meta_tensor_is_refused_with_the_reason() -> None:
    with pytest.raises(InputRejected, match="only CPU and CUDA tensors") as err:
        as_buffer(torch.empty(3, device="meta"), stage=True)
    assert err.value.fault is InputFault.WRONG_DEVICE


@NO_CUDA
def test_staging_without_cuda_is_a_clear_error() -> None:
    """The staging entry on a build without CUDA: WRONG_DEVICE naming why."""
    with pytest.raises(InputRejected, match="cannot stage cpu tensor through pinned host"
                       ) as err:
        staging.stage_tensor(torch.ones(4))
    assert err.value.fault is InputFault.WRONG_DEVICE


def test_staging_refuses_non_contiguous_first() -> None:
    with pytest.raises(InputRejected, match="call .contiguous") as err:
        staging.stage_tensor(torch.ones(4, 3).t())
    assert err.value.fault is InputFault.NON_CONTIGUOUS


@pytest.mark.parametrize("loop", LOOPS)
def test_collective_on_meta_tensor_raises_on_the_caller(loop: str) -> None:
    async def main() -> None:
        async with Coordinator(LocalBackend()) as coord:
            with pytest.raises(InvalidInputError, match="meta tensor; only CPU and CUDA"):
                await coord.allreduce(torch.empty(3, device="meta"))
            assert (await coord.allreduce(np.ones(2))).tolist() == [1.0, 1.0]

    anyio.run(main, backend=loop)


def staged_allreduce(coord: Coordinator, n: int) -> AllreduceOp:
    """An allreduce whose buffer claims to be a staged CUDA tensor (here: a CPU one)."""
    lane, host = coord.lowlevel.user_lane, torch.ones(n)
    buf = as_buffer(host)
    buf.wrap = staging.Staged(torch.ones(n), host, buf.wrap, None, None)
    call = Call(Kind.ALLREDUCE, lane.next_seq(), op=int(ReduceOp.SUM), dtype=buf.code,
                shape=buf.shape, nbytes=buf.array.nbytes)
    return AllreduceOp(lane, call, buf, buf.array, ReduceOp.SUM)


@NO_CUDA
def test_failed_copy_still_joins_the_header_round() -> None:
    """If CUDA refuses the copy, a fault header takes the op's place (no desync)."""

    async def main() -> None:
        async with Coordinator(LocalBackend()) as coord:
            op = staged_allreduce(coord, 4)
            issued = coord.statistics().issued
            with pytest.raises(InputRejected, match="staging cpu tensor failed: RuntimeError"):
                staging.submit(coord.lowlevel.engine, coord.lowlevel.user_lane, op)
            assert coord.statistics().issued == issued + 1
            assert (await coord.allreduce(np.ones(2))).tolist() == [1.0, 1.0]

    anyio.run(main)


# -- the lane gate: caller order behind GPU copies ---------------------------------------
def _barrier(coord: Coordinator) -> BarrierOp:
    lane = coord.lowlevel.user_lane
    return BarrierOp(lane, Call(Kind.BARRIER, lane.next_seq(), name="held"))


@pytest.mark.parametrize("loop", LOOPS)
def test_gate_keeps_caller_order(loop: str) -> None:
    """A later collective queues behind a held one and is issued after it."""

    async def main() -> None:
        async with Coordinator(LocalBackend()) as coord:
            engine, lane, event = coord.lowlevel.engine, coord.lowlevel.user_lane, GateEvent()
            held = staging.submit_after(engine, lane, _barrier(coord), event)
            later = coord.allreduce_async(np.arange(3.0))
            assert staging.held(lane) == 2 and not held.done and not later.done()
            for _ in range(20):
                await anyio.sleep(0)
            assert staging.held(lane) == 2 and not held.done, "released before its event"
            event.done = True
            with anyio.fail_after(10):
                assert (await later).tolist() == [0.0, 1.0, 2.0]
            assert held.done and held.issued_at <= later._op.issued_at
            assert staging.held(lane) == 0 and lane not in staging._GATES

    anyio.run(main, backend=loop)


@pytest.mark.parametrize("loop", LOOPS)
def test_cancelling_a_task_awaiting_a_held_op_still_submits_it(loop: str) -> None:
    """Cancellation regression: the held op still runs (other ranks expect it)."""

    async def main() -> None:
        async with Coordinator(LocalBackend()) as coord:
            event = GateEvent()
            low = coord.lowlevel
            op = staging.submit_after(low.engine, low.user_lane, _barrier(coord), event)
            with anyio.move_on_after(0.01):
                await coord.lowlevel.engine.wait(op)
            assert not op.done and op.detached
            event.done = True
            with anyio.fail_after(10):
                await coord.drain()
            assert op.done and op.error is None

    anyio.run(main, backend=loop)


def test_gate_passes_completed_events_straight_through() -> None:
    async def main() -> None:
        async with Coordinator(LocalBackend()) as coord:
            done = GateEvent()
            done.done = True
            low = coord.lowlevel
            op = staging.submit_after(low.engine, low.user_lane, _barrier(coord), done)
            assert op.done and staging.held(coord.lowlevel.user_lane) == 0

    anyio.run(main)


@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_gate_order_across_ranks(nranks: int) -> None:
    """Only rank 0 holds its first op; every rank still matches headers in order."""
    job = run_job("cuda_gate.py", nranks, timeout=120)
    assert_all_ok(job, nranks)
    assert job.ok_lines("gate_order") == set(range(nranks)), job.explain()
    assert job.ok_lines("stage_fault") == set(range(nranks)), job.explain()


# -- transport detection ---------------------------------------------------------------------
def test_detection_never_initialises_mpi() -> None:
    code = ("import sys; from asynclock import cuda; s = cuda.cuda_support(); "
            "print(s.library, s.direct, 'mpi4py.MPI' in sys.modules, cuda.describe())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out.startswith("none False False cuda transport: host staging"), out
    assert horovod_gpu() is None  # horovod.torch is not imported here


def test_ompi_info_probe_matches_this_machine() -> None:
    found = ompi_info_says_cuda()
    if shutil.which("ompi_info") is None:
        assert found is None
    elif not cuda.available():
        assert found is False  # Debian's Open MPI here is built without CUDA
    else:
        assert found in (True, False)


@pytest.mark.mpi
@pytest.mark.parametrize("kind", [DEFAULT_KIND, *OTHER_KINDS])
def test_detection_inside_an_mpi_job(kind: str) -> None:
    """The MPIX query answers inside a job (neither MPI of the CPU machine is CUDA-aware)."""
    job = run_job("cuda_gate.py", 1, "--detect", timeout=120, kind=kind)
    assert_all_ok(job, 1)
    assert job.ok_lines("detect") == {0}, job.explain()
    assert "MPIX query in libmpi" in job.output, job.explain()
    if not cuda.available():
        assert "cuda_aware=False" in job.output and "host staging" in job.output, job.explain()
    assert ("[openmpi" if kind == "system" else "[mpich") in job.output, job.explain()
