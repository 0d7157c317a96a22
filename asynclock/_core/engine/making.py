"""Making communicators and windows the way a collective runs.

An MPI communicator, a shared window or a node segment is made by a
collective over its parent: every rank must enter the same creation call in
the same order, and a rank that does not (it is still in an earlier call
that the others left, or it made one optimizer more) leaves the others
blocked inside MPI, out of reach of every deadline. So nothing that is made
after start-up enters MPI directly. It is one more checked call on a lane
(`Kind.MAKE`, named by what is made and carrying the ranks it is for):

1. the header round agrees on it first. Ranks that make different things
   raise the same `MismatchError` naming each rank's call; on a lane that
   matches by name, a make that some ranks never issue waits to be matched
   like any named call, and fails with `UnmatchedError` on every rank once
   every rank has waited past the stray timeout (`engine.matching`);
2. once agreed, the blocking creation runs on the lane's wait thread, as a
   bulk data stage does: never on the loop, never on the caller's thread,
   with the stall reports every operation gets;
3. the operation belongs to the engine once started. A caller cancelled in
   between does not stop it: every rank still makes the object, and the
   cancelled rank discards its copy (`discard`), so no rank is left inside a
   creation that another rank abandoned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

import numpy as np

from ..base.header import FOLD_NONE, Call
from ..base.ops import Kind
from ..transports.base import DataTransport, Deferred, Request
from . import staging
from .operation import Lane, Operation, Stage
from .progress import Engine

T = TypeVar("T")
# Larger than any threshold: the engine hands the stage to the lane's wait thread.
_ON_WAIT_THREAD = 1 << 62


class MakeOp(Operation, Generic[T]):
    """A checked call whose data stage is a blocking creation on the wait thread."""

    def __init__(self, lane: Lane, call: Call, build: Callable[[], T],
                 discard: Callable[[T], None] | None) -> None:
        super().__init__(lane, call)
        self.build, self.discard = build, discard
        self.made: list[T] = []

    def compact_fold(self) -> int | None:
        return FOLD_NONE  # nothing rides inline: agreeing fingerprints are enough

    def plan(self, rows: np.ndarray[Any, Any], payload: np.ndarray[Any, Any]) -> list[Stage]:
        self.stage_bytes = _ON_WAIT_THREAD
        return [self._stage]

    def _stage(self, transport: DataTransport) -> Request:
        return Deferred(self._make)

    def _make(self) -> None:
        self.made.append(self.build())

    def finish(self) -> T | None:
        made = self.made[0]
        if self.detached:  # nobody waits for it any more: this rank's copy goes
            self._discard(made)
            return None
        return made

    def _discard(self, made: T) -> None:
        if self.discard is not None:
            self.discard(made)


def make_call(lane: Lane, what: str, ranks: tuple[int, ...] = ()) -> Call:
    """The header of making `what` (at most 16 characters show in errors) for `ranks`.

    On a lane by name it is a named call: it pairs with the same make on every
    rank, whatever unnamed calls some rank issued before it."""
    name = f"make {what}"
    if lane.by_name:
        lane.claim(name)
    return Call(Kind.MAKE, lane.next_seq(name), name=name, shape=ranks)


def _in_flight(lane: Lane, what: str, ranks: tuple[int, ...]) -> MakeOp[Any] | None:
    """The same make, still in flight on this rank: its caller stopped waiting (a
    timeout, a cancelled task) while the other ranks had not come yet, or another
    task asks for the same thing. The new call waits for it too, since that is the
    make the other ranks' make pairs with."""
    held = lane.names.get(f"make {what}")
    if isinstance(held, MakeOp) and held.call.shape == ranks:
        return held
    return None


async def make(engine: Engine, lane: Lane, what: str, build: Callable[[], T], *,
               ranks: tuple[int, ...] = (),
               discard: Callable[[T], None] | None = None) -> T:
    """Agree on making `what` over `lane`'s ranks, then `build()` it off the loop.

    `build` is a collective over the lane's ranks (it may block inside MPI);
    `discard` frees what it made on a rank whose caller stopped waiting."""
    op: MakeOp[T] | None = _in_flight(lane, what, ranks)
    if op is not None:
        op.detached = False
    else:
        op = MakeOp(lane, make_call(lane, what, ranks), build, discard)
        staging.submit(engine, lane, op)
    try:
        made: T = await engine.wait(op)
    except BaseException:
        if op.done and op.error is None and op.result is not None:
            op._discard(op.result)  # finished as this caller was cancelled
        raise
    return made
