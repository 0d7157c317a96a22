"""The concrete collectives as `Operation` subclasses.

Each one decides from the agreed headers whether the payloads already rode
inline (one round trip in total) or which data stages to run, and builds its
result in the caller's type (torch tensor or numpy array).
"""

from __future__ import annotations

import math
import pickle
from typing import Any

import numpy as np

from ..base.header import FOLD_BOR, FOLD_NONE, INLINE_BYTES, W_DIM0, W_NBYTES, Call, fold_code
from ..base.ops import HALF_CODES, NUMPY_OF_CODE, ReduceOp
from ..base.reduce import finish_average_inplace, fold, from_compute, to_compute
from ..base.tensors import Buffer, empty_like_code
from .operation import Lane, Operation, Stage

Array = np.ndarray[Any, Any]


def _inline(slot: Array, data: Array) -> None:
    """Copy a small buffer's bytes into a header slot."""
    raw = data.view(np.uint8)
    slot[: raw.size] = raw


def _rows_of(payload: Array, code: int, n: int) -> Array:
    """View each rank's inline payload as `n` elements of dtype `code`."""
    dtype = NUMPY_OF_CODE[code]
    return payload[:, : n * dtype.itemsize].view(dtype)  # last axis contiguous: no copy


def _result(buf: Buffer, out: Array) -> Any:
    """In-place collectives hand back the caller's own object."""
    if out is buf.array:
        return buf.source
    return buf.wrap(out.reshape(buf.shape))


class AllreduceOp(Operation):
    """Sum/average/min/max/product; in place when `out` is the input buffer."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer, out: Array, op: ReduceOp) -> None:
        super().__init__(lane, call)
        self.buf, self.out, self.op = buf, out, op
        self.work: Array | None = None
        self.halved = False  # reduced 16-bit on the wire (ring)
        self.inlined = False  # the payloads rode in the header slots

    def fill_inline(self, slot: Array) -> None:
        if self.buf.array.nbytes <= INLINE_BYTES:
            _inline(slot, self.buf.array)

    def loop_banded(self) -> bool:
        return self.buf.code not in HALF_CODES  # 16-bit sums stay 16-bit: the bulk ring

    def compact_fold(self) -> int | None:
        if self.buf.array.nbytes > INLINE_BYTES:
            return FOLD_NONE
        return fold_code(self.buf.code, self.op)

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        a = self.buf.array
        if a.nbytes <= INLINE_BYTES:
            if self.reduced is not None:  # the compact round folded it
                self.out[...] = self.reduced[: a.nbytes].view(a.dtype)
                if self.op is ReduceOp.AVERAGE:
                    finish_average_inplace(self.out, self.buf.code, self.lane.size)
                self.inlined = True
                return []
            rows_in = _rows_of(payload, self.buf.code, a.size)
            if self.joined:  # joined ranks sent no data: fold the others' (average: / size)
                rows_in = np.delete(rows_in, self.joined, axis=0)
            fold(rows_in, self.buf.code, self.op, self.lane.size, self.out)
            self.inlined = True
            return []
        return self.data_stages()

    def data_stages(self) -> list[Stage]:
        """The one data stage, whatever the size (an agreed round skips the header)."""
        a = self.buf.array
        self.stage_bytes = a.nbytes
        if self.buf.code in HALF_CODES:
            return [self._half_stage]
        send = None if self.out is a else a
        return [lambda t: t.iallreduce(send, self.out, self.op)]

    def _half_stage(self, t: Any) -> Any:
        """16-bit data: on a bulk MPI channel a sum stays 16-bit on the wire (ring);
        elsewhere it is widened to float32, the only float MPI can add."""
        a, code = self.buf.array, self.buf.code
        native = code in getattr(t, "half_codes", ())  # then it has iallreduce_half
        if native and self.op in (ReduceOp.SUM, ReduceOp.AVERAGE):
            if self.out is not a:
                self.out[...] = a
            self.halved = True
            return t.iallreduce_half(self.out, code)
        self.work = np.ascontiguousarray(to_compute(a, code), np.float32)
        return t.iallreduce(None, self.work, self.op)

    def finish(self) -> Any:
        code = self.buf.code
        if self.halved and self.op is ReduceOp.AVERAGE:
            from_compute(to_compute(self.out, code) / np.float32(self.lane.size), code, self.out)
        elif not self.inlined:
            target = self.work if self.work is not None else self.out
            if self.op is ReduceOp.AVERAGE:
                finish_average_inplace(target, code, self.lane.size)
            if self.work is not None:
                from_compute(self.work, code, self.out)
        return _result(self.buf, self.out)


class BroadcastOp(Operation):
    """Root's buffer to everyone; `out` is the input buffer when in place."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer, out: Array, root: int) -> None:
        super().__init__(lane, call)
        self.buf, self.out, self.root = buf, out, root

    def fill_inline(self, slot: Array) -> None:
        if self.lane.rank == self.root and self.buf.array.nbytes <= INLINE_BYTES:
            _inline(slot, self.buf.array)

    def compact_fold(self) -> int | None:
        return FOLD_BOR if self.buf.array.nbytes <= INLINE_BYTES else FOLD_NONE

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        a = self.buf.array
        if a.nbytes <= INLINE_BYTES:
            if self.reduced is not None:  # root's bytes, OR'ed with the others' zeros
                self.out[...] = self.reduced[: a.nbytes].view(a.dtype)
                return []
            self.out[...] = _rows_of(payload[self.root: self.root + 1], self.buf.code, a.size)[0]
            return []
        if self.lane.rank == self.root and self.out is not a:
            self.out[...] = a
        self.stage_bytes = a.nbytes
        return [lambda t: t.ibcast(self.out, self.root)]

    def finish(self) -> Any:
        return _result(self.buf, self.out)


