"""The shared-memory gradient pipeline, two ranks in one process.

`ShmPipeline` only needs a `SharedWindow` (counters and bells) and the
buffers, so two pipelines over windows made on the same process memory
behave as two ranks on a node (the futex works within a process too). The
MPI-level behaviour is covered by the torch tests that run real jobs
(`test_torch_mpi.py`, shared memory is their default on one node) and the
window's own contract by `test_shared_window.py`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from asynclock._core.base.errors import BackendError
from asynclock._core.transports.shared_window import CTL_BYTES, SharedWindow
from asynclock.torch._grad.buckets import Caps, ParamSpec, build_plan
from asynclock.torch._grad.shm_chunks import HandedGrads
from asynclock.torch._grad.shm_pipeline import PACKED, RoundJob, ShmPipeline

TIMEOUT = 10.0


def no_barrier() -> None:
    return None  # one process: its threads see each other's stores in order


class Node:
    """Two pipelines over shared buffers; results arrive in the pipeline threads."""

    def __init__(self, numels: tuple[int, ...] = (6, 5, 7), post: float = 0.5,
                 failure: Callable[[int], BaseException | None] = lambda r: None,
                 handed: bool = False) -> None:
        params = [ParamSpec(k, "float32", 4) for k in numels]
        self.plan = build_plan(list(range(len(numels))), params,
                               Caps(bucket_bytes=28, first_bucket_bytes=28))
        self.b = len(self.plan.buckets)
        n = sum(numels)
        memory = [bytearray(CTL_BYTES) for _ in range(2)]
        self.buffers = [torch.arange(n, dtype=torch.float32) * (r + 1) for r in range(2)]
        self.calls: queue.SimpleQueue[Callable[[], object]] = queue.SimpleQueue()
        self.released = [threading.Event() for _ in range(2)]
        self.handed = [HandedGrads(self.plan) if handed else None for _ in range(2)]
        self.pipes = [ShmPipeline(SharedWindow(r, memory, 0, no_barrier), self.plan,
                                  {"float32": self.buffers}, post, self.calls.put,
                                  lambda r=r: failure(r), self.handed[r]) for r in range(2)]
        self.gathered: list[list[int]] = [[], []]
        self.failed: list[BaseException | None] = [None, None]

    def job(self, r: int, index: int, launched: int, cls: type[RoundJob] = RoundJob) -> RoundJob:
        self.released[r].clear()
        return cls(index, tuple(self.plan.launch), launched,
                   lambda ps, r=r: self.gathered[r].extend(ps),
                   lambda e, r=r: self.failed.__setitem__(r, e),
                   lambda e, r=r: self.released[r].set())

    def drain_until(self, done: Callable[[], bool]) -> None:
        """Run loop callbacks (if any) until `done()`, or fail after TIMEOUT."""
        import time

        deadline = time.monotonic() + TIMEOUT
        while not done():
            if time.monotonic() > deadline:
                pytest.fail(f"pipelines stuck: {[p.describe() for p in self.pipes]}")
            with contextlib.suppress(queue.Empty):
                self.calls.get(timeout=0.01)()

    def close(self) -> None:
        for p in self.pipes:
            p.stop()


@pytest.fixture
def node() -> Any:
    n = Node()
    yield n
    n.close()


def test_a_round_sums_every_bucket_scaled_on_both_ranks(node: Node) -> None:
    expected = (node.buffers[0] + node.buffers[1]) * 0.5
    assert node.b == 3
    jobs = [node.job(0, 0, 3), node.job(1, 0, 1)]  # rank 1 has packed one bucket so far
    for r in range(2):
        node.pipes[r].submit(jobs[r])
    node.drain_until(lambda: all(len(g) == 1 for g in node.gathered))
    assert node.gathered == [[0], [0]]  # only what both ranks have packed
    node.pipes[1].packed(jobs[1], 3)
    node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))
    assert all(e.wait(TIMEOUT) for e in node.released)
    for r in range(2):
        assert torch.equal(node.buffers[r], expected), r
        assert node.pipes[r].statistics().rounds == 1
    assert node.failed == [None, None]


def test_handed_gradients_are_reduced_without_being_copied_first() -> None:
    """Hooks hand autograd's tensors over (`HandedGrads`): each pipeline copies only
    what its peer reads and takes its own chunk from the tensor. The buffers start
    as NaN, so any element read from a buffer before it was written shows; an
    averaging scale of 1/2 gives the bits of scaling first."""
    node = Node(post=1.0, handed=True)
    try:
        numels = (6, 5, 7)
        grads = [[torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i))
                  for i, n in enumerate(numels)] for r in range(2)]
        for r in range(2):
            node.buffers[r].fill_(float("nan"))
            for i, g in enumerate(grads[r]):
                node.handed[r].hand(i, g, 0.5)  # type: ignore[union-attr]
        flat = [torch.cat(gs) * 0.5 for gs in grads]
        expected = flat[0] + flat[1]
        for r in range(2):
            node.pipes[r].submit(node.job(r, 0, 3))
        node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))
        assert all(e.wait(TIMEOUT) for e in node.released)
        for r in range(2):
            assert torch.equal(node.buffers[r], expected), r
            assert node.handed[r].by_bucket == [[], [], []]  # type: ignore[union-attr]
    finally:
        node.close()


def test_counters_carry_over_into_the_next_round(node: Node) -> None:
    for index in range(3):
        node.gathered = [[], []]
        jobs = [node.job(r, index, 3) for r in range(2)]
        for r in range(2):
            node.pipes[r].submit(jobs[r])
        node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))
        assert all(e.wait(TIMEOUT) for e in node.released)
    assert [int(c[PACKED]) for c in node.pipes[0].window.counters] == [9, 9]
    assert [p.statistics().rounds for p in node.pipes] == [3, 3]


class _RacingJob(RoundJob):
    """`launched` grows between two reads, as when the loop packs concurrently."""

    @property  # type: ignore[override]
    def launched(self) -> int:
        self._value = min(self._value + 1, 3)
        return self._value

    @launched.setter
    def launched(self, value: int) -> None:
        self._value = value - 1


def test_published_count_is_the_count_read_regression() -> None:
    """Regression: the pipeline read `launched` once to decide and again to publish;
    when the loop packed in between, it published less than it recorded and the
    peer waited for buckets forever (a stall in the training benchmark)."""
    node = Node()
    try:
        jobs = [node.job(0, 0, 1, _RacingJob), node.job(1, 0, 3)]
        for r in range(2):
            node.pipes[r].submit(jobs[r])
        node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))
    finally:
        node.close()


def test_a_failing_rank_fails_the_round_on_its_peer_too() -> None:
    boom = RuntimeError("job over")
    node = Node(failure=lambda r: boom if r == 1 else None)
    try:
        for r in range(2):
            node.pipes[r].submit(node.job(r, 0, 3))
        node.drain_until(lambda: all(e is not None for e in node.failed))
        assert node.failed[1] is boom
        assert isinstance(node.failed[0], BackendError) and "rank 1" in str(node.failed[0])
        assert [p.statistics().aborted for p in node.pipes] == [True, True]
    finally:
        node.close()


def test_stopping_mid_round_fails_the_round_instead_of_waiting() -> None:
    node = Node()
    jobs = [node.job(0, 0, 3), node.job(1, 0, 0)]  # rank 1 never packs
    node.pipes[0].submit(jobs[0])
    node.pipes[0].stop()
    node.drain_until(lambda: node.failed[0] is not None)
    assert "closed" in str(node.failed[0])
    node.pipes[1].stop()


def test_a_waiting_pipeline_sleeps_instead_of_spinning(node: Node) -> None:
    node.pipes[0].submit(node.job(0, 0, 3))  # rank 1 has no round yet
    import time

    time.sleep(0.35)
    assert node.pipes[0].statistics().sleeps <= 8  # ~3 timed re-checks, a few wakes
    node.pipes[1].submit(node.job(1, 0, 3))
    node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))


def test_an_idle_pipeline_sleeps_until_given_work(node: Node) -> None:
    """Between rounds nothing can fail, so the thread does not wake to re-check (it
    did 10 times a second per optimizer, ~1 ms of CPU per CNN step of other work),
    and work handed to it still starts at once."""
    import time

    before = node.pipes[0].statistics().sleeps
    time.sleep(0.35)
    assert node.pipes[0].statistics().sleeps - before <= 1
    node.pipes[0].submit(node.job(0, 0, 3))
    node.pipes[1].submit(node.job(1, 0, 3))
    node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))


def test_a_round_waiting_for_a_peer_shows_as_a_stall_naming_it(node: Node) -> None:
    """Invariant 2: the watchdog's stall inspector sees the pipeline's wait (it is
    no engine op) and names the rank that holds it up; a rank that only waits for
    its own backward is no stall."""
    from asynclock._core.engine.progress import Engine

    node.pipes[0].submit(node.job(0, 0, 3))
    late = node.job(1, 0, 0)
    node.pipes[1].submit(late)  # rank 1's backward has packed nothing yet
    node.drain_until(lambda: node.pipes[0].stalled() is not None)
    stall = node.pipes[0].stalled()
    assert stall is not None and "waiting for ranks [1]" in stall.description
    assert "rank 1 packed 0/3" in stall.description
    assert node.pipes[1].stalled() is None
    engine = Engine()
    engine.watched.append(node.pipes[0].stalled)
    snap = engine.snapshot()
    assert snap.in_flight == 1 and snap.ops[0].description == stall.description
    node.pipes[1].packed(late, 3)  # the job itself: its thread may not have taken it yet
    node.drain_until(lambda: all(len(g) == 3 for g in node.gathered))
    assert node.pipes[0].stalled() is None


class _Pending:
    """Stand-in for an op whose peers have not arrived: counts the engine's polls."""

    def __init__(self, patient: bool) -> None:
        from asynclock._core.engine.operation import Lane, State
        from asynclock._core.transports.local import LocalBackend

        self.patient, self.threaded, self.done, self.polls = patient, False, False, 0
        self.state = State.HEADER  # its header round is in flight
        self.awaiting_hint = False
        self.lane = Lane(LocalBackend().channel("stage"))
        self.issued_at = 0.0

    def start(self) -> None:
        return None

    def poll(self) -> bool:
        self.polls += 1
        return False


