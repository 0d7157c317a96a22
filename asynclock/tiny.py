"""Small allreduces without an Operation: the same wire protocol, fewer steps.

An allreduce of at most `INLINE_BYTES` already costs one round trip: its
data rides in the header slot and every rank folds the gathered slots
(`AllreduceOp`). What was left was Python: a `Call`, 18 packed words, an
`Operation`, a `Handle`, fresh views of the received slots... about 45 us a
call against MPI's 3 us (`bench/collectives.py`, 4 B).

This path keeps, per call signature (dtype, shape, op, name), the header
bytes with only the sequence number left to patch and the fold bound to
views of reused receive slots. It issues the header allgather from reused
buffers and tests it for the engine's spin time. On the wire it is the
general path's exact bytes, so ranks on either path agree, and a mismatch
raises the same error on all of them.

If the round has not finished when the spin ends, the request and its
buffers are handed to a regular `AllreduceOp` in the engine (the next call
gets fresh buffers), so awaiting, cancellation, stall reports and failure
handling are the general path's. Anything unusual (timeline recording, a
held CUDA staging gate, a failed engine, bfloat16, big or odd inputs) takes
the general path from the start.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from . import staging
from .collective_ops import AllreduceOp
from .handle import Handle
from .header import HEADER_BYTES, INLINE_BYTES, SLOT_BYTES, SLOT_WORDS, WORDS, Call, check, pack
from .operation import Lane
from .ops import BFLOAT16, DTYPE_CODES, NUMPY_OF_CODE, Kind, ReduceOp, as_reduce_op
from .progress import Engine
from .reduce import HALF, fold
from .tensors import _NUMPY_CODES, _TORCH_CODES, Buffer, _torch_code, _torch_wrapper

Array = np.ndarray[Any, Any]

NOT_TINY: Any = object()  # "take the general path": nothing was issued
# Every 64th call yields to the loop first: calls that all finish inside the
# spin would otherwise never let the loop run other tasks.
YIELD_MASK = 63
_MAX_SIGNATURES = 256  # names made per call (f"step{i}") must not grow the cache forever


@dataclass(frozen=True, slots=True)
class TinyStatistics:
    """Calls that came this way, and rounds handed to the engine (a late rank)."""

    calls: int
    handed_off: int


class Signature(NamedTuple):
    """What every call with this dtype, shape, op and name shares."""

    call: Call  # seq 0; the real one is patched in
    header: bytes  # the packed header words of `call`
    end: int  # HEADER_BYTES + payload bytes
    code: int
    op: ReduceOp
    fold: Callable[[Array], None]  # reduce the received slots into `out`


class TinyAllreduce:
    """One lane's fast path; used only from the loop thread, like the engine."""

    def __init__(self, engine: Engine, lane: Lane) -> None:
        self._engine, self._lane, self._size = engine, lane, lane.size
        self._pair = lane.size == 2
        self._signatures: dict[tuple[Any, ...], Signature | None] = {}
        self.calls = 0  # also drives the periodic yield (`YIELD_MASK`)
        self.handed_off = 0
        self._last = LastTensor(None, (np.empty(0), 0, ()))
        self._gates = staging.held_lanes()
        self._new_buffers()

    def _new_buffers(self) -> None:
        """Fresh slots: the old ones now belong to an operation in flight."""
        self._send = np.zeros(SLOT_WORDS, np.int64)
        self._recv = np.zeros(SLOT_WORDS * self._size, np.int64)
        self._send_bytes = self._send.view(np.uint8).data
        transport = self._lane.transport  # MPI: the communicator's own Iallgather
        self._start = getattr(transport, "iallgather_slots_direct", transport.iallgather_slots)
        self._signatures.clear()  # folds are bound to the old receive slots

    def statistics(self) -> TinyStatistics:
        return TinyStatistics(self.calls, self.handed_off)

    # -- the call ---------------------------------------------------------------
    def allreduce(self, obj: Any, op: Any, name: str | None, inplace: bool) -> Any:
        """The result, a `Handle` to await, or `NOT_TINY` (nothing was issued).

        One function on purpose: a Python call costs ~0.15 us here, and this
        whole path is budgeted at a few microseconds (`bench/collectives.py`).
        """
        engine = self._engine
        if engine.on_event is not None or engine.failure is not None or self._lane in self._gates:
            return NOT_TINY
        last = self._last
        if (obj is last.tensor and obj.data_ptr() == last.ptr and obj.dtype is last.dtype
                and obj.is_cpu and obj.shape == last.view[2] and obj.is_contiguous()):
            a, code, shape = last.view  # LastTensor.same_memory, inlined
        else:
            view = _view(obj, inplace)
            if view is None:
                return NOT_TINY
            a, code, shape = view
        sig = self._signatures.get((code, shape, op, name), NOT_TINY)
        if sig is NOT_TINY:
            sig = self._signatures[(code, shape, op, name)] = self._signature(
                a, code, shape, op, name)
        if sig is None:
            return NOT_TINY
        if obj is not last.tensor and type(obj) is not np.ndarray:
            self._last = LastTensor(obj, (a, code, shape))
        lane, send_bytes = self._lane, self._send_bytes
        send_bytes[:HEADER_BYTES] = sig.header
        seq = lane.seq = lane.seq + 1  # Lane.next_seq, inlined
        self._send[1] = seq  # W_SEQ
        send_bytes[HEADER_BYTES:sig.end] = a.tobytes()
        issued_at = time.perf_counter()
        req = self._start(self._send, self._recv)
        deadline = issued_at + engine.policy.spin_s
        while not req.Test():
            if time.perf_counter() >= deadline:
                return self._hand_off(sig, seq, obj, (a, shape), inplace, req, issued_at)
        engine.count_synchronous(issued_at)
        if self._pair:  # the common case, inlined: ranks 0 and 1 sent the same header
            raw = self._recv.tobytes()
            if raw[:HEADER_BYTES] != raw[SLOT_BYTES:SLOT_BYTES + HEADER_BYTES]:
                self._check()
        elif self._size > 2 and not self._agree():
            self._check()
        if inplace:
            sig.fold(a)
            return obj
        out = np.empty(shape, a.dtype)
        sig.fold(out.reshape(-1))
        return _wrap(obj, code)(out)

    def _agree(self) -> bool:
        """Every rank's header bytes equal ours (the general path's `agree`)."""
        raw = self._recv.tobytes()
        first = raw[:HEADER_BYTES]
        return all(raw[r * SLOT_BYTES: r * SLOT_BYTES + HEADER_BYTES] == first
                   for r in range(1, self._size))

    def _check(self) -> None:
        """Headers differ: raise the general path's error (same text on every rank)."""
        check(self._recv.reshape(self._size, SLOT_WORDS)[:, :WORDS], Kind.ALLREDUCE)

    # -- slow edges ---------------------------------------------------------------
    def _signature(self, a: Array, code: int, shape: Any, op: Any,
                   name: str | None) -> Signature | None:
        """Build (once per signature) what calls share; None: not for this path."""
        if a.nbytes > INLINE_BYTES or code == BFLOAT16:
            return None
        try:
            rop = as_reduce_op(op)
        except ValueError:
            return None  # the general path announces the fault and raises
        if len(self._signatures) >= _MAX_SIGNATURES:
            self._signatures.clear()
        call = Call(Kind.ALLREDUCE, 0, op=int(rop), dtype=code, shape=tuple(shape),
                    nbytes=a.nbytes, name=name or "")
        header = np.zeros(WORDS, np.int64)
        pack(call, header)
        return Signature(call, header.tobytes(), HEADER_BYTES + a.nbytes, code, rop,
                         self._fold(code, rop, a.size))

    def _fold(self, code: int, op: ReduceOp, n: int) -> Callable[[Array], None]:
        """The reduction of the received payloads, rank order, bound to the slots."""
        payload = self._recv.view(np.uint8).reshape(self._size, SLOT_BYTES)[:, HEADER_BYTES:]
        rows = payload[:, : n * NUMPY_OF_CODE[code].itemsize].view(NUMPY_OF_CODE[code])
        size = self._size
        if size == 2 and op is not ReduceOp.AVERAGE and code not in HALF:
            ufunc, first, second = _BINARY[op], rows[0], rows[1]
            return lambda out: ufunc(first, second, out=out)  # = reduce(axis=0) at 2 rows
        return lambda out: fold(rows, code, op, size, out)

    def _hand_off(self, sig: Signature, seq: int, obj: Any, view: tuple[Array, Any],
                  inplace: bool, req: Any, issued_at: float) -> Handle:
        """The round is slow (a late rank): let the engine own it from here."""
        flat, shape = view
        buf = Buffer(flat, sig.code, tuple(shape), _wrap(obj, sig.code), obj)
        out = flat if inplace else np.empty(flat.size, flat.dtype)
        op = AllreduceOp(self._lane, sig.call._replace(seq=seq), buf, out, sig.op)
        op.resume_header(req, self._recv)
        self._new_buffers()
        self.handed_off += 1
        self._engine.adopt_issued(op, issued_at)
        return Handle(self._engine, op)


class LastTensor:
    """The last small tensor seen and its numpy view: `tensor.numpy()` plus its
    checks are a third of this path's cost, and loops pass the same tensor.

    The view is reused only while the tensor's memory is provably the same:
    data pointer, shape, dtype, contiguity and device (`set_`, `.data =`,
    `resize_` and in-place transposes all change one of them). Only tensors
    that took this path (<= INLINE_BYTES) are held, so nothing big is kept alive.
    """

    __slots__ = ("tensor", "view", "ptr", "dtype")

    def __init__(self, tensor: Any, view: tuple[Array, int, Any]) -> None:
        self.tensor, self.view = tensor, view
        self.ptr = tensor.data_ptr() if tensor is not None else 0
        self.dtype = tensor.dtype if tensor is not None else None

    def same_memory(self, t: Any) -> bool:
        return (t.data_ptr() == self.ptr and t.dtype is self.dtype and t.is_cpu
                and t.shape == self.view[2] and t.is_contiguous())


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
