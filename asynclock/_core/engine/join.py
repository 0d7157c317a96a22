"""`join()`: a rank that ran out of data stands in for the others (Horovod's join).

With uneven data some ranks finish an epoch early. Horovod's answer, and
DDP's `Join`, is that a finished rank keeps taking part in the others'
allreduces with neutral data until every rank has finished. Here that is a
header-level role: on each of the coordinator's lanes a joined rank posts
`Kind.JOIN` headers, one round at a time. Every rank sees every header
(`header.check`), so all reach the same verdict for each round:

* every header says JOIN: all ranks joined; the round carries each rank's
  join mark, from which every rank names the same last joiner;
* the others call an allreduce: joined ranks contribute the op's identity
  (zeros for sum and average, so an average still divides by the full size,
  as in Horovod; +inf/max for min, -inf/min for max, 1 for product), through
  the same data stages a participant would run (`AllreduceOp.plan`), on the
  transport the live ranks' headers name (MPI, or the channel's process group:
  `device_pg.stand_in`);
* a barrier: the header round is the barrier;
* anything else raises `JoinedError` on every rank, and the joined ranks go
  on serving (Horovod refuses broadcast, allgather and alltoall likewise).
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np

from ..base.errors import JoinedError, MismatchError, RemoteInputError
from ..base.header import (
    INLINE_BYTES,
    PROCESS_GROUP,
    W_DTYPE,
    W_KIND,
    W_NAME,
    W_NBYTES,
    W_OP,
    W_ROOT,
    W_SEQ,
    Call,
)
from ..base.ops import FLOAT_CODES, HALF_CODES, NUMPY_OF_CODE, Kind, ReduceOp
from ..base.reduce import from_compute
from ..base.tensors import Buffer
from . import staging
from .collective_ops import AllreduceOp
from .device_pg import stand_in
from .handle import Handle
from .operation import Lane, Operation, Stage
from .progress import Engine

Array = np.ndarray[Any, Any]
JOIN_NAME = "join"
# errors of the others' round: raised on them too; a joined rank keeps serving
PEER_ERRORS = (JoinedError, MismatchError, RemoteInputError)


def identity(code: int, op: ReduceOp, n: int) -> Array:
    """`n` elements of dtype `code` that leave `op`'s result unchanged."""
    dtype = NUMPY_OF_CODE[code]
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return np.zeros(n, dtype)
    if op is ReduceOp.PRODUCT:
        value: float = 1
    elif code in FLOAT_CODES:
        value = np.inf if op is ReduceOp.MIN else -np.inf
    else:
        info = np.iinfo(dtype.type)  # type: ignore[type-var]
        value = info.max if op is ReduceOp.MIN else info.min
    if code not in HALF_CODES:
        return np.full(n, value, dtype)
    out = np.empty(n, dtype)
    from_compute(np.full(n, value, np.float32), code, out)
    return out


class JoinOp(Operation):
    """One round of a joined rank on one lane (see the module text)."""

    def __init__(self, lane: Lane, seq: int, mark: int) -> None:
        super().__init__(lane, Call(Kind.JOIN, seq, op=mark, name=JOIN_NAME))
        self.marks: tuple[int, ...] | None = None
        self.stand_in: AllreduceOp | None = None  # owns the identity data in flight

    def _on_header(self) -> None:
        # A stand-in round counts as the call it stands in for, whatever its
        # outcome (a refused broadcast too): on a lane by name only an unnamed
        # call advances the count (`Lane.next_seq`).
        rows = self._recv.reshape(self.lane.size, -1)
        working = rows[rows[:, W_KIND] != int(Kind.JOIN)]
        if len(working) and not int(working[0, W_NAME]):
            self.lane.seq = int(working[0, W_SEQ])
        super()._on_header()

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        if not self.joined:  # our own header says JOIN, so every header does
            self.marks = tuple(int(m) for m in rows[:, W_OP])
            return []
        first = rows[int(np.flatnonzero(rows[:, W_KIND] != int(Kind.JOIN))[0])]
        if Kind(int(first[W_KIND])) is not Kind.ALLREDUCE or int(first[W_NBYTES]) <= INLINE_BYTES:
            return []  # a barrier, or inline data: the header round was all of it
        return self._stand_in(first, rows, payload)

    def _stand_in(self, first: Array, rows: Array, payload: Array) -> list[Stage]:
        """The data stages of the others' allreduce, run with identity data."""
        code, op = int(first[W_DTYPE]), ReduceOp(int(first[W_OP]))
        n = int(first[W_NBYTES]) // NUMPY_OF_CODE[code].itemsize
        data = identity(code, op, n)
        call = Call(Kind.ALLREDUCE, int(first[W_SEQ]), op=int(op), dtype=code, shape=(n,),
                    nbytes=data.nbytes, name=JOIN_NAME)
        if int(first[W_ROOT]) & PROCESS_GROUP:  # the live ranks' data goes through the group
            ours = stand_in(self.lane, call, data, op)
        else:
            ours = AllreduceOp(self.lane, call, Buffer(data, code, (n,), _same), data, op)
        ours.joined, self.stand_in = self.joined, ours
        stages = ours.plan(rows, payload)
        self.stage_bytes = ours.stage_bytes
        return stages

    def finish(self) -> tuple[int, ...] | None:
        return self.marks


def _same(a: Array) -> Array:
    return a


async def join_lanes(engine: Engine, lanes: list[Lane]) -> int:
    """Serve every lane until all ranks joined; the rank that joined last.

    A rank's mark is how many collectives it had issued on these lanes when
    it joined: a later joiner has the larger mark (ties: the higher rank).
    Header rounds count on a lane by name, whose W_SEQ skips named calls.
    """
    mark = sum(lane.rounds if lane.by_name else lane.seq for lane in lanes)
    marks: list[tuple[int, ...]] = []
    async with anyio.create_task_group() as tg:
        for lane in lanes:
            tg.start_soon(_serve, engine, lane, mark, marks)
    final = marks[0]
    return max(range(len(final)), key=lambda r: (final[r], r))


async def _serve(engine: Engine, lane: Lane, mark: int, marks: list[tuple[int, ...]]) -> None:
    """JOIN rounds on one lane, one at a time, until every rank's header says JOIN."""
    while True:
        op = JoinOp(lane, lane.next_seq(JOIN_NAME), mark)
        try:
            result = await Handle(engine, staging.submit(engine, lane, op))
        except PEER_ERRORS:
            continue
        if result is not None:
            marks.append(result)
            return