def test_a_patient_op_is_neither_spun_for_nor_polled_tightly() -> None:
    """The round's checked stage is issued while this rank's backward computes: a
    spin or a tight poll for the peers would take that core (2 ranks, 2 cores)."""
    import anyio

    from asynclock._core.engine.progress import Engine, ProgressPolicy

    engine = Engine(ProgressPolicy(spin_s=0.05, busy_s=1.0))
    eager, patient = _Pending(False), _Pending(True)
    engine.submit(eager)  # type: ignore[arg-type]
    assert eager.polls > 10  # spun for 50 ms
    engine.inflight.clear()
    engine.submit(patient)  # type: ignore[arg-type]
    assert patient.polls == 1

    async def poll_for(seconds: float) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await anyio.sleep(seconds)
            tg.cancel_scope.cancel()

    anyio.run(poll_for, 0.05)
    assert patient.polls <= 60  # ~1 ms sleeps, not a busy loop for `busy_s`


def test_the_loop_is_told_once_every_rank_started_the_round(node: Node) -> None:
    """The checked stage's hint: a rank announcing its round is not enough; when the
    last rank announces, each pipeline tells its loop exactly once, with the count."""
    told: list[list[int]] = [[], []]
    sleeps = node.pipes[0].statistics().sleeps
    node.pipes[0].announce(1, told[0].append)
    node.drain_until(lambda: node.pipes[0].statistics().sleeps > sleeps)  # checked, slept
    assert told == [[], []]  # rank 1 has not started round 1
    node.pipes[1].announce(1, told[1].append)
    node.drain_until(lambda: told == [[1], [1]])
    node.pipes[0].announce(2, told[0].append)
    node.pipes[1].announce(2, told[1].append)
    node.drain_until(lambda: told == [[1, 2], [1, 2]])


def test_an_op_awaiting_its_hint_is_polled_slowly_then_promptly() -> None:
    """Until `Engine.hint`, the checked stage is tested every `max_sleep_s` (a
    fallback should the hint never come), not every millisecond; after the hint it
    is tested at once."""
    import anyio

    from asynclock._core.engine.progress import Engine, ProgressPolicy

    engine = Engine(ProgressPolicy(spin_s=0.0, busy_s=0.0, max_sleep_s=0.02))
    op = _Pending(True)
    op.awaiting_hint = True
    engine.submit(op)  # type: ignore[arg-type]
    seen: dict[str, int] = {}

    async def run() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.run)
            await anyio.sleep(0.1)
            seen["before"] = op.polls
            engine.hint(op)  # type: ignore[arg-type]
            for _ in range(100):
                await anyio.sleep(0)
            seen["after"] = op.polls
            tg.cancel_scope.cancel()

    anyio.run(run)
    assert op.awaiting_hint is False
    assert 2 <= seen["before"] <= 8  # ~5 fallback polls in 100 ms, not ~100
    assert seen["after"] > seen["before"]
