"""The shared-memory gradient pipeline: one thread per reducer, no MPI per bucket.

Every rank publishes its progress as counters in its control block of the
node's shared window (`transports.shared_window`, which also defines how
counters are stored and read, the bells and `aborted`), which only it
writes and every rank reads:

* `packed`: buckets (in launch order) whose gradients sit in its buffer;
* `reduced`: buckets whose chunk it owns it has summed over all ranks and stored
  in every rank's buffer (each rank's `.grad` views its own);
* `gathered`: rounds it has seen every rank reduce, whole in its buffer, so no
  peer reads or writes its buffer for them any more;
* `aborted` (the window's own slot): set when its pipeline failed, so peers fail
  too instead of waiting;
* `started`: rounds whose checked stage it has issued. Only a hint: when
  every rank's count reaches the round this rank waits to check, its loop is
  told to test that stage now, instead of polling it every millisecond while
  the slowest peer's backward reaches its first bucket (many wake-ups of the
  loop per step, on the cores that train; figures on the benchmarks page).

Counters only grow (round m's bucket j counts as m * buckets + j + 1), so a
rank needs nothing but the minimum over ranks to know what it may do next:
reduce its chunk of every bucket all ranks have packed, and hand on every
bucket all ranks have reduced. The results do not depend on how ranks batch these
steps (each chunk is summed by its owner in rank order), so nothing has to
be agreed per bucket: instead of an MPI allreduce and a poll loop per stage
on the event loop, a rank here wakes only when a peer rings its bell (a
futex in the window) or its own backward packs a bucket.

Per round the loop still issues one checked stage (see `ShmTransport`):
it compares plan checksums, and a joined rank refuses it on every rank.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from ..._core.base.errors import BackendError
from ..._core.base.from_thread import name_os_thread
from ..._core.engine.progress import InflightOp
from ..._core.transports.shared_window import ABORTED, HINT, LOCAL, PEER, SharedWindow
from .buckets import Bucket, Plan
from .shard import Shards
from .shm_chunks import HandedGrads, Span, chunk, reduce_chunk

PACKED, REDUCED, GATHERED, STARTED, SUMMED, SYNCED = range(1, 7)  # after the window's ABORTED
_CHECK_S = 0.1  # a waiting pipeline re-checks for failures this often
# between rounds nothing can fail here, and everything that gives work rings the
# bell: sleep long (every idle wake-up takes CPU from the training step)
_IDLE_S = 5.0
_STOP_GRACE_S = 10.0  # a stopped pipeline waits this long for peers to end its round


@dataclass(frozen=True, slots=True)
class PipelineStatistics:
    """Exact counts, for tests: rounds finished here, futex sleeps, whether aborted."""

    rounds: int
    sleeps: int
    aborted: bool


@dataclass(eq=False)
class RoundJob:
    """One round as the pipeline sees it; `launched` is written by the loop."""

    index: int  # this transport's shared-memory round number, the same on every rank
    order: tuple[int, ...]
    launched: int
    on_gathered: Callable[[range], None]  # positions now complete (called in this thread)
    on_failed: Callable[[BaseException], None]  # called in this thread
    release: Callable[[BaseException | None], None]  # thread-safe: buffers free again
    published: int = 0
    reduced: int = 0
    gathered: int = 0
    updated: int = 0  # sharded: positions whose pieces this rank has stepped
    hyper: list[dict[str, Any]] | None = None  # sharded: the round's settings, from step()
    run_number: int = -1  # the reducer's round number (sharded: synchronize() asks by it)
    sync_stage: int = 0  # sharded synchronize(): 1 summed published, 2 gathered, 3 done


class ShmPipeline:
    """Runs rounds one after another in its own thread, driven by counters."""

    def __init__(self, window: SharedWindow, plan: Plan, peers: dict[str, list[torch.Tensor]],
                 post: float, call_soon: Callable[[Callable[[], object]], None],
                 failure: Callable[[], BaseException | None],
                 handed: HandedGrads | None = None) -> None:
        self.window, self.plan, self.peers, self.post = window, plan, peers, post
        self.handed = handed  # gradients hooks did not copy (see shm_chunks)
        self.shard: Shards | None = None  # set: update my chunks, copy nothing back (shard)
        self.me, self.n = window.rank, window.size
        self._call_soon, self._failure = call_soon, failure
        self._jobs: deque[RoundJob] = deque()
        self._tasks: deque[tuple[Callable[[], None], Callable[[BaseException | None], None]]] \
            = deque()  # side jobs (scaling buckets that went over MPI), before rounds
        self._watch = self._hinted = 0  # started rounds: announced here / all-started told
        self._on_all_started: Callable[[int], None] = _ignore
        self._stopped = False
        self._stopped_at = 0.0  # perf_counter() when stop() was called
        self.current: RoundJob | None = None
        self._finished = self._sleeps = 0
        self._blocked_since: float | None = None  # waiting on peers since (perf_counter)
        self._thread = threading.Thread(target=self._run, name="asynclock-shm", daemon=True)
        self._thread.start()

    # -- loop side ---------------------------------------------------------------
    def submit(self, job: RoundJob) -> None:
        self._jobs.append(job)
        self.window.ring(self.me, LOCAL)

    def run_soon(self, task: Callable[[], None],
                 then: Callable[[BaseException | None], None]) -> None:
        """Run `task` in this thread; `then(error)` runs on the loop afterwards."""
        self._tasks.append((task, then))
        self.window.ring(self.me, LOCAL)

    def packed(self, job: RoundJob, launched: int) -> None:
        job.launched = launched
        self.window.ring(self.me, LOCAL)

    def wake(self) -> None:
        """Look at the round again now (its `step()` handed what it waited for)."""
        self.window.ring(self.me, LOCAL)

    def stop(self) -> None:
        """Finish the round in hand (if peers let it), then end the thread."""
        self._stopped_at = time.perf_counter()
        self._stopped = True
        self.window.ring(self.me, LOCAL)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_STOP_GRACE_S + 1)

    def announce(self, started: int, on_all_started: Callable[[int], None]) -> None:
        """This rank issued its `started`-th round's checked stage (hook thread):
        publish it; once every rank has, `on_all_started(started)` runs on the loop."""
        self._on_all_started = on_all_started
        self._watch = started
        self._publish(STARTED, started, HINT)
        self.window.ring(self.me, LOCAL)  # maybe the last to start: look now

    def statistics(self) -> PipelineStatistics:
        return PipelineStatistics(self._finished, self._sleeps,
                                  bool(self.window.counters[self.me][ABORTED]))

    def describe(self) -> str:
        """Stall text: which ranks are behind, and in which step of the round."""
        job = self.current
        if job is None:
            return "shared memory: no round in progress here"
        base, b = job.index * len(job.order), len(job.order)
        counts = [(q, p - base, r - base) for q, (p, r) in
                  enumerate(zip(self.window.peek(PACKED), self.window.peek(REDUCED), strict=True))]
        behind = [f"rank {q} packed {max(0, p)}/{b}, reduced {max(0, r)}/{b}"
                  for q, p, r in counts if min(p, r) < b]
        return "shared memory round: " + ("; ".join(behind) or "every rank done")

    # -- the thread --------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread("asynclock-shm")
        while True:
            bell = self.window.bell()
            self._tell_all_started()
            while self._tasks:
                self._task(*self._tasks.popleft())
            if self.current is None and self._jobs:
                self.current = self._jobs.popleft()
            if self.current is None and self._stopped:
                return
            if self.current is None or not self._advance(self.current):
                self._note_blocked(self.current)
                self._sleeps += 1
                self.window.sleep(bell, _CHECK_S if self.current is not None else _IDLE_S)

    def _tell_all_started(self) -> None:
        watch = self._watch
        if watch > self._hinted and self._least(STARTED, 0, watch) >= watch:
            self._hinted = watch
            self._call_soon(partial(self._on_all_started, watch))

    def _task(self, task: Callable[[], None],
              then: Callable[[BaseException | None], None]) -> None:
        error: BaseException | None = None
        try:
            task()
        except Exception as exc:  # surfaced as the bucket's error on the loop
            error = exc
        self._call_soon(lambda: then(error))

    def _note_blocked(self, job: RoundJob | None) -> None:
        """Start the stall clock when only a peer can move the round on."""
        if job is None or not self._behind(job):
            self._blocked_since = None
        elif self._blocked_since is None:
            self._blocked_since = time.perf_counter()

    def _behind(self, job: RoundJob) -> list[int]:
        """Ranks whose counters hold this rank back (empty: it waits for its own
        backward, which is no stall of the round)."""
        if job.gathered == len(job.order):
            return [q for q, g in enumerate(self.window.peek(GATHERED)) if g <= job.index]
        packed, reduced = self.window.peek(PACKED), self.window.peek(REDUCED)
        return [q for q in range(self.n)
                if packed[q] < packed[self.me] or reduced[q] < reduced[self.me]]

    def stalled(self) -> InflightOp | None:
        """The round's wait for peers, as the stall inspector shows ops (any thread)."""
        job, since = self.current, self._blocked_since
        if job is None or since is None:
            return None
        text = (f"shared-memory gradient round {job.index} waiting for ranks "
                f"{self._behind(job)} ({self.describe()})")
        return InflightOp(text, time.perf_counter() - since, -1, job.index, id(job))

    def _advance(self, job: RoundJob) -> bool:
        """Do whatever the counters allow; False when only a peer can move things."""
        try:
            problem = self._problem(job)
            if problem is not None:
                raise problem
            moved = self._progress(job)
            if moved:
                self._blocked_since = None
            return moved
        except Exception as exc:  # a torch error here, or a peer/job failure
            self._abort(job, exc)
            return True

    def _progress(self, job: RoundJob) -> bool:
        base, b = job.index * len(job.order), len(job.order)
        launched = job.launched  # read once: the loop raises it concurrently
        if launched > job.published:
            self._fill_positions(job, range(job.published, launched))
            self._publish(PACKED, base + launched)
            job.published = launched
        packed = self._least(PACKED, base, b)
        if packed > job.reduced:
            self._reduce_positions(job, range(job.reduced, packed))
            job.reduced = packed
            if self.shard is None:
                self._publish(REDUCED, base + packed)
            return True
        if self.shard is not None and job.reduced > job.updated:
            return self._update_positions(job, self.shard, base)
        reduced = self._least(REDUCED, base, b)
        if reduced > job.gathered:
            return self._gather_positions(job, range(job.gathered, reduced))
        if job.gathered == b and self._least(GATHERED, job.index, 1) == 1:
            self._finish(job)
            return True
        return False

    def _least(self, counter: int, base: int, top: int) -> int:
        """Minimum over ranks of `counter`, as a position within this round."""
        return max(0, min(self.window.least(counter) - base, top))

    def _publish(self, counter: int, value: int, kind: str = PEER) -> None:
        self.window.publish(counter, value, kind)

    def _fill_positions(self, job: RoundJob, positions: range) -> None:
        """Copy what peers read of these buckets into my buffer, before I say packed."""
        if self.handed is not None:
            for p in positions:
                b = self.plan.buckets[job.order[p]]
                self.handed.fill(b, self.peers[b.group][self.me], self.me, self.n)

    def _reduce_positions(self, job: RoundJob, positions: range) -> None:
        for p in positions:
            self._reduce(self.plan.buckets[job.order[p]])

    def _update_positions(self, job: RoundJob, shard: Shards, base: int) -> bool:
        """Sharded: step my pieces of the reduced buckets, then say REDUCED (peers read
        the parameters after that). Waits for the round's `step()`, which hands over its
        hyperparameters: a bucket reduced during backward is not updated before it."""
        if job.hyper is None:
            moved = self._sync_phase(job, shard)
            if moved is not None:
                return moved
            job.hyper = shard.take_hyper()
            if job.hyper is None:
                return False  # step() not called yet: it rings this bell
        for p in range(job.updated, job.reduced):
            shard.step_bucket(job.order[p], job.hyper)
        job.updated = job.reduced
        self._publish(REDUCED, base + job.updated)
        return True

    def _sync_phase(self, job: RoundJob, shard: Shards) -> bool | None:
        """Sharded `synchronize()` (before this round's step()): once every rank summed
        its chunks, copy the others' into my buffer, so `.grad` is the whole average
        (e.g. to clip it), then wait until every rank has copied mine, so that changing
        `.grad` in place cannot reach a peer still copying. None: nothing asked, or done."""
        request = shard.sync_request(job.run_number)
        if request is None or job.sync_stage == 3:
            return None
        b = len(job.order)
        if job.reduced < b:
            return False
        if job.sync_stage == 0:
            self._publish(SUMMED, job.index + 1)
        elif job.sync_stage == 1 and self._least(SUMMED, job.index, 1) == 1:
            for p in range(b):
                self._copy_peer_chunks(self.plan.buckets[job.order[p]])
            self._publish(SYNCED, job.index + 1)
        elif job.sync_stage == 2 and self._least(SYNCED, job.index, 1) == 1:
            request.set()
        else:
            return False
        job.sync_stage += 1
        return True

    def _gather_positions(self, job: RoundJob, positions: range) -> bool:
        """Every rank reduced these buckets: my buffer holds them whole, since each
        owner stored its chunk in it too (`_write_through`; sharded, the parameters
        are shared and every update is in place)."""
        job.gathered = positions.stop
        job.on_gathered(positions)
        if job.gathered == len(job.order):
            self._publish(GATHERED, job.index + 1)
        return True

    def _finish(self, job: RoundJob) -> None:
        """Every rank gathered this round: nobody reads my buffers for it any more."""
        self.current = None
        self._finished += 1
        job.release(None)

    def _problem(self, job: RoundJob) -> BaseException | None:
        if self._stopped and not self._owes_nothing(job):
            return BackendError("the gradient reducer was closed during a shared-memory round")
        failure = self._failure()
        if failure is not None:
            return failure
        for q in self.window.aborted():
            if q != self.me:
                return BackendError(f"rank {q} (node rank) failed in the shared-memory "
                                    "gradient reduction; this round cannot complete")
        return None

    def _owes_nothing(self, job: RoundJob) -> bool:
        """This rank has gathered the round and said so; only peers still work on it
        (reading my buffers, then saying GATHERED). A stopped pipeline lets such a
        round end rather than abort it under them: a deferred update's `flush()`
        returns at this point, so a `close()` right after it is normal. Past the
        grace, a peer that never ends the round is failed."""
        return (job.gathered == len(job.order)
                and time.perf_counter() - self._stopped_at < _STOP_GRACE_S)

    def _abort(self, job: RoundJob, exc: BaseException) -> None:
        """Fail the round here and tell peers (they fail instead of waiting for us)."""
        self.current = None
        self._jobs.clear()
        if self.handed is not None:
            self.handed.clear()
        self.window.abort()
        if self.shard is not None:
            self.shard.fail_sync(job.run_number, exc)
        job.on_failed(exc)

    # -- arithmetic --------------------------------------------------------------
    def _reduce(self, b: Bucket) -> None:
        """Sum my chunk over ranks (`reduce_chunk`), run by run: my own part of a
        handed-over gradient is read where autograd left it."""
        lo, hi = chunk(b, self.me, self.n)
        bufs = self.peers[b.group]
        spans = self.handed.spans(b, lo, hi) if self.handed is not None else []
        for run in spans or [Span(lo, hi, None)]:
            h = run.handed
            at = 0 if h is None else h.segment.offset
            mine = None if h is None else h.source[run.lo - at: run.hi - at]
            reduce_chunk([buf[run.lo: run.hi] for buf in bufs], self.me, mine,
                         1.0 if h is None else h.scale)
        if self.post != 1.0:
            bufs[self.me][lo:hi].mul_(self.post)
        if self.shard is None:
            self._write_through(bufs, lo, hi)
        if self.handed is not None:
            self.handed.drop(b.index)

    def _write_through(self, bufs: list[torch.Tensor], lo: int, hi: int) -> None:
        """Store my summed chunk in every peer's buffer too, where its `.grad` views
        it: each peer then has the whole bucket once REDUCED says so, and copies
        nothing back. Only I read a peer's buffer at my chunk (to sum it, done now),
        and the peer writes there again only for a later round, after it packed that
        round's bucket, which I wait for before summing it; a store from here costs
        the peer's load and store of the copy-back."""
        for q in range(self.n):
            if q != self.me:
                bufs[q][lo:hi].copy_(bufs[self.me][lo:hi])

    def _copy_peer_chunks(self, b: Bucket) -> None:
        bufs = self.peers[b.group]
        for q in range(self.n):
            if q != self.me:
                lo, hi = chunk(b, q, self.n)
                bufs[self.me][lo:hi].copy_(bufs[q][lo:hi])


def _ignore(_started: int) -> None:
    return None
