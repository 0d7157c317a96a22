"""Rounds checked once on the loop, whose buckets then go without it.

Two round paths skip the scheduler's loop hop per bucket: the node's shared
window (`shm`) and gloo across hosts (`gloo_rounds`). They share everything
but where a bucket goes once its round is checked:

* hooks report packed buckets from the backward thread (`packed`); the
  launch-order prefix of packed buckets grows under the round's lock, and a
  path takes each new prefix from there (`_prefix_grew`);
* the round's first packed bucket asks the loop for the round's one checked
  stage: an allreduce whose name carries a checksum of the plan (ranks on
  different plans raise the same MismatchError) and which a joined rank
  refuses on every rank (`EVERY_RANK`);
* once it passes, the path takes the round over (`_take_over`);
* refused because a rank joined, the round's buckets go as plain allreduces
  on the lane in launch order, which joined ranks stand in for;
* any failure fails every bucket not yet done, and releases the buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..._core.base.errors import JoinedError
from ..._core.base.tensors import as_buffer
from ..._core.engine.operation import Lane
from ..._core.engine.progress import Engine
from .buckets import Plan
from .scheduler import BucketOp, RoundCheck, bucket_op, round_tag
from .step_run import StepRun


class Round:
    """One round's state, shared by the hook thread and the loop (under `lock`)."""

    def __init__(self, run: StepRun) -> None:
        self.run = run
        self.order = run.plan.launch
        # re-entrant: a path's call may finish a bucket inline (a collective already
        # complete when its callback is attached runs it at once, in the issuing thread)
        self.lock = threading.RLock()
        self.ready = [False] * len(self.order)  # by bucket index
        self.launched = 0  # launch-order prefix packed on this rank
        self.job: Any = None  # the path's, once the round's check passed
        self.failed: BaseException | None = None
        self.started = 0  # this rank's count of checked stages, this round's included
        self.over_mpi: int | None = None  # a rank joined: buckets issued as plain allreduces
        self.landed = 0  # buckets done on this rank


