"""The async collective API, mixed into `Coordinator`.

Naming follows Horovod: `allreduce` returns a new tensor, `allreduce_`
works in place, `*_async` returns a `Handle` to await later. Default reduce
op is sum (MPI and torch.distributed); `asynclock.torch` keeps Horovod's
average default.
"""

from __future__ import annotations

import pickle
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base import adasum
from ..base.header import Call
from ..base.ops import Kind, ReduceOp, as_reduce_op
from ..base.tensors import Buffer, InputFault, InputRejected, as_buffer, empty_like_code
from ..engine import collective_ops as ops
from ..engine.handle import Handle
from ..engine.operation import Lane, Operation
from ..engine.progress import Engine
from ..engine.small_calls import NOT_SMALL, YIELD_MASK, SmallCalls, yield_then
from ..engine.staging import submit

_PENDING = (Handle, types.CoroutineType)  # what a small call may return to await


class Collectives:
    """Mixin: needs `_engine`, `_lane` (user channel), `_small` and `_check_open()`."""

    _engine: Engine
    _lane: Lane
    _small: SmallCalls

    def _check_open(self) -> None:
        raise NotImplementedError

    # -- plumbing --------------------------------------------------------------
    def _submit(self, op: Operation) -> Handle:
        return Handle(self._engine, submit(self._engine, self._lane, op))

    def _call(self, kind: Kind, name: str | None, buf: Buffer | None = None, **kw: Any) -> Call:
        shape = buf.shape if buf is not None else ()
        nbytes = buf.array.nbytes if buf is not None else kw.pop("nbytes", 0)
        dtype = buf.code if buf is not None else 0
        return Call(kind, self._next_seq(name), dtype=dtype, shape=shape, nbytes=nbytes,
                    name=name or "", **kw)

    def _next_seq(self, name: str | None) -> int:
        """The call's W_SEQ; a name still held by a call of ours is refused here,
        before anything is sent (Horovod raises ValueError too)."""
        lane = self._lane
        if name:
            lane.claim(name)
        return lane.next_seq(name or "")

    def _buffer(self, kind: Kind, tensor: Any, name: str | None, *, writable: bool = False,
                **kw: Any) -> Buffer:
        """Validate; on a bad input still join the header round, then raise."""
        self._check_open()
        try:
            return as_buffer(tensor, writable=writable, stage=True)
        except InputRejected as exc:
            self._announce_fault(kind, name, exc.fault, **kw)
            raise

    def _pickled(self, kind: Kind, obj: Any, name: str | None, **kw: Any) -> bytes:
        """`obj` pickled; where it cannot be, still join the header round, then raise, so
        every rank fails this call and the next one matches."""
        try:
            return pickle.dumps(obj)
        except Exception as exc:
            self._announce_fault(kind, name, InputFault.UNPICKLABLE, **kw)
            raise InputRejected(InputFault.UNPICKLABLE, f"{type(exc).__name__}: {exc}") from exc

    def _announce_fault(self, kind: Kind, name: str | None, fault: InputFault, **kw: Any) -> None:
        """Tell the other ranks why we will not take part, so they fail too."""
        call = Call(kind, self._next_seq(name), name=name or "", fault=int(fault), **kw)
        submit(self._engine, self._lane, Operation(self._lane, call))

    def _reduce_op(self, op: ReduceOp | str, name: str | None,
                   kind: Kind = Kind.ALLREDUCE) -> ReduceOp:
        """An unknown op name is bad input: the other ranks hear of it and fail too. So is
        Adasum, which no header carries (`adasum()` computes it)."""
        try:
            rop = as_reduce_op(op)
            if rop is ReduceOp.ADASUM:
                raise ValueError("Adasum is no elementwise reduction: adasum(tensor) "
                                 "computes it from every rank's tensor")
            return rop
        except ValueError as exc:
            self._check_open()
            self._announce_fault(kind, name, InputFault.BAD_ARGUMENT)
            raise InputRejected(InputFault.BAD_ARGUMENT, str(exc)) from None

    # -- allreduce -------------------------------------------------------------
    def allreduce_async(self, tensor: Any, op: ReduceOp | str = "sum", *,
                        name: str | None = None) -> Handle:
        """Start an out-of-place allreduce.

        Args:
            tensor: a torch tensor (CPU or CUDA) or a numpy array, of the same shape and dtype
                on every rank.
            op: the reduction: a `ReduceOp` member or its name ("sum", "average", "min",
                "max", "product"); the same on every rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives the reduction as a new tensor (or array) of
            `tensor`'s type, shape and dtype.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `op` is unknown or Adasum; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
            ShutdownError: the coordinator was shut down.
        """
        rop = self._reduce_op(op, name)
        buf = self._buffer(Kind.ALLREDUCE, tensor, name, op=int(rop))
        out = empty_like_code(buf.code, buf.array.size)
        return self._submit(ops.AllreduceOp(self._lane, self._call(
            Kind.ALLREDUCE, name, buf, op=int(rop)), buf, out, rop))

    def allreduce_async_(self, tensor: Any, op: ReduceOp | str = "sum", *,
                         name: str | None = None) -> Handle:
        """Start an in-place allreduce.

        Args:
            tensor: a writable torch tensor or numpy array, of the same shape and dtype on
                every rank; it receives the result.
            op: the reduction: a `ReduceOp` member or its name ("sum", "average", "min",
                "max", "product"); the same on every rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives `tensor` itself, holding the reduction.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `op` is unknown or Adasum; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
            ShutdownError: the coordinator was shut down.
        """
        rop = self._reduce_op(op, name)
        buf = self._buffer(Kind.ALLREDUCE, tensor, name, writable=True, op=int(rop))
        return self._submit(ops.AllreduceOp(self._lane, self._call(
            Kind.ALLREDUCE, name, buf, op=int(rop)), buf, buf.array, rop))

    async def allreduce(self, tensor: Any, op: ReduceOp | str = "sum", *,
                        name: str | None = None) -> Any:
        """Reduce `tensor` across ranks into a new tensor.

        Small tensors usually finish inside the call (the small-message path); larger
        ones are awaited without blocking the loop.

        Args:
            tensor: a torch tensor (CPU or CUDA) or a numpy array, of the same shape and dtype
                on every rank.
            op: the reduction: a `ReduceOp` member or its name ("sum", "average", "min",
                "max", "product"); the same on every rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            The reduction, of `tensor`'s type, shape and dtype.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `op` is unknown or Adasum (use `adasum`); the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        result = self._small.allreduce(tensor, op, name, False)
        if result is NOT_SMALL:
            return await self.allreduce_async(tensor, op, name=name)
        return (await result) if type(result) in _PENDING else result

    async def allreduce_(self, tensor: Any, op: ReduceOp | str = "sum", *,
                         name: str | None = None) -> Any:
        """Reduce `tensor` across ranks in place.

        Args:
            tensor: a writable torch tensor or numpy array, of the same shape and dtype on
                every rank; it receives the result.
            op: the reduction: a `ReduceOp` member or its name ("sum", "average", "min",
                "max", "product"); the same on every rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            `tensor`, holding the reduction.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `op` is unknown or Adasum (use `adasum`); the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
            ShutdownError: the coordinator was shut down.
        """
        # The small-call path counts the call and yields every YIELD_MASK + 1th itself
        # (`SmallCalls.allreduce`): a loop's flag or loss, reduced step after step,
        # takes no more Python than this.
        self._check_open()
        result = self._small.allreduce(tensor, op, name, True)
        if result is tensor:
            return tensor
        if result is NOT_SMALL:
            return await self.allreduce_async_(tensor, op, name=name)
        return (await result) if type(result) in _PENDING else result

    # -- the small-message path (engine.small_calls) ---------------------------------
    def _now(self, small: Callable[..., Any], general: Callable[..., Handle], *args: Any) -> Any:
        """The result if a small call finished inside this call (`engine.small_calls`),
        else something to await: a `Handle`, or a coroutine that yields first.

        Not a coroutine itself: on the small path every layer of `await` costs
        a measurable share of the call (`bench/collectives.py` at 4 B shows it).
        """
        path = self._small
        path.calls += 1
        self._check_open()
        result = small(*args)
        if result is NOT_SMALL:
            return general(*args)
        if not path.calls & YIELD_MASK and type(result) not in _PENDING:
            return yield_then(result)
        return result

    # -- broadcast -------------------------------------------------------------
    def broadcast_async(self, tensor: Any, root: int = 0, *, name: str | None = None) -> Handle:
        """Start an out-of-place broadcast of root's `tensor`.

        Args:
            tensor: a torch tensor (CPU or CUDA) or a numpy array, of the same shape and dtype
                on every rank.
            root: the rank whose tensor is sent.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives root's tensor as a new tensor on every rank.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `root` is not a rank; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
            ShutdownError: the coordinator was shut down.
        """
        buf = self._rooted(Kind.BROADCAST, tensor, root, name, writable=False)
        out = buf.array.copy() if self._lane.rank == root else empty_like_code(
            buf.code, buf.array.size)
        return self._submit(ops.BroadcastOp(self._lane, self._call(
            Kind.BROADCAST, name, buf, root=root), buf, out, root))

    def broadcast_async_(self, tensor: Any, root: int = 0, *, name: str | None = None) -> Handle:
        """Start an in-place broadcast into `tensor` on every rank.

        Args:
            tensor: a writable torch tensor or numpy array, of the same shape and dtype on
                every rank; it receives the result.
            root: the rank whose tensor is sent.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives `tensor`, holding root's values.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `root` is not a rank; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
            ShutdownError: the coordinator was shut down.
        """
        buf = self._rooted(Kind.BROADCAST, tensor, root, name, writable=True)
        return self._submit(ops.BroadcastOp(self._lane, self._call(
            Kind.BROADCAST, name, buf, root=root), buf, buf.array, root))

    def _rooted(self, kind: Kind, tensor: Any, root: int, name: str | None, *,
                writable: bool) -> Buffer:
        self._check_root(kind, root, name)
        return self._buffer(kind, tensor, name, writable=writable, root=root)

    def _check_root(self, kind: Kind, root: int, name: str | None) -> None:
        if not 0 <= root < self._lane.size:
            self._announce_fault(kind, name, InputFault.BAD_ARGUMENT)
            raise InputRejected(InputFault.BAD_ARGUMENT,
                                f"root {root} is not a rank of a world of {self._lane.size}")

    async def broadcast(self, tensor: Any, root: int = 0, *, name: str | None = None) -> Any:
        """Root's `tensor` on every rank, as a new tensor.

        Args:
            tensor: a torch tensor (CPU or CUDA) or a numpy array, of the same shape and dtype
                on every rank.
            root: the rank whose tensor is sent.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A copy of root's tensor, of `tensor`'s type.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `root` is not a rank; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
            ShutdownError: the coordinator was shut down.
        """
        result = self._now(self._small.broadcast, self._broadcast_general, tensor, root, name,
                           False)
        return (await result) if type(result) in _PENDING else result

    async def broadcast_(self, tensor: Any, root: int = 0, *, name: str | None = None) -> Any:
        """Overwrite `tensor` with root's on every rank.

        Args:
            tensor: a writable torch tensor or numpy array, of the same shape and dtype on
                every rank; it receives the result.
            root: the rank whose tensor is sent.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            `tensor`, holding root's values.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `root` is not a rank; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
            ShutdownError: the coordinator was shut down.
        """
        result = self._now(self._small.broadcast, self._broadcast_general, tensor, root, name, True)
        return (await result) if type(result) in _PENDING else result

    def _broadcast_general(self, tensor: Any, root: int, name: str | None,
                           inplace: bool) -> Handle:
        start = self.broadcast_async_ if inplace else self.broadcast_async
        return start(tensor, root, name=name)

    # -- allgather, reduce_scatter, alltoall -----------------------------------
    def allgather_async(self, tensor: Any, *, name: str | None = None) -> Handle:
        """Start concatenating every rank's tensor along dim 0.

        Args:
            tensor: a torch tensor or numpy array; dim 0 may differ by rank, the other dims
                and the dtype may not.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives the concatenation in rank order.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (dtype, later dims).
            ShutdownError: the coordinator was shut down.
        """
        buf = self._buffer(Kind.ALLGATHER, tensor, name)
        return self._submit(ops.AllgatherOp(self._lane, self._call(Kind.ALLGATHER, name, buf), buf))

    async def allgather(self, tensor: Any, *, name: str | None = None) -> Any:
        """Concatenation of every rank's `tensor` along dim 0, in rank order.

        Args:
            tensor: a torch tensor or numpy array; dim 0 may differ by rank, the other dims
                and the dtype may not.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A new tensor whose dim 0 is the sum of the ranks' dims 0.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (dtype, later dims).
            ShutdownError: the coordinator was shut down.
        """
        return await self.allgather_async(tensor, name=name)

    @property
    def group_size(self) -> int:
        """How many ranks take part in these collectives (the world, or a process set)."""
        return self._lane.size

    async def adasum(self, tensor: Any, *, name: str | None = None) -> Any:
        """Horovod's `op=Adasum`: the adaptive sum of `tensor` over ranks, identical on every rank.

        Computed from an allgather of every rank's tensor.

        Args:
            tensor: a floating-point torch tensor or numpy array, of the same shape on every
                rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            The adaptive sum, a new tensor of `tensor`'s shape.

        Raises:
            ValueError: the number of ranks is not a power of two.
            MismatchError: on every rank, where the ranks' tensors differ in shape or dtype.
        """
        adasum.check_size(self.group_size)
        gathered = await self.allgather(tensor.reshape(1, *tensor.shape), name=name)
        return adasum.reduce_gathered(gathered, tensor)

    def reduce_scatter_async(self, tensor: Any, op: ReduceOp | str = "sum", *,
                             name: str | None = None) -> Handle:
        """Start a reduction whose result is scattered along dim 0.

        Args:
            tensor: a torch tensor (CPU or CUDA) or a numpy array, of the same shape and dtype
                on every rank.
            op: the reduction: a `ReduceOp` member or its name ("sum", "average", "min",
                "max", "product"); the same on every rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives this rank's slice.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                `op` is unknown or Adasum, or `tensor` is 0-d; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
            ShutdownError: the coordinator was shut down.
        """
        rop = self._reduce_op(op, name, Kind.REDUCE_SCATTER)
        buf = self._buffer(Kind.REDUCE_SCATTER, tensor, name, op=int(rop))
        if not buf.shape:  # nothing to scatter along: Horovod refuses a scalar too
            self._announce_fault(Kind.REDUCE_SCATTER, name, InputFault.BAD_ARGUMENT,
                                 op=int(rop))
            raise InputRejected(InputFault.BAD_ARGUMENT,
                                "reduce_scatter splits dim 0, and a 0-d tensor has none")
        return self._submit(ops.ReduceScatterOp(self._lane, self._call(
            Kind.REDUCE_SCATTER, name, buf, op=int(rop)), buf, rop))

    async def reduce_scatter(self, tensor: Any, op: ReduceOp | str = "sum", *,
                             name: str | None = None) -> Any:
        """This rank's slice of the reduction of every rank's `tensor`, split along
        dim 0 as Horovod splits it (the first ranks get one row more where it does not
        divide).

        Args:
            tensor: a torch tensor (CPU or CUDA) or a numpy array, of the same shape and dtype
                on every rank.
            op: the reduction: a `ReduceOp` member or its name ("sum", "average", "min",
                "max", "product"); the same on every rank.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            This rank's slice, a new tensor.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                `op` is unknown or Adasum, or `tensor` is 0-d; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
            ShutdownError: the coordinator was shut down.
        """
        return await self.reduce_scatter_async(tensor, op, name=name)

    def alltoall_async(self, tensor: Any, splits: list[int] | None = None, *,
                       name: str | None = None) -> Handle:
        """Start an alltoall.

        Args:
            tensor: the rows to send, along dim 0; the dtype and the other dims are the same
                on every rank.
            splits: rows of `tensor` for each rank, in rank order; they sum to dim 0 (None:
                equal parts, which must divide dim 0).
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives `(received rows, received splits)`.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `splits` does not divide dim 0 into one part per rank; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ.
            ShutdownError: the coordinator was shut down.
        """
        buf = self._buffer(Kind.ALLTOALL, tensor, name)
        split_list = self._splits(buf, splits, name)
        return self._submit(ops.AlltoallOp(self._lane, self._call(
            Kind.ALLTOALL, name, buf), buf, split_list))

    def _splits(self, buf: Buffer, splits: list[int] | None, name: str | None) -> list[int]:
        dim0, size = (buf.shape[0] if buf.shape else 1), self._lane.size
        if splits is None:
            splits = [dim0 // size] * size if dim0 % size == 0 else []
        if len(splits) != size or sum(splits) != dim0 or min(splits) < 0:
            self._announce_fault(Kind.ALLTOALL, name, InputFault.BAD_ARGUMENT)
            raise InputRejected(InputFault.BAD_ARGUMENT, f"splits {splits} do not divide "
                                f"dim 0 ({dim0}) into {size} parts")
        return [int(s) for s in splits]

    async def alltoall(self, tensor: Any, splits: list[int] | None = None, *,
                       name: str | None = None) -> tuple[Any, list[int]]:
        """Send `splits[r]` rows of `tensor` to rank r and receive each rank's rows for
        this one.

        Args:
            tensor: the rows to send, along dim 0; the dtype and the other dims are the same
                on every rank.
            splits: rows of `tensor` for each rank, in rank order; they sum to dim 0 (None:
                equal parts, which must divide dim 0).
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            `(received rows, concatenated in rank order; how many came from each rank)`.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: this rank's input cannot be communicated,
                or `splits` does not divide dim 0 into one part per rank; the
                other ranks raise RemoteInputError naming it.
            MismatchError: on every rank, where the ranks' calls differ.
            ShutdownError: the coordinator was shut down.
        """
        result: tuple[Any, list[int]] = await self.alltoall_async(tensor, splits, name=name)
        return result

    # -- barrier and objects ---------------------------------------------------
    def barrier_async(self, *, name: str | None = None) -> Handle:
        """Start a barrier; it also checks that every rank reached the same call.

        Args:
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it returns None once every rank arrived.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        return self._submit(ops.BarrierOp(self._lane, self._call(Kind.BARRIER, name)))

    async def barrier(self, *, name: str | None = None) -> None:
        """Wait until every rank arrives, without blocking the loop.

        Args:
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            MismatchError: on every rank, where a rank made another call at this point.
            ShutdownError: the coordinator was shut down.
        """
        result = self._now(self._small.barrier, self._barrier_general, name)
        if type(result) in _PENDING:
            await result

    def _barrier_general(self, name: str | None) -> Handle:
        return self.barrier_async(name=name)

    def broadcast_object_async(self, obj: Any, root: int = 0, *,
                               name: str | None = None) -> Handle:
        """Start broadcasting a picklable object from root.

        Args:
            obj: a picklable object; only root's is sent (the others' are ignored).
            root: the rank whose tensor is sent.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives root's object.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: `root` is not a rank, or root's `obj` cannot be pickled;
                the other ranks fail too.
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        self._check_root(Kind.BROADCAST_OBJECT, root, name)
        blob = (self._pickled(Kind.BROADCAST_OBJECT, obj, name, root=root)
                if self._lane.rank == root else b"")
        call = self._call(Kind.BROADCAST_OBJECT, name, root=root, nbytes=len(blob))
        return self._submit(ops.BroadcastObjectOp(self._lane, call, blob))

    async def broadcast_object(self, obj: Any, root: int = 0, *, name: str | None = None) -> Any:
        """Root's object on every rank.

        Args:
            obj: a picklable object; only root's is sent (the others' are ignored).
            root: the rank whose tensor is sent.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            Root's object, unpickled on every rank (root gets a copy too).

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: `root` is not a rank; the other ranks fail too.
            ShutdownError: the coordinator was shut down.
        """
        return await self.broadcast_object_async(obj, root, name=name)

    def allgather_object_async(self, obj: Any, *, name: str | None = None) -> Handle:
        """Start gathering one picklable object from every rank.

        Args:
            obj: this rank's picklable object.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A `Handle`; awaiting it gives the list of objects in rank order.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            InvalidInputError: `obj` cannot be pickled; the other ranks fail too.
            ShutdownError: the coordinator was shut down.
        """
        self._check_open()
        blob = self._pickled(Kind.ALLGATHER_OBJECT, obj, name)
        call = self._call(Kind.ALLGATHER_OBJECT, name, nbytes=len(blob))
        return self._submit(ops.AllgatherObjectOp(self._lane, call, blob))

    async def allgather_object(self, obj: Any, *, name: str | None = None) -> list[Any]:
        """Every rank's object, in rank order.

        Args:
            obj: this rank's picklable object.
            name: the call's name: ranks match calls by it (None: by the order of unnamed
                calls); a name that a call of this rank still holds is refused.

        Returns:
            A list with one unpickled object per rank.

        Raises:
            ValueError: `name` is held by a call of this rank still in flight.
            ShutdownError: the coordinator was shut down.
        """
        result: list[Any] = await self.allgather_object_async(obj, name=name)
        return result


__all__ = ["Collectives", "np"]


class LaneCollectives(Collectives):
    """Collectives on a subsystem's own channel (a process set, the gradient lane),
    sharing the coordinator's engine; `check_open` refuses calls after shutdown."""

    def __init__(self, engine: Engine, lane: Lane, check_open: Callable[[], None]) -> None:
        self._engine = engine
        self._lane = lane
        self._small = SmallCalls(engine, lane)
        self._check_open_of_owner = check_open

    def _check_open(self) -> None:
        self._check_open_of_owner()
