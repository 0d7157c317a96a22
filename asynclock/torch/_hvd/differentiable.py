"""Horovod's synchronous tensor collectives, differentiable, as `hvd.allreduce` & co.

A tensor that requires grad goes through an autograd function whose backward is
the collective Horovod defines as its gradient (Horovod's tests check exactly
those values):

* allreduce: the same allreduce (op, scale factors, process set) of the gradient;
* allgather: the gradient averaged over ranks, then this rank's rows;
* broadcast: the gradient averaged over ranks on root, zeros elsewhere;
* alltoall: the gradient sent back with the received splits;
* reducescatter: the gradient scaled (by the set's size for Sum, and by both
  factors), then allgathered.

Everything else (no grad wanted, or grad mode off) calls `mpi_ops` directly, so
a metric or a loss pays no autograd bookkeeping. An integer tensor scaled by a
float factor stays integer, as in Horovod: the product is taken in float64 and
cast back.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._core.base.ops import ReduceOp, as_reduce_op, is_adasum
from ..._core.runtime import coordinator as runtime
from .._grad.compression import Compression
from . import mpi_ops


def _apply(fn: type[torch.autograd.Function], *args: Any) -> Any:
    return fn.apply(*args)  # type: ignore[no-untyped-call]


def _wants_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _place(process_set: Any) -> tuple[int, int]:
    """(this rank within the set, the set's size); the world for the global set."""
    subset = getattr(process_set, "subset", None)
    if process_set is None or getattr(process_set, "process_set_id", 0) == 0 or subset is None:
        return runtime.rank(), runtime.size()
    return int(subset.rank), int(subset.size)


# -- allreduce --------------------------------------------------------------------------
class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: bool | None, name: str | None,
                compression: Any, op: Any, prescale: float, postscale: float,
                process_set: Any) -> torch.Tensor:
        ctx.args = (average, op, prescale, postscale, process_set)
        return mpi_ops.allreduce(tensor, average, name, compression, op, prescale, postscale,
                                 process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale, postscale, process_set = ctx.args
        out = mpi_ops.allreduce(grad.contiguous(), average, None, Compression.none, op,
                                prescale, postscale, process_set)
        return (out, *[None] * 7)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """The reduction of `tensor` over all ranks (Average unless `op`), as a new tensor.

    Differentiable: where `tensor` requires grad, the backward pass is the same allreduce of the
    gradient.

    Args:
        tensor: the input, a CPU or CUDA tensor of the same shape and dtype on every rank.
        average: Horovod's older switch: True averages, False sums; None leaves it to `op`.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: a `Compressor`, applied before the reduction and undone after
            (`Compression.fp16` halves the bytes sent).
        op: the reduction: Average (None: the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A new tensor of `tensor`'s shape and dtype.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    if _wants_grad(tensor):
        out: torch.Tensor = _apply(_Allreduce, tensor, average, name, compression, op,
                                             prescale_factor, postscale_factor, process_set)
        return out
    return mpi_ops.allreduce(tensor, average, name, compression, op, prescale_factor,
                             postscale_factor, process_set)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, average: bool | None, name: str | None, compression: Any, op: Any,
                prescale: float, postscale: float, process_set: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(mpi_ops.grouped_allreduce(list(tensors), average, name, compression, op,
                                               prescale, postscale, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale, postscale, process_set = ctx.args
        out = mpi_ops.grouped_allreduce([g.contiguous() for g in grads], average, None,
                                        Compression.none, op, prescale, postscale, process_set)
        return (*[None] * 7, *out)


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None
                      ) -> list[torch.Tensor]:
    """Allreduce each tensor (all in flight together).

    Differentiable: where a tensor requires grad, the backward pass is the same grouped
    allreduce of the gradients.

    Args:
        tensors: the inputs; each as `tensor` of the single form, in the same order on every rank.
        average: Horovod's older switch: True averages, False sums; None leaves it to `op`.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: a `Compressor`, applied before the reduction and undone after
            (`Compression.fp16` halves the bytes sent).
        op: the reduction: Average (None: the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        New tensors, in the order of `tensors`; with `name`, part n is named
        `name.n`.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    if _wants_grad(*tensors):
        return list(_apply(_GroupedAllreduce, average, name, compression, op, prescale_factor,
                                            postscale_factor, process_set, *tensors))
    return mpi_ops.grouped_allreduce(list(tensors), average, name, compression, op,
                                     prescale_factor, postscale_factor, process_set)


# -- allgather --------------------------------------------------------------------------
def _my_rows(grads: list[torch.Tensor], rows: list[int], process_set: Any
             ) -> list[torch.Tensor]:
    """This rank's rows of each averaged gradient: every rank's row counts are gathered
    (dim 0 may differ per rank) to find where this rank's start."""
    averaged = mpi_ops.grouped_allreduce([g.contiguous() for g in grads],
                                         op=ReduceOp.AVERAGE, process_set=process_set)
    me, size = _place(process_set)
    counts = mpi_ops.grouped_allgather([torch.tensor([n], dtype=torch.int64)
                                        for n in rows], process_set=process_set)
    out = []
    for g, n, every in zip(averaged, rows, counts, strict=True):
        start = int(every.view(size)[:me].sum().item())
        out.append(g.narrow(0, start, n))
    return out


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        if len(tensors) == 1:
            return (mpi_ops.allgather(tensors[0], name, process_set),)
        return tuple(mpi_ops.grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        return (None, None, *_my_rows(list(grads), ctx.rows, ctx.process_set))


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> Any:
    """Every rank's tensor concatenated along dim 0, in rank order.

    Differentiable: where `tensor` requires grad, the backward pass is the gradient averaged
    over ranks, then this rank's rows.

    Args:
        tensor: the input; dim 0 may differ by rank, the other dims and the dtype may not.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A new tensor; its dim 0 is the sum of the ranks' dims 0.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    if _wants_grad(tensor):
        return _apply(_Allgather, name, process_set, tensor)[0]
    return mpi_ops.allgather(tensor, name, process_set)


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[Any]:
    """Each tensor concatenated over ranks along dim 0 (all in flight together).

    Differentiable: where a tensor requires grad, the backward pass is the gradients averaged over
    ranks, then this rank's rows.

    Args:
        tensors: the inputs; for each, dim 0 may differ by rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        New tensors, in the order of `tensors`.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    if _wants_grad(*tensors):
        return list(_apply(_Allgather, name, process_set, *tensors))
    return mpi_ops.grouped_allgather(tensors, name, process_set)


# -- broadcast --------------------------------------------------------------------------
class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: Any) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        out: torch.Tensor = mpi_ops.broadcast(tensor, root_rank, name, process_set)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        averaged = mpi_ops.allreduce(grad.contiguous(), op=ReduceOp.AVERAGE,
                                     process_set=ctx.process_set)
        if runtime.rank() != ctx.root_rank:  # root_rank is a world rank, as in Horovod
            averaged = torch.zeros_like(averaged)
        return averaged, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> Any:
    """Root's tensor, as a new tensor on every rank.

    Differentiable: where `tensor` requires grad, the backward pass is the gradient averaged
    over ranks on root, zeros elsewhere.

    Args:
        tensor: the input, a CPU or CUDA tensor of the same shape and dtype on every rank.
        root_rank: the world rank whose tensor is sent (a member of `process_set`).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A copy of root's tensor.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    if _wants_grad(tensor):
        return _apply(_Broadcast, tensor, root_rank, name, process_set)
    return mpi_ops.broadcast(tensor, root_rank, name, process_set)


# -- alltoall ---------------------------------------------------------------------------
class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None,
                process_set: Any) -> Any:
        given = _as_splits(splits, tensor, process_set)
        if given is None:  # uneven: mpi_ops refuses it, on every rank alike
            return mpi_ops.alltoall(tensor, None, name, process_set)
        out, received = mpi_ops.alltoall(tensor, given, name, process_set)
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_unused: Any) -> tuple[Any, ...]:
        back, _ = mpi_ops.alltoall(grad.contiguous(), ctx.received, process_set=ctx.process_set)
        return back, None, None, None


def _as_splits(splits: Any, tensor: torch.Tensor, process_set: Any) -> Any:
    """Explicit splits, so the received ones come back for the backward pass (None
    means equal parts, which Horovod requires to divide dim 0 evenly)."""
    if splits is not None:
        return splits
    _, size = _place(process_set)
    if tensor.dim() == 0 or tensor.shape[0] % size:
        return None
    return [tensor.shape[0] // size] * size


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = None) -> Any:
    """Send `splits[r]` rows of `tensor` to rank r, and receive each rank's rows for
    this one.

    Differentiable: where `tensor` requires grad, the backward pass is the gradient sent back
    with the received splits.

    Args:
        tensor: the rows to send, split along dim 0; the dtype and the other dims are
            the same on every rank.
        splits: how many rows go to each rank, in rank order (integers; None: equal
            parts, which must divide dim 0).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        The received rows, concatenated in rank order; with `splits` given, the
        pair (rows, received splits as an int32 tensor).

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        InvalidInputError: `splits` holds non-integers, negative counts or does not sum
            to dim 0; the other ranks fail too.
        MismatchError: on every rank, where the ranks' calls differ.
    """
    if _wants_grad(tensor):
        return _apply(_Alltoall, tensor, splits, name, process_set)
    return mpi_ops.alltoall(tensor, splits, name, process_set)


# -- reducescatter ----------------------------------------------------------------------
def _check_scatter_op(op: Any) -> None:
    if is_adasum(op):
        raise RuntimeError("reducescatter does not support Adasum (as in Horovod)")


def _scatter_grads(grads: tuple[torch.Tensor, ...], op: Any, prescale: float,
                   postscale: float, process_set: Any) -> list[torch.Tensor]:
    _, size = _place(process_set)
    factor = (size if as_reduce_op(op) == ReduceOp.SUM else 1) * prescale * postscale
    scaled = [g * factor if factor != 1 else g.contiguous() for g in grads]
    return mpi_ops.grouped_allgather(scaled, process_set=process_set)


def _reducescatter(tensors: list[torch.Tensor], name: str | None, op: Any, process_set: Any,
                   prescale: float, postscale: float) -> list[torch.Tensor]:
    scaled = [mpi_ops.scale(t, prescale) for t in tensors]
    rop = as_reduce_op(op) if op is not None else ReduceOp.AVERAGE
    rop, factor = mpi_ops.integer_average(rop, postscale, scaled[0], _place(process_set)[1])
    if len(scaled) == 1:
        out = [mpi_ops.reducescatter(scaled[0], name, op=rop, process_set=process_set)]
    else:
        out = mpi_ops.grouped_reducescatter(scaled, name, op=rop, process_set=process_set)
    return [mpi_ops.scale(t, factor) for t in out]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: Any, process_set: Any, prescale: float,
                postscale: float, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (op, prescale, postscale, process_set)
        return tuple(_reducescatter(list(tensors), name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        op, prescale, postscale, process_set = ctx.args
        return (*[None] * 5, *_scatter_grads(grads, op, prescale, postscale, process_set))


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                  op: Any = ReduceOp.AVERAGE, process_set: Any = None,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> Any:
    """This rank's slice of the reduction over ranks, split along dim 0 (the first
    ranks get one row more where it does not divide).

    Differentiable: where `tensor` requires grad, the backward pass is the gradient scaled (by
    the set's size for Sum, and by both factors), then allgathered.

    Args:
        tensor: the input; the same shape and dtype on every rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: accepted for Horovod's signature; reducescatter compresses nothing.
        op: the reduction: Average (the default), Sum, Min, Max or Product.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.

    Returns:
        This rank's slice, a new tensor.

    Raises:
        RuntimeError: `op` is Adasum, as in Horovod.
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated, or op is Adasum; the other
            ranks fail too.
    """
    del compression  # reduced as given, as Horovod's CPU path does
    _check_scatter_op(op)
    if _wants_grad(tensor):
        return _apply(_Reducescatter, name, op, process_set, prescale_factor, postscale_factor,
                                    tensor)[0]
    return _reducescatter([tensor], name, op, process_set, prescale_factor,
                          postscale_factor)[0]


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: Any = None, op: Any = ReduceOp.AVERAGE,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reduce each tensor over ranks and keep this rank's slice of dim 0 (all in
    flight together).

    Differentiable: where a tensor requires grad, the backward pass is as `reducescatter`'s,
    for each.

    Args:
        tensors: the inputs; each the same shape and dtype on every rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: accepted for Horovod's signature; reducescatter compresses nothing.
        op: the reduction: Average (the default), Sum, Min, Max or Product.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.

    Returns:
        This rank's slices, in the order of `tensors`.

    Raises:
        RuntimeError: `op` is Adasum, as in Horovod.
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated, or op is Adasum; the other
            ranks fail too.
    """
    del compression
    _check_scatter_op(op)
    if _wants_grad(*tensors):
        return list(_apply(_Reducescatter, name, op, process_set, prescale_factor,
                                         postscale_factor, *tensors))
    return _reducescatter(list(tensors), name, op, process_set, prescale_factor,
                          postscale_factor)