class CheckedRounds:
    """The round's check and its fall-backs; a path says where checked buckets go."""

    what = "checked round"  # the path, as stall reports name it

    def __init__(self, engine: Engine, lane: Lane, plan: Plan, post: float,
                 call_soon: Callable[[Callable[[], object]], None]) -> None:
        self.engine, self.lane, self.plan = engine, lane, plan
        self.post, self._call_soon = post, call_soon
        self._rounds: dict[int, Round] = {}
        self._lock = threading.Lock()  # guards _rounds and the counts
        self._started = 0  # rounds whose checked stage was asked for (under _lock)
        self.launched = self.completed = 0

    # -- what a path provides --------------------------------------------------------
    def _prefix_grew(self, rnd: Round, before: int) -> None:
        """The packed prefix grew from `before` to `rnd.launched` (round lock held)."""

    def _take_over(self, rnd: Round) -> None:
        """The round's check passed on every rank (loop): its buckets are the path's."""
        raise NotImplementedError

    def _check_made(self, rnd: Round, check: RoundCheck) -> None:
        """The round's check is about to be submitted (loop)."""

    def _mpi_view(self, rnd: Round, k: int) -> torch.Tensor:
        """Bucket k's values, for a plain allreduce when a rank joined (round lock held)."""
        raise NotImplementedError

    def _scale(self, view: torch.Tensor, then: Callable[[BaseException | None], None]) -> None:
        """Multiply a reduced bucket by `post`, then `then(error)`, both in this thread
        (a path may run them elsewhere)."""
        error: BaseException | None = None
        try:
            if self.post != 1.0:
                view.mul_(self.post)
        except Exception as exc:  # noqa: BLE001 - surfaced as the bucket's error
            error = exc
        then(error)

    def describe(self) -> str:
        return ""

    def close(self) -> None:
        return None

    # -- hook thread -----------------------------------------------------------------
    def packed(self, run: StepRun, k: int) -> None:
        """Bucket k is packed on this rank (any thread): pass the new prefix on."""
        rnd = self._round(run)
        with rnd.lock:
            if rnd.failed:
                return
            rnd.ready[k] = True
            before = rnd.launched
            while rnd.launched < len(rnd.order) and rnd.ready[rnd.order[rnd.launched]]:
                rnd.launched += 1
            launched = rnd.launched
            if launched > before:
                self._prefix_grew(rnd, before)  # under the lock: the order is the lock's
            start = not rnd.started and launched > 0 and rnd.job is None
            if start:
                rnd.started = self._announce()
            loop_needed = start or (rnd.over_mpi is not None and launched > before)
        self._count(launched - before, 0)
        if loop_needed:
            self._call_soon(partial(self._advance, rnd))

    def _announce(self) -> int:
        """Count this round's checked stage."""
        with self._lock:
            self._started = started = self._started + 1
        return started

    def _round(self, run: StepRun) -> Round:
        with self._lock:
            rnd = self._rounds.get(run.number)
            if rnd is None:
                rnd = self._rounds[run.number] = Round(run)
            return rnd

    def _count(self, launched: int, completed: int) -> None:
        with self._lock:
            self.launched += launched
            self.completed += completed

    # -- loop --------------------------------------------------------------------------
    def _advance(self, rnd: Round) -> None:
        with rnd.lock:
            if rnd.failed or rnd.job is not None:
                return None
            if rnd.over_mpi is not None:
                ops = self._over_mpi_ops(rnd)
            else:
                ops, value = [], rnd.launched
        if rnd.over_mpi is not None:  # submitted with the lock let go: one may end inline
            for op in ops:
                self.engine.submit(op)
            return None
        check = RoundCheck(self.lane, f"{self._tag(rnd)}.s1", value, partial(self._checked, rnd))
        self._check_made(rnd, check)
        self.engine.submit(check)
        return None

    def _tag(self, rnd: Round) -> str:
        return round_tag(self.plan, rnd.run.generation)

    def _checked(self, rnd: Round, _least: int, err: BaseException | None) -> None:
        """The round's stage ended, the same way on every rank."""
        if isinstance(err, JoinedError):  # no data moved yet this round
            return self._joined(rnd)
        if err is not None:
            return self._fail(rnd, err)
        return self._take_over(rnd)

    def _joined(self, rnd: Round) -> None:
        with rnd.lock:
            rnd.over_mpi = 0
        return self._advance(rnd)

    # -- joined ranks (loop) -----------------------------------------------------------
    def _over_mpi_ops(self, rnd: Round) -> list[BucketOp]:
        """A rank has joined (`engine.join`): this round's buckets go, in launch order,
        as plain allreduces that joined ranks stand in for. Every active rank saw the
        same refusal of the check. Called with `rnd.lock` held; the caller submits them."""
        assert rnd.over_mpi is not None
        ops = []
        while rnd.over_mpi < rnd.launched:
            k = rnd.order[rnd.over_mpi]
            view = self._mpi_view(rnd, k)
            done = partial(self._reduced_over_mpi, rnd, k, view)
            ops.append(bucket_op(self.lane, as_buffer(view, writable=True),
                                 f"{self._tag(rnd)}.m{rnd.over_mpi}", done))
            rnd.over_mpi += 1
        return ops

    def _reduced_over_mpi(self, rnd: Round, k: int, view: torch.Tensor, op: BucketOp) -> None:
        if rnd.failed:
            return
        if op.error is not None:
            return self._fail(rnd, op.error)
        self._scale(view, partial(self._landed, rnd, k))
        return None

    def _landed(self, rnd: Round, k: int, err: BaseException | None) -> None:
        """Bucket k is reduced here (any thread); the last one releases the round."""
        if err is not None:
            return self._fail(rnd, err)
        with rnd.lock:
            if rnd.failed:
                return None
            rnd.run.finish(k, None)
            rnd.landed += 1
            last = rnd.landed == rnd.run.size
        self._count(0, 1)
        if last:  # the transport read our buffers inside each op: no barrier
            with self._lock:
                self._rounds.pop(rnd.run.number, None)
            rnd.run.release(None)
        return None

    def _fail(self, rnd: Round, err: BaseException) -> None:
        """Fail every bucket of the round not yet done, and release its buffers (any
        thread). The round stays registered, failed: a bucket packed later (ranks
        pack at their own pace) must not start a fresh round whose stage op only
        this rank would issue (seen as a desync at shutdown)."""
        with rnd.lock:
            if rnd.failed:
                return
            rnd.failed = err
            for k in rnd.order:
                if not rnd.run.done[k].is_set():
                    rnd.run.finish(k, err)
        rnd.run.release(err)