class AllgatherOp(Operation):
    """Concatenate along dim 0; each rank's dim 0 may differ."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer) -> None:
        super().__init__(lane, call)
        self.buf = buf
        self.shape = buf.shape if buf.shape else (1,)
        self.out: Array = np.empty(0)

    def fill_inline(self, slot: Array) -> None:
        if self.buf.array.nbytes <= INLINE_BYTES:
            _inline(slot, self.buf.array)

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        row_elems = math.prod(self.shape[1:])
        dim0s = [int(d) for d in rows[:, W_DIM0]]
        counts = [d * row_elems for d in dim0s]
        self.out = empty_like_code(self.buf.code, sum(counts))
        self.shape = (sum(dim0s), *self.shape[1:])
        if int(rows[:, W_NBYTES].max()) <= INLINE_BYTES:
            self._concat(payload, counts)
            return []
        self.stage_bytes = self.out.nbytes
        return [lambda t: t.iallgatherv(self.buf.array, self.out, counts)]

    def _concat(self, payload: Array, counts: list[int]) -> None:
        pos = 0
        for r, n in enumerate(counts):
            self.out[pos: pos + n] = _rows_of(payload[r: r + 1], self.buf.code, n)[0]
            pos += n

    def finish(self) -> Any:
        return self.buf.wrap(self.out.reshape(self.shape))


def split_rows(dim0: int, size: int) -> list[int]:
    """Horovod's reducescatter split: as even as possible, first ranks larger."""
    base, extra = divmod(dim0, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


class ReduceScatterOp(Operation):
    """Reduce, then rank r keeps the r-th slice of dim 0."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer, op: ReduceOp) -> None:
        super().__init__(lane, call)
        self.buf, self.op = buf, op
        shape = buf.shape if buf.shape else (1,)
        rows = split_rows(shape[0], lane.size)
        row_elems = math.prod(shape[1:])
        self.counts = [r * row_elems for r in rows]
        self.shape = (rows[lane.rank], *shape[1:])
        self.out = empty_like_code(buf.code, self.counts[lane.rank])
        self.work: Array | None = None
        self.send: Array = buf.array

    def compact_fold(self) -> int | None:
        return FOLD_NONE

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        self.stage_bytes = self.buf.array.nbytes
        send, recv = self.buf.array, self.out
        if self.buf.code in HALF_CODES:
            send = np.ascontiguousarray(to_compute(send, self.buf.code), np.float32)
            self.work = recv = np.empty(self.out.size, np.float32)
        # Held by the op: the stage is dropped once issued, and a non-blocking
        # reduce-scatter still reads `send` until it completes.
        self.send = send
        return [lambda t: t.ireduce_scatter(send, recv, self.counts, self.op)]

    def finish(self) -> Any:
        target = self.work if self.work is not None else self.out
        if self.op is ReduceOp.AVERAGE:
            finish_average_inplace(target, self.buf.code, self.lane.size)
        if self.work is not None:
            from_compute(self.work, self.buf.code, self.out)
        return self.buf.wrap(self.out.reshape(self.shape))


class AlltoallOp(Operation):
    """Send `splits[r]` rows of dim 0 to rank r; receive theirs in rank order."""

    def __init__(self, lane: Lane, call: Call, buf: Buffer, splits: list[int]) -> None:
        super().__init__(lane, call)
        self.buf = buf
        self.row_elems = math.prod(buf.shape[1:])
        self.send_splits = np.asarray(splits, np.int64)
        self.recv_splits = np.empty(lane.size, np.int64)
        self.out: Array = np.empty(0)

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        self.stage_bytes = int(rows[:, W_NBYTES].sum())  # agreed by all ranks
        return [lambda tr: tr.ialltoall(self.send_splits, self.recv_splits), self._data_stage]

    def _data_stage(self, transport: Any) -> Any:
        scounts = [int(s) * self.row_elems for s in self.send_splits]
        rcounts = [int(s) * self.row_elems for s in self.recv_splits]
        self.out = empty_like_code(self.buf.code, sum(rcounts))
        return transport.ialltoallv(self.buf.array, scounts, self.out, rcounts)

    def finish(self) -> Any:
        shape = (int(self.recv_splits.sum()), *self.buf.shape[1:])
        return self.buf.wrap(self.out.reshape(shape)), [int(s) for s in self.recv_splits]


class BarrierOp(Operation):
    """The header round alone is the barrier, and it checks call order too."""

    def compact_fold(self) -> int | None:
        return FOLD_NONE


class BroadcastObjectOp(Operation):
    """Pickle on root, unpickle everywhere; sizes travel in the header."""

    def __init__(self, lane: Lane, call: Call, blob: bytes) -> None:
        super().__init__(lane, call)
        self.blob = np.frombuffer(blob, np.uint8)
        self.out: Array = np.empty(0, np.uint8)

    def fill_inline(self, slot: Array) -> None:
        if self.blob.size <= INLINE_BYTES:
            slot[: self.blob.size] = self.blob

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        root = self.call.root
        n = int(rows[root, W_NBYTES])
        if n <= INLINE_BYTES:
            self.out = payload[root, :n].copy()
            return []
        self.out = self.blob.copy() if self.lane.rank == root else np.empty(n, np.uint8)
        self.stage_bytes = n
        return [lambda t: t.ibcast(self.out, root)]

    def finish(self) -> Any:
        return pickle.loads(self.out.tobytes())


class AllgatherObjectOp(Operation):
    """Every rank's object, in rank order."""

    def __init__(self, lane: Lane, call: Call, blob: bytes) -> None:
        super().__init__(lane, call)
        self.blob = np.frombuffer(blob, np.uint8)
        self.sizes: list[int] = []
        self.out: Array = np.empty(0, np.uint8)

    def fill_inline(self, slot: Array) -> None:
        if self.blob.size <= INLINE_BYTES:
            slot[: self.blob.size] = self.blob

    def plan(self, rows: Array, payload: Array) -> list[Stage]:
        self.sizes = [int(n) for n in rows[:, W_NBYTES]]
        if max(self.sizes) <= INLINE_BYTES:
            self.out = np.concatenate([payload[r, :n] for r, n in enumerate(self.sizes)])
            return []
        self.out = np.empty(sum(self.sizes), np.uint8)
        self.stage_bytes = self.out.nbytes
        return [lambda t: t.iallgatherv(self.blob, self.out, self.sizes)]

    def finish(self) -> Any:
        raw, pos, objs = self.out.tobytes(), 0, []
        for n in self.sizes:
            objs.append(pickle.loads(raw[pos: pos + n]))
            pos += n
        return objs
