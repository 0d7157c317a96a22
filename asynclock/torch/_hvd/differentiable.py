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


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """`tensor * factor` in `tensor`'s dtype: integers are scaled in float64 and
    truncated back, half precision in float32, as Horovod's CPU ops do."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point():
        if tensor.dtype in (torch.float16, torch.bfloat16):
            return (tensor.float() * factor).to(tensor.dtype)
        return tensor * factor
    return (tensor.double() * factor).to(tensor.dtype)


# -- allreduce --------------------------------------------------------------------------
def _allreduce(tensor: torch.Tensor, average: bool | None, name: str | None, compression: Any,
               op: Any, prescale: float, postscale: float, process_set: Any) -> torch.Tensor:
    if tensor.is_floating_point():  # mpi_ops scales floats the same way
        return mpi_ops.allreduce(tensor, average, name, compression, op, prescale, postscale,
                                 process_set)
    out = mpi_ops.allreduce(scale(tensor, prescale), average, name, compression, op, 1.0, 1.0,
                            process_set)
    return scale(out, postscale)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: bool | None, name: str | None,
                compression: Any, op: Any, prescale: float, postscale: float,
                process_set: Any) -> torch.Tensor:
        ctx.args = (average, op, prescale, postscale, process_set)
        return _allreduce(tensor, average, name, compression, op, prescale, postscale,
                          process_set)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale, postscale, process_set = ctx.args
        out = _allreduce(grad.contiguous(), average, None, Compression.none, op, prescale,
                         postscale, process_set)
        return (out, *[None] * 7)


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """The reduction of `tensor` over all ranks (Average unless `op`), as a new tensor."""
    if _wants_grad(tensor):
        out: torch.Tensor = _apply(_Allreduce, tensor, average, name, compression, op,
                                             prescale_factor, postscale_factor, process_set)
        return out
    return _allreduce(tensor, average, name, compression, op, prescale_factor,
                      postscale_factor, process_set)


def _grouped_allreduce(tensors: list[torch.Tensor], average: bool | None, name: str | None,
                       compression: Any, op: Any, prescale: float, postscale: float,
                       process_set: Any) -> list[torch.Tensor]:
    if all(t.is_floating_point() for t in tensors):
        return mpi_ops.grouped_allreduce(tensors, average, name, compression, op, prescale,
                                         postscale, process_set)
    out = mpi_ops.grouped_allreduce([scale(t, prescale) for t in tensors], average, name,
                                    compression, op, 1.0, 1.0, process_set)
    return [scale(t, postscale) for t in out]


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, average: bool | None, name: str | None, compression: Any, op: Any,
                prescale: float, postscale: float, process_set: Any,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(_grouped_allreduce(list(tensors), average, name, compression, op,
                                        prescale, postscale, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        average, op, prescale, postscale, process_set = ctx.args
        out = _grouped_allreduce([g.contiguous() for g in grads], average, None,
                                 Compression.none, op, prescale, postscale, process_set)
        return (*[None] * 7, *out)


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None
                      ) -> list[torch.Tensor]:
    """Allreduce each tensor (all in flight together)."""
    if _wants_grad(*tensors):
        return list(_apply(_GroupedAllreduce, average, name, compression, op, prescale_factor,
                                            postscale_factor, process_set, *tensors))
    return _grouped_allreduce(list(tensors), average, name, compression, op, prescale_factor,
                              postscale_factor, process_set)


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
    """Every rank's tensor concatenated along dim 0 (dim 0 may differ per rank)."""
    if _wants_grad(tensor):
        return _apply(_Allgather, name, process_set, tensor)[0]
    return mpi_ops.allgather(tensor, name, process_set)


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[Any]:
    """Each tensor concatenated over ranks along dim 0 (all in flight together)."""
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
    """Root's tensor, as a new tensor on every rank."""
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
    """Send `splits[r]` rows to rank r; with `splits`, also return the received splits."""
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
    scaled = [scale(t, prescale) for t in tensors]
    if len(scaled) == 1:
        out = [mpi_ops.reducescatter(scaled[0], name, op=op, process_set=process_set)]
    else:
        out = mpi_ops.grouped_reducescatter(scaled, name, op=op, process_set=process_set)
    return [scale(t, postscale) for t in out]


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
    """This rank's slice (dim 0, first ranks larger) of the reduction."""
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
    """Reduce each tensor, keep this rank's slice of dim 0 (all in flight together)."""
    del compression
    _check_scatter_op(op)
    if _wants_grad(*tensors):
        return list(_apply(_Reducescatter, name, op, process_set, prescale_factor,
                                         postscale_factor, *tensors))
    return _reducescatter(list(tensors), name, op, process_set, prescale_factor,
                          postscale_factor)
