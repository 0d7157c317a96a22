"""Small collectives without an Operation: the same wire protocol, fewer steps.

An allreduce or broadcast of at most `INLINE_BYTES`, and every barrier,
already costs one round trip: the data rides in the header slot
(`AllreduceOp`, `BroadcastOp`, `BarrierOp`). On the general path the rest
of such a call is Python bookkeeping: a `Call`, 18 packed words, an
`Operation`, a `Handle`, fresh views of the received slots, which cost many
times the MPI call itself (figures: the benchmarks page).

This path keeps, per call signature (kind, dtype, shape, op or root, name),
what its round sends with only the sequence number left to patch (the
compact key, or the packed header on a channel with rows rounds only) and
the finishing step (copy, fold or divide) bound to views of reused receive
buffers. It issues the round from reused buffers and tests it for the
engine's spin time. On the wire it is the general path's exact bytes, so
ranks on either path agree; when the compact verdict says the ranks differ,
the general path takes the call and raises the same error on all.

An allreduce too big to ride inline comes this way too while nothing earlier
on its lane waits for its data stage: the header round, then its data
allreduce from the same call, the channel's non-blocking one or, for a bulk
size, the node window's steps on the loop where the window would run it there
now (`BulkChannel.loop_ready`); elsewhere a bulk size takes the general path,
whose wait thread moves it.

If the round has not finished when the spin ends, the request and its
buffers are handed to the general path's operation in the engine (the next
call gets fresh buffers), so awaiting, cancellation, stall reports and
failure handling are the general path's. Anything unusual (timeline
recording, a held CUDA staging gate, a failed engine, bfloat16, big or odd
inputs) takes the general path from the start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import anyio.lowlevel
import numpy as np

from ..base.errors import BackendError
from ..base.header import (
    COMPACT_HEAD,
    COMPACT_WORDS,
    FOLD_BOR,
    FOLD_NONE,
    FOLDS,
    HEADER_BYTES,
    INLINE_BYTES,
    SLOT_BYTES,
    SLOT_WORDS,
    WORDS,
    Call,
    check,
    fold_code,
    joining,
    key_of_call,
    pack,
)
from ..base.ops import (
    BFLOAT16,
    DTYPE_CODES,
    HALF_CODES,
    NUMPY_OF_CODE,
    Kind,
    ReduceOp,
    as_reduce_op,
)
from ..base.reduce import HALF, finish_average_inplace, fold
from ..base.tensors import _NUMPY_CODES, _TORCH_CODES, Buffer, _torch_code, _torch_wrapper
from . import fastpath, header_round, staging
from .collective_ops import AllreduceOp, BarrierOp, BroadcastOp
from .handle import Handle
from .header_round import DIFFERENT, DONE_FOLDED, IN_FLIGHT
from .operation import Lane, Operation
from .progress import Engine

Array = np.ndarray[Any, Any]

NOT_SMALL: Any = object()  # "take the general path": nothing was issued
FOLDED: Any = object()  # the round folded the result into `out` already
# Every 64th call yields to the loop once it finished (`yield_then`).
YIELD_MASK = 63
_MAX_SIGNATURES = 256  # names made per call (f"step{i}") must not grow the cache forever


async def yield_then(result: Any) -> Any:
    """Every `YIELD_MASK + 1`th small call lets other tasks run once it has finished:
    calls that all finish inside the spin would otherwise never let the loop run
    anything else. After the issue, and shielded, so it is no cancellation point: a
    call in a cancelled scope is issued like any other (tests/programs/
    small_calls.py checks it: check_cancelled_scope_still_issues). Twice, so a task whose
    timer expired meanwhile runs too (see `SyncService.maybe_yield`)."""
    await anyio.lowlevel.cancel_shielded_checkpoint()
    await anyio.lowlevel.cancel_shielded_checkpoint()
    return result


@dataclass(frozen=True, slots=True)
class SmallCallStatistics:
    """Calls that came this way, and rounds handed to the engine: header rounds
    (a late rank) and data stages (a slow transfer; also counted in handed_off).
    `rows_rounds`: the lane's rows rounds, every path's (on a channel with a compact
    round they run only when ranks differ or a call needs every rank's slot)."""

    calls: int
    handed_off: int
    data_handed_off: int
    rows_rounds: int = 0


class Signature(NamedTuple):
    """What every call with this kind, dtype, shape, op or root and name shares."""

    call: Call  # seq 0; the real one is patched in
    header: bytes  # the compact key (`header_round.KEY`), or the packed header words
    end: int  # HEADER_BYTES + the bytes this rank sends inline
    code: int
    finish: Callable[[Array], None]  # the result into `out`, from the received slots
    make: Callable[[Call, Buffer | None, Array | None], Operation]  # for a hand-off
    op: ReduceOp | None = None  # set for an allreduce whose data follows the header
    fold: int = 0  # 1: the compact round copies the reduced payload into `out`; 0: `finish`
    bump: int = 1  # 0: a named call on a lane by name does not advance W_SEQ (`Lane.next_seq`)
    bulk: bool = False  # a bulk size: staged only into a node window on the loop


class SmallCalls:
    """One lane's fast path; used only from the loop thread, like the engine."""

    def __init__(self, engine: Engine, lane: Lane) -> None:
        self._engine, self._lane, self._size = engine, lane, lane.size
        self._compact = lane.header_rounds.compact
        self._signatures: dict[tuple[Any, ...], Signature | None] = {}
        self.calls = 0  # also drives the periodic yield (`YIELD_MASK`)
        self.handed_off = self.data_handed_off = 0
        self._seq, self._issued_at = 0, 0.0  # of the round in flight
        self._last = LastTensor(None, (np.empty(0), 0, ()))
        self._gates = staging.held_lanes()
        self._new_buffers()

    def _new_buffers(self) -> None:
        """Fresh slots: the old ones now belong to an operation in flight."""
        if self._compact:
            self._send = np.zeros(COMPACT_WORDS, np.int64)
            self._recv = np.zeros(COMPACT_WORDS, np.int64)
        else:
            self._send = np.zeros(SLOT_WORDS, np.int64)
            self._recv = np.zeros(SLOT_WORDS * self._size, np.int64)
        lane = self._lane
        self._round = lane.header_rounds.small_round(self._send, self._recv)
        self._signatures.clear()  # finishing steps are bound to the old receive slots
        self._last_allreduce: tuple[Any, Any, Any, Signature | None] = (None, None, None, None)
        # An allreduce of the last armed signature runs whole in C where the round is
        # C's (`_fastpath.c`'s HotAllreduce); it falls back to `_allreduce` for the rest.
        self._hot = fastpath.hot_allreduce(self._round, self, YIELD_MASK, yield_then,
                                           self._allreduce, self._after_hot, self._engine, lane,
                                           self._gates)
        self._armed: Signature | None = None  # the signature the hot call runs
        self._armed_inplace = True
        self.allreduce: Callable[[Any, Any, str | None, bool], Any] = (
            self._allreduce if self._hot is None else self._hot.call)

    def statistics(self) -> SmallCallStatistics:
        return SmallCallStatistics(self.calls, self.handed_off, self.data_handed_off,
                              self._lane.rows_rounds + (0 if self._compact else self.calls))

    # -- the calls: each returns its result, a `Handle` to await, or NOT_SMALL ----
    def _allreduce(self, obj: Any, op: Any, name: str | None, inplace: bool) -> Any:
        """`allreduce` where the C hot call does not take it: counts the call, and every
        YIELD_MASK + 1th that finished here yields once (`yield_then`)."""
        n = self.calls = self.calls + 1
        result = self._allreduce_once(obj, op, name, inplace)
        if n & YIELD_MASK or result is NOT_SMALL or type(result) is Handle:
            return result
        return yield_then(result)

    def _allreduce_once(self, obj: Any, op: Any, name: str | None, inplace: bool) -> Any:
        if name:
            self._lane.claim(name)
        view = self._view(obj, inplace)
        if view is None:
            return NOT_SMALL
        a, code, shape = view
        hit = self._last_allreduce
        if hit[0] is view and hit[1] is op and hit[2] is name:
            sig = hit[3]  # the same tensor, op and name as the last call: no key to hash
        else:
            key = (Kind.ALLREDUCE, code, shape, op, name)
            sig = self._signatures.get(key, NOT_SMALL)
            if sig is NOT_SMALL:
                sig = self._remember(key, self._allreduce_signature(a, code, shape, op, name))
            self._last_allreduce = (view, op, name, sig)
        if sig is None:
            return NOT_SMALL
        if name is None and self._hot is not None and (
                self._armed is not sig or self._armed_inplace is not inplace):
            self._arm(obj, op, sig, shape, inplace)
        if sig.op is not None:
            return self._allreduce_staged(sig, sig.op, obj, a, shape, inplace)
        out = a if inplace else np.empty(shape, a.dtype)
        req = self._exchange(sig, a, out)
        return self._result(sig, obj, a, shape, out, inplace, req)

    def _arm(self, obj: Any, op: Any, sig: Signature, shape: Any, inplace: bool) -> None:
        """A call with no name whose round folds it inline (a float average: then
        divides it): the C hot call takes the next calls of its signature (input
        type, op, dtype, shape, in place or not)."""
        if sig.op is not None:
            return
        average = 0
        if sig.fold != 1:
            if as_reduce_op(op) is not ReduceOp.AVERAGE:
                return
            if header_round.KEY.unpack(sig.header)[1] not in _FLOAT_SUMS:
                return  # integer averages round in numpy only, so every rank agrees
            average = self._size
        assert self._hot is not None
        array = type(obj) is np.ndarray
        dtype = None if array else obj.dtype  # an array: its buffer's format
        new_like = None if inplace else (np.empty_like if array
                                         else sys.modules["torch"].empty_like)
        self._hot.arm(obj, op, dtype, shape, sig.header, sig.bump, sig.call.nbytes, inplace,
                      new_like, average)
        self._armed, self._armed_inplace = sig, inplace

    def _after_hot(self, state: int, seq: int, issued_at: float, obj: Any) -> Any:
        """The hot call's round did not fold (in flight, or ranks differ): go on as
        `_allreduce` does from `_exchange`."""
        assert self._armed is not None
        self._seq, self._issued_at = seq, issued_at
        inplace = self._armed_inplace
        sig, view = self._armed, self._view(obj, inplace)
        assert view is not None  # the hot call checked what `_view` checks
        a, _, shape = view
        out = a if inplace else np.empty(shape, a.dtype)
        result = self._result(sig, obj, a, shape, out, inplace,
                              self._judged(state, sig, issued_at))
        if self.calls & YIELD_MASK or type(result) is Handle:  # the hot call counted it
            return result
        return yield_then(result)

    def _allreduce_staged(self, sig: Signature, op: ReduceOp, obj: Any, a: Array, shape: Any,
                          inplace: bool) -> Any:
        """Too big to ride inline: the header round, then the data allreduce, both
        from this call. Only while nothing earlier on this lane still waits to
        issue its data stage: data stages go out in header order on every rank.
        A bulk size comes here only where the channel's node window would run it on
        the loop now (`loop_ready`), and its data is that window allreduce."""
        if self._lane.queue:
            return NOT_SMALL
        bulk: Any = self._lane.transport.bulk_view() if sig.bulk else None
        if bulk is not None and not bulk.loop_ready(a):
            return NOT_SMALL
        req = self._exchange(sig, None, whole=False)
        if req is not None:
            return self._hand_off(sig, req, obj, a, shape, inplace)
        out = a if inplace else np.empty(a.size, a.dtype)
        try:
            data = (self._lane.transport.iallreduce if bulk is None else bulk.loop_allreduce)(
                None if inplace else a, out, op)
        except Exception as exc:  # as `Operation.issue_next` reports it
            raise BackendError(f"allreduce #{self._seq} on {self._lane.transport.name}: "
                               f"{exc}") from exc
        if data is None:  # a peer failed in the window meanwhile: the engine issues the
            # data stage of the agreed round, as for any operation (and fails it)
            self._lane.synchronous -= 1  # counted as finished here by `_judged`
            return self._hand_off(sig, header_round.finished_request(), obj, a, shape, inplace)
        deadline = self._issued_at + self._engine.spin_for(self._lane)
        while not data.Test():
            if time.perf_counter() >= deadline:
                return self._hand_off_data(sig, data, obj, a, out, shape)
            header_round.idle()
        self._engine.note_latency(self._lane, time.perf_counter() - self._issued_at)
        if op is ReduceOp.AVERAGE:
            finish_average_inplace(out, sig.code, self._size)
        return obj if inplace else _wrap(obj, sig.code)(out.reshape(shape))

    def broadcast(self, obj: Any, root: int, name: str | None, inplace: bool) -> Any:
        if name:
            self._lane.claim(name)
        if not 0 <= root < self._size:
            return NOT_SMALL  # the general path names the bad root on every rank
        view = self._view(obj, inplace)
        if view is None:
            return NOT_SMALL
        a, code, shape = view
        key = (Kind.BROADCAST, code, shape, root, name)
        sig = self._signatures.get(key, NOT_SMALL)
        if sig is NOT_SMALL:
            sig = self._remember(key, self._broadcast_signature(a, code, shape, root, name))
        if sig is None:
            return NOT_SMALL
        req = self._exchange(sig, a if self._lane.rank == root else None)
        out = a if inplace else np.empty(shape, a.dtype)
        return self._result(sig, obj, a, shape, out, inplace, req)

    def barrier(self, name: str | None) -> Any:
        if name:
            self._lane.claim(name)
        if not self._engine_ready():
            return NOT_SMALL
        key = (Kind.BARRIER, name)
        sig = self._signatures.get(key, NOT_SMALL)
        if sig is NOT_SMALL:
            sig = self._remember(key, self._signature(Call(Kind.BARRIER, 0, name=name or ""),
                                                      0, 0, _nothing, _barrier_op(self._lane)))
        req = self._exchange(sig, None)
        return None if req is None else self._hand_off(sig, req, None, np.empty(0), (), False)

    # -- the shared steps ---------------------------------------------------------
    def _engine_ready(self) -> bool:
        engine = self._engine
        return (engine.on_event is None and engine.failure is None and self._lane.matcher is None
                and self._lane not in self._gates)

    def _view(self, obj: Any, inplace: bool) -> tuple[Array, int, Any] | None:
        """The input's flat numpy view, dtype code and shape; None: general path."""
        engine = self._engine  # `_engine_ready`, inlined
        if engine.on_event is not None or engine.failure is not None or self._lane in self._gates \
                or self._lane.matcher is not None:
            return None
        last = self._last
        if (obj is last.tensor and obj.data_ptr() == last.ptr and obj.dtype is last.dtype
                and obj.is_cpu and obj.shape == last.view[2] and obj.is_contiguous()):
            return last.view  # the same memory: see LastTensor
        view = _view(obj, inplace)
        if view is not None and type(obj) is not np.ndarray and view[0].nbytes <= INLINE_BYTES:
            self._last = LastTensor(obj, view)
        return view

    def _exchange(self, sig: Signature, data: Array | None, out: Array | None = None,
                  whole: bool = True) -> Any:
        """Issue the header round and spin: None once it completed and every rank
        agreed (else the general path's error is raised), FOLDED when the round
        also folded the inline rows into `out`, or the request: still in flight,
        or finished with joined ranks standing in. Kept flat: a Python call is a
        measurable share of a small collective's time. `whole`: the round is the
        whole op (its time teaches the lane's spin); a staged allreduce reports its
        time after the data."""
        rnd, lane = self._round, self._lane
        seq = self._seq = lane.seq + 1  # Lane.next_seq, inlined
        lane.seq += sig.bump
        lane.rounds += 1
        issued_at = self._issued_at = time.perf_counter()
        state = rnd.exchange(sig.header, seq, data, lane.spin_s,
                             sig.fold if out is not None else 0, out)
        if state == DONE_FOLDED:  # the common case, inline
            n = lane.synchronous = lane.synchronous + 1  # the engine's statistics count it
            if not n & 7:
                self._engine.count_synchronous(issued_at, lane)
            return FOLDED
        return self._judged(state, sig, issued_at, whole)

    def _judged(self, state: int, sig: Signature, issued_at: float, whole: bool = True) -> Any:
        """`_exchange`'s answer for a round that did not fold (the C hot call's too); a
        round that finished here is counted, and every 8th teaches the lane's spin
        (`whole`)."""
        if state == IN_FLIGHT:
            return self._lane.header_rounds.take_request(self._round)
        if state == DIFFERENT and self._check(sig):
            return header_round.finished_request()  # a rank joined: the general path folds
        lane = self._lane
        n = lane.synchronous = lane.synchronous + 1
        if not n & 7:
            self._engine.count_synchronous(issued_at, lane if whole else None)
        return None

    def _result(self, sig: Signature, obj: Any, a: Array, shape: Any, out: Array,
                inplace: bool, req: Any) -> Any:
        """Finish into the caller's object (in place) or `out`, wrapped in its type."""
        if req is FOLDED:
            return obj if inplace else _wrap(obj, sig.code)(out)
        if req is not None:
            return self._hand_off(sig, req, obj, a, shape, inplace)
        if inplace:
            sig.finish(a)
            return obj
        sig.finish(out.reshape(-1))
        return _wrap(obj, sig.code)(out)

    def _check(self, sig: Signature) -> bool | tuple[int, ...]:
        """Headers differ: on a lane by name, hand the round to the general path,
        which matches it (`engine.matching`); else raise the general path's
        error (same text on every rank), or name the ranks that joined and stand
        in (`engine.join`). A compact verdict has no rows: the general path runs
        the rows round and decides."""
        if self._compact:
            return True
        rows = self._recv.reshape(self._size, SLOT_WORDS)[:, :WORDS]
        if self._lane.by_name and not joining(rows):
            return True
        return check(rows, sig.call.kind)

    # -- slow edges ---------------------------------------------------------------
    def _remember(self, key: tuple[Any, ...], sig: Signature | None) -> Signature | None:
        if len(self._signatures) >= _MAX_SIGNATURES:
            self._signatures.clear()
            self._last_allreduce = (None, None, None, None)
        self._signatures[key] = sig
        return sig

    def _allreduce_signature(self, a: Array, code: int, shape: Any, op: Any,
                             name: str | None) -> Signature | None:
        """None: not for this path (a bulk size, a 16-bit float, or an op the general
        path rejects); above INLINE_BYTES the data follows in its own allreduce."""
        staged = a.nbytes > INLINE_BYTES
        bulk = staged and self._engine.policy.waits_in_thread(a.nbytes,
                                                              self._lane.transport.loop_band)
        if code == BFLOAT16 or (staged and (code in HALF_CODES or staging.cpu_twin())):
            return None  # the twin's data goes through the device group, as CUDA data does
        if bulk and getattr(self._lane.transport.bulk_view(), "window", None) is None:
            return None  # the wait thread's: only a node window runs a bulk size here
        try:
            rop = as_reduce_op(op)
        except ValueError:
            return None  # the general path announces the fault and raises
        if rop is ReduceOp.ADASUM:
            return None  # as for a bad op: the general path refuses it on every rank
        call = Call(Kind.ALLREDUCE, 0, op=int(rop), dtype=code, shape=tuple(shape),
                    nbytes=a.nbytes, name=name or "")
        lane = self._lane

        def make(c: Call, b: Buffer | None, o: Array | None) -> Operation:
            return AllreduceOp(lane, c, b, o, rop)  # type: ignore[arg-type]

        if staged:
            return self._signature(call, 0, code, _nothing, make)._replace(op=rop, bulk=bulk)
        if not self._compact:
            return self._signature(call, a.nbytes, code, self._fold(code, rop, a.size), make)
        fold = fold_code(code, rop)
        if fold is None:
            return None  # the compact round cannot fold it: the general path's rows round
        if rop is ReduceOp.AVERAGE:
            finish = self._average(code, a.size)
            return self._signature(call, a.nbytes, code, finish, make, fold)
        return self._signature(call, a.nbytes, code, _nothing, make, fold)._replace(fold=1)

    def _broadcast_signature(self, a: Array, code: int, shape: Any, root: int,
                             name: str | None) -> Signature | None:
        if a.nbytes > INLINE_BYTES or code == BFLOAT16:
            return None
        call = Call(Kind.BROADCAST, 0, dtype=code, root=root, shape=tuple(shape),
                    nbytes=a.nbytes, name=name or "")
        lane = self._lane

        def make(c: Call, b: Buffer | None, o: Array | None) -> Operation:
            return BroadcastOp(lane, c, b, o, root)  # type: ignore[arg-type]

        inline = a.nbytes if lane.rank == root else 0
        if self._compact:
            root_bytes = self._reduced(code, a.size)
            return self._signature(call, inline, code, lambda out: np.copyto(out, root_bytes),
                                   make, FOLD_BOR)
        row = self._rows(code, a.size)[root]
        return self._signature(call, inline, code, lambda out: np.copyto(out, row), make)

    def _signature(self, call: Call, inline: int, code: int, finish: Callable[[Array], None],
                   make: Callable[[Call, Buffer | None, Array | None], Operation],
                   fold: int = FOLD_NONE) -> Signature:
        """`fold`: the compact round's fold code of the inline payload."""
        header = np.zeros(WORDS, np.int64)
        pack(call, header)
        bump = 0 if call.name and self._lane.by_name else 1
        sent = (header_round.KEY.pack(key_of_call(header), fold) if self._compact
                else header.tobytes())
        return Signature(call, sent, HEADER_BYTES + inline, code, finish, make, bump=bump)

    def _reduced(self, code: int, n: int) -> Array:
        """The compact round's reduced payload, as `n` elements of `code`."""
        dtype = NUMPY_OF_CODE[code]
        start = COMPACT_HEAD * 8
        return self._recv.view(np.uint8)[start: start + n * dtype.itemsize].view(dtype)

    def _average(self, code: int, n: int) -> Callable[[Array], None]:
        """An average's finish: the reduced sum, divided (`reduce.divide`'s rounding)."""
        total, size = self._reduced(code, n), self._size

        def finish(out: Array) -> None:
            np.copyto(out, total)
            finish_average_inplace(out, code, size)

        return finish

    def _rows(self, code: int, n: int) -> Array:
        """Each rank's inline payload in the receive slots, as `n` elements of `code`."""
        payload = self._recv.view(np.uint8).reshape(self._size, SLOT_BYTES)[:, HEADER_BYTES:]
        return payload[:, : n * NUMPY_OF_CODE[code].itemsize].view(NUMPY_OF_CODE[code])

    def _fold(self, code: int, op: ReduceOp, n: int) -> Callable[[Array], None]:
        """The reduction of the received payloads, rank order, bound to the slots."""
        rows, size = self._rows(code, n), self._size
        if size == 2 and op is not ReduceOp.AVERAGE and code not in HALF:
            ufunc, first, second = _BINARY[op], rows[0], rows[1]
            return lambda out: ufunc(first, second, out=out)  # = reduce(axis=0) at 2 rows
        return lambda out: fold(rows, code, op, size, out)

    def _hand_off(self, sig: Signature, req: Any, obj: Any, flat: Array, shape: Any,
                  inplace: bool) -> Handle:
        """The round is slow (a late rank): let the engine own it from here."""
        call = sig.call._replace(seq=self._seq)
        if obj is None:
            op = sig.make(call, None, None)
        else:
            buf = Buffer(flat, sig.code, tuple(shape), _wrap(obj, sig.code), obj)
            op = sig.make(call, buf, flat if inplace else np.empty(flat.size, flat.dtype))
        op.resume_header(req, self._send, self._recv)
        self._new_buffers()
        self.handed_off += 1
        self._engine.adopt_issued(op, self._issued_at)
        return Handle(self._engine, op)

    def _hand_off_data(self, sig: Signature, req: Any, obj: Any, flat: Array, out: Array,
                       shape: Any) -> Handle:
        """Headers agreed, the data allreduce is slow: the engine finishes it."""
        buf = Buffer(flat, sig.code, tuple(shape), _wrap(obj, sig.code), obj)
        op = sig.make(sig.call._replace(seq=self._seq), buf, out)
        op.resume_data(req)
        self.handed_off += 1
        self.data_handed_off += 1
        self._engine.adopt_issued(op, self._issued_at)
        return Handle(self._engine, op)


def _nothing(out: Array) -> None:
    """The finishing step of calls whose result is not in the header slots."""
    return None


def _barrier_op(lane: Lane) -> Callable[[Call, Buffer | None, Array | None], Operation]:
    return lambda c, b, o: BarrierOp(lane, c)


class LastTensor:
    """The last small tensor seen and its numpy view: `tensor.numpy()` plus its
    checks are a third of this path's cost, and loops pass the same tensor.

    The view is reused only while the tensor's memory is provably the same
    (checked in `SmallCalls._view`, inline on the hot path): data pointer,
    shape, dtype, contiguity and device (`set_`, `.data =`,
    `resize_` and in-place transposes all change one of them). Only tensors
    that took this path (<= INLINE_BYTES) are held, so nothing big is kept alive.
    """

    __slots__ = ("tensor", "view", "ptr", "dtype")

    def __init__(self, tensor: Any, view: tuple[Array, int, Any]) -> None:
        self.tensor, self.view = tensor, view
        self.ptr = tensor.data_ptr() if tensor is not None else 0
        self.dtype = tensor.dtype if tensor is not None else None


# The compact fold codes of float32 and float64 sums (`header.FOLDS`).
_FLOAT_SUMS = frozenset(FOLDS[(DTYPE_CODES[d], ReduceOp.SUM)] for d in ("float32", "float64"))

_BINARY = {ReduceOp.SUM: np.add, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum,
           ReduceOp.PRODUCT: np.multiply}


def _view(obj: Any, inplace: bool) -> tuple[Array, Any, Any] | None:
    """(flat numpy view, dtype code, shape) of a plain CPU tensor or array, else None."""
    if type(obj) is np.ndarray:
        if not obj.flags.c_contiguous or (inplace and not obj.flags.writeable):
            return None
        code = DTYPE_CODES.get(_NUMPY_CODES.get(obj.dtype, ""), 0)
        return (obj.reshape(-1), code, obj.shape) if code else None
    torch = sys.modules.get("torch")
    if torch is None or type(obj) is not torch.Tensor:
        return None
    if not obj.is_cpu or not obj.is_contiguous():
        return None
    code = _TORCH_CODES.get(obj.dtype) or _torch_code(obj.dtype)
    if not code or code == BFLOAT16:
        return None
    a = obj.detach().numpy() if obj.requires_grad else obj.numpy()
    return a.reshape(-1), code, obj.shape


def _wrap(obj: Any, code: int) -> Callable[[Array], Any]:
    """How a new result is returned in the caller's type."""
    if type(obj) is np.ndarray:
        return _same
    return _torch_wrapper(code, sys.modules["torch"])


def _same(a: Array) -> Array:
    return a
