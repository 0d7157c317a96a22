"""Horovod's tensor collectives, synchronous, on the coordinator's loop thread.

`allreduce_async` returns an integer handle as Horovod does; `poll(h)` and
`synchronize(h)` complete it. Each call hops to the private loop thread
(`coord.lowlevel.run_sync`) to start or await the checked collective, so the same
header checks, mismatch errors and progress engine serve both APIs. The
default reduce op is Average, as in Horovod.

As in Horovod's `horovod.torch.mpi_ops`, the grouped collectives, the remaining
`*_async` ones, sparse allreduce, the timeline switch, `HorovodInternalError` and
the build probes live here too: a Horovod script that touches any of them must not
stop at an AttributeError after its import line changed, and they share this
module's handle table.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Generator
from functools import partial
from typing import Any, TypeVar

import torch

from ... import timeline
from ..._core.base import adasum
from ..._core.base.errors import AsynclockError
from ..._core.base.ops import ReduceOp, as_reduce_op, is_adasum
from ..._core.base.tensors import InputRejected
from ..._core.engine.handle import Handle
from ..._core.runtime import coordinator as runtime
from .._grad.compression import Compression
from .process_sets import api_of, root_of

Post = Callable[[Any], Any]
T = TypeVar("T")
_handles: dict[int, tuple[Any, Post]] = {}  # a Handle, or a GroupHandle
_ids = itertools.count(1)
_lock = threading.Lock()


def _reduce_op(average: bool | None, op: Any) -> ReduceOp:
    if op is not None and average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    if op is None:
        return ReduceOp.SUM if average is False else ReduceOp.AVERAGE
    return as_reduce_op(op)


def _start(fn: Callable[[], T]) -> T:
    """Start a collective on the loop thread (engine state is loop-only)."""
    async def go() -> T:
        return fn()

    return runtime.coordinator().lowlevel.run_sync(go)


def _start_async(fn: Callable[[], T]) -> T:
    """`_start` for an `*_async` call: its collective starts once the caller has
    the handle, so `poll()` right after it may say False, as on Horovod."""
    return runtime.coordinator().lowlevel.run_sync_then_start(fn)


def _register(handle: Any, post: Post) -> int:
    with _lock:
        n = next(_ids)
        _handles[n] = (handle, post)
    return n


def poll(handle: int) -> bool:
    """Whether `synchronize(handle)` would return without waiting; never waits.

    Args:
        handle: what an `*_async` call returned.

    Returns:
        True once the collective completed on this rank.

    Raises:
        ValueError: `handle` is unknown, or was synchronized already (Horovod's error).
    """
    with _lock:
        entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    done: bool = entry[0].done()
    return done


def synchronize(handle: int) -> Any:
    """Wait for an `*_async` collective and return its output.

    Args:
        handle: what an `*_async` call returned.

    Returns:
        What the collective's synchronous form returns; None for a handle that is
        unknown or was synchronized already, as Horovod returns.

    Raises:
        AsynclockError: the collective's own error (MismatchError, RankFailedError, ...).
    """
    with _lock:
        entry = _handles.pop(handle, None)
    if entry is None:
        return None
    h, post = entry

    async def wait() -> Any:
        return await h

    return post(runtime.coordinator().lowlevel.run_sync(wait))


# -- allreduce --------------------------------------------------------------------------
def _prepare(tensor: torch.Tensor, average: bool | None, compression: Any, op: Any,
             prescale_factor: float, postscale_factor: float, api: Any
             ) -> tuple[torch.Tensor, Any, Post]:
    """Compress and prescale a copy of `tensor`; `post` undoes both on the result."""
    rop = ReduceOp.ADASUM if _is_adasum(op, average) else _reduce_op(average, op)
    work, ctx = compression.compress(tensor)
    work = scale(work, prescale_factor)
    rop, factor = integer_average(rop, postscale_factor, work, api.group_size)

    def post(out: torch.Tensor) -> torch.Tensor:
        return scale(compression.decompress(out, ctx), factor)

    return work.contiguous(), rop, post


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


def integer_average(rop: Any, postscale: float, tensor: torch.Tensor, size: int
                    ) -> tuple[Any, float]:
    """The op and the factor after it: an integer average with a postscale is a sum
    scaled once by postscale / size, as Horovod scales it (averaging first would
    truncate twice)."""
    if rop is ReduceOp.AVERAGE and postscale != 1.0 and not tensor.is_floating_point():
        return ReduceOp.SUM, postscale / size
    return rop, postscale


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    compression: Any = Compression.none, op: Any = None,
                    prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = None) -> int:
    """Start an averaged (default) or summed allreduce of a copy of `tensor`.

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
        A handle for `poll` and `synchronize`; `synchronize` returns the result
        as a new tensor.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    api = api_of(process_set)
    work, rop, post = _prepare(tensor, average, compression, op, prescale_factor,
                               postscale_factor, api)
    start, finish = start_allreduce(api, work, rop, name)
    return _register(_start_async(start), lambda out: post(finish(out)))


def start_allreduce(api: Any, work: torch.Tensor, rop: Any, name: str | None
                    ) -> tuple[Callable[[], Handle], Post]:
    """How to start the allreduce on the loop, and what to do with its result there after.

    Adasum is no MPI op: its handle is an allgather of every rank's tensor, and the
    caller's thread folds the rows (`base.adasum`), identically on every rank."""
    if rop is not ReduceOp.ADASUM:
        return (lambda: api.allreduce_async(work, rop, name=name)), _same
    adasum.check_size(api.group_size)
    rows = work.reshape(1, *work.shape)
    return (lambda: api.allgather_async(rows, name=name)), (
        lambda gathered: adasum.reduce_gathered(gathered, work))


def _is_adasum(op: Any, average: bool | None) -> bool:
    """`op=Adasum` alone: with `average` too, `_reduce_op` refuses the pair."""
    return is_adasum(op) and average is None


def _same(x: Any) -> Any:
    return x


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: Any = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: Any = None) -> torch.Tensor:
    """The reduction of `tensor` over all ranks, as a new tensor.

    One hop to the loop thread that starts and awaits together (a metric or a
    loss then takes the small-message path), instead of `allreduce_async` plus
    `synchronize`: each hop to the loop thread costs as much as a small collective.

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
        The reduction, a new tensor of `tensor`'s shape and dtype.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    if _is_adasum(op, average):
        result: torch.Tensor = synchronize(allreduce_async(
            tensor, average, name, compression, op, prescale_factor, postscale_factor,
            process_set))
        return result
    api = api_of(process_set)
    work, rop, post = _prepare(tensor, average, compression, op, prescale_factor,
                               postscale_factor, api)
    out: torch.Tensor = post(runtime.coordinator().lowlevel.run_sync(
        lambda: api.allreduce(work, rop, name=name)))
    return out


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = None) -> int:
    """Start an in-place allreduce: `synchronize` writes the result into
    `tensor` and returns it.

    Args:
        tensor: the input, overwritten with the result.
        average: Horovod's older switch: True averages, False sums; None leaves it to `op`.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        op: the reduction: Average (None: the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A handle for `poll` and `synchronize`.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    n = allreduce_async(tensor, average, name, Compression.none, op, prescale_factor,
                        postscale_factor, process_set)
    return then(n, partial(_write, tensor))


def _write(tensor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """An in-place collective's result into `tensor`, outside autograd (as Horovod's
    C++ writes it), so a parameter that requires grad takes it too."""
    with torch.no_grad():
        return tensor.copy_(out)


def then(n: int, step: Post) -> int:
    """Handle `n`, with `step` applied to what its `synchronize` returned so far."""
    handle, post = _handles[n]
    _handles[n] = (handle, lambda out: step(post(out)))
    return n


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = None) -> torch.Tensor:
    """In-place `allreduce`: write the reduction over all ranks into `tensor`
    and return it.

    Args:
        tensor: the input, overwritten with the result.
        average: Horovod's older switch: True averages, False sums; None leaves it to `op`.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        op: the reduction: Average (None: the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        `tensor`, holding the reduction.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    return _write(tensor, allreduce(tensor, average, name, Compression.none, op,
                                    prescale_factor, postscale_factor, process_set))


# -- allgather, broadcast, alltoall, reducescatter -----------------------------------------
def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> int:
    """Start `allgather`.

    Args:
        tensor: the input; dim 0 may differ by rank, the other dims and the dtype may not.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A handle; `synchronize` returns every rank's tensor concatenated along dim 0.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    api = api_of(process_set)
    return _register(_start_async(lambda: api.allgather_async(tensor.contiguous(), name=name)),
                     lambda out: out)


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = None) -> Any:
    """Every rank's tensor concatenated along dim 0, in rank order.

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
    return synchronize(allgather_async(tensor, name, process_set))


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = None) -> int:
    """Start `broadcast`.

    Args:
        tensor: the input, a CPU or CUDA tensor of the same shape and dtype on every rank.
        root_rank: the world rank whose tensor is sent (a member of `process_set`).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A handle; `synchronize` returns root's tensor as a new tensor.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    api, root = api_of(process_set), root_of(process_set, root_rank)
    start = _start_async(lambda: api.broadcast_async(tensor.contiguous(), root, name=name))
    return _register(start, lambda out: out)


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = None) -> Any:
    """Root's tensor, as a new tensor on every rank.

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
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = None) -> int:
    """Start `broadcast_`.

    Args:
        tensor: the input, overwritten with the result.
        root_rank: the world rank whose tensor is sent (a member of `process_set`).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A handle; `synchronize` overwrites `tensor` with root's and returns it.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    api, root = api_of(process_set), root_of(process_set, root_rank)
    return _register(_start_async(lambda: api.broadcast_async_(tensor, root, name=name)),
                     lambda out: tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = None) -> Any:
    """Overwrite `tensor` with root's, in place.

    Args:
        tensor: the input, overwritten with the result.
        root_rank: the world rank whose tensor is sent (a member of `process_set`).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        `tensor`, holding root's values.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = None) -> Any:
    """Send `splits[r]` rows of `tensor` to rank r, and receive each rank's rows for this one.

    Args:
        tensor: the rows to send, split along dim 0; the dtype and the other dims are
            the same on every rank.
        splits: how many rows go to each rank, in rank order (integers; None: equal
            parts of dim 0).
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
    api = api_of(process_set)
    out, received = _wait(start_alltoall(
        _start, lambda split_list: api.alltoall_async(tensor.contiguous(), split_list,
                                                      name=name), splits))
    return out if splits is None else (out, torch.tensor(received, dtype=torch.int32))


def start_alltoall(start: Callable[[Callable[[], T]], T], issue: Callable[[Any], T],
                   splits: Any) -> T:
    """`start(issue(split list))`. Splits must be integers, as Horovod's int32 tensor:
    a floating-point tensor is refused by its dtype, not by whatever values it holds
    (`torch.empty` leaves them to chance). It is refused through the collective's
    own bad-argument check, so a rank with valid splits fails too instead of waiting."""
    if not (isinstance(splits, torch.Tensor) and (splits.is_floating_point()
                                                  or splits.is_complex())):
        split_list = None if splits is None else [int(s) for s in splits]
        return start(lambda: issue(split_list))
    try:
        return start(lambda: issue([-1]))  # refused: no count may be negative
    except InputRejected as exc:
        raise InputRejected(exc.fault, "alltoall splits must hold integers (Horovod: "
                            f"int32), not {splits.dtype}") from None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                  op: Any = ReduceOp.AVERAGE, process_set: Any = None) -> Any:
    """This rank's slice of the reduction over ranks, split along dim 0 (the first
    ranks get one row more where it does not divide).

    Args:
        tensor: the input; the same shape and dtype on every rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: accepted for Horovod's signature; reducescatter compresses nothing.
        op: the reduction: Average (None: the default), Sum, Min, Max or Product.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        This rank's slice, a new tensor.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated, or op is Adasum; the other
            ranks fail too.
    """
    api = api_of(process_set)
    return _wait(_start(lambda: api.reduce_scatter_async(tensor.contiguous(), _reduce_op(
        None, op), name=name)))


def _wait(handle: Handle) -> Any:
    async def wait() -> Any:
        return await handle

    return runtime.coordinator().lowlevel.run_sync(wait)


# -- objects and coordination ------------------------------------------------------------
def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Root's picklable object on every rank.

    Args:
        obj: the object (rank `root_rank`'s is sent; the others' are ignored).
        root_rank: the world rank whose tensor is sent (a member of `process_set`).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        Root's object, unpickled on every rank (root gets a copy too).

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
    """
    api, root = api_of(process_set), root_of(process_set, root_rank)
    return runtime.coordinator().lowlevel.run_sync(
        lambda: api.broadcast_object(obj, root, name=name))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Every rank's picklable object, in rank order.

    Args:
        obj: this rank's object.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A list with one object per rank of the set.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
    """
    api = api_of(process_set)
    return runtime.coordinator().lowlevel.run_sync(lambda: api.allgather_object(obj, name=name))


def barrier(process_set: Any = None) -> None:
    """Return once every rank of `process_set` called `barrier`.

    Args:
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Raises:
        ValueError: `process_set` is not added.
    """
    api = api_of(process_set)
    runtime.coordinator().lowlevel.run_sync(api.barrier)


def join(device: int = -1) -> int:
    """Horovod's join: this rank has no more data.

    Until every rank joined, it stands in for the others' allreduces (zeros; an
    average still divides by `size()`) and barriers, gradient buckets included
    (shared-memory rounds fall back to MPI allreduces meanwhile); broadcast,
    allgather and alltoall raise `JoinedError` on every rank meanwhile.

    Args:
        device: accepted for Horovod's signature; unused.

    Returns:
        The rank that joined last.
    """
    coord = runtime.coordinator()
    return int(coord.lowlevel.run_sync(coord.join))


# -- grouped collectives and the remaining `*_async` ones ---------------------------------
# A group starts all its collectives in one hop to the loop thread (a hop costs as much
# as a small collective), so they are in flight together, and its handle's `synchronize`
# returns the list of results in order.
class GroupHandle:
    """Several collectives as one handle: done when all are; results in order."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def __await__(self) -> Generator[Any, None, list[Any]]:
        results = []
        for h in self.handles:
            results.append((yield from h.__await__()))
        return results


def _start_group(starts: list[Callable[[], Handle]], posts: list[Post]) -> int:
    """All starts in one hop; the handle's `synchronize` applies each post in order."""
    group = _start_async(lambda: GroupHandle([start() for start in starts]))

    def post(results: list[Any]) -> list[Any]:
        return [p(r) for p, r in zip(posts, results, strict=True)]

    return _register(group, post)


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None,
                            name: str | None = None, compression: Any = Compression.none,
                            op: Any = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: Any = None) -> int:
    """Start an allreduce of a copy of each tensor, all in flight together.

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
        One handle for the group; `synchronize` returns the results in order.
        With `name`, part n is named `name.n`.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    api = api_of(process_set)
    prepared = [_prepare(t, average, compression, op, prescale_factor, postscale_factor, api)
                for t in tensors]
    pairs = [start_allreduce(api, work, rop, _part(name, n))
             for n, (work, rop, _) in enumerate(prepared)]
    return _start_group([start for start, _ in pairs],
                        [_then(finish, post) for (_, finish), (_, _, post) in
                         zip(pairs, prepared, strict=True)])


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None,
                      name: str | None = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = None) -> list[Any]:
    """Allreduce each tensor, all in flight together.

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
        The reductions, new tensors in the order of `tensors`.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    return _results(grouped_allreduce_async(tensors, average, name, compression, op,
                                            prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> int:
    """Start an in-place allreduce of each tensor: `synchronize` writes each
    result into its tensor and returns them.

    Args:
        tensors: the inputs, each overwritten with its result.
        average: Horovod's older switch: True averages, False sums; None leaves it to `op`.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        op: the reduction: Average (None: the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        One handle for the group.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    n = grouped_allreduce_async(tensors, average, name, Compression.none, op, prescale_factor,
                                postscale_factor, process_set)
    return then(n, lambda out: [_write(t, r) for t, r in zip(tensors, out, strict=True)])


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None) -> list[Any]:
    """In-place `grouped_allreduce`: write each reduction into its tensor (all
    in flight together).

    Args:
        tensors: the inputs, each overwritten with its result.
        average: Horovod's older switch: True averages, False sums; None leaves it to `op`.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        op: the reduction: Average (None: the default), Sum, Min, Max, Product or Adasum.
        prescale_factor: multiplies the input before the reduction.
        postscale_factor: multiplies the result.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        `tensors`, holding the reductions.

    Raises:
        ValueError: both `average` and `op` are given, the name is in use, or
            `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    return _results(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                             postscale_factor, process_set))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> int:
    """Start `grouped_allgather`.

    Args:
        tensors: the inputs; for each, dim 0 may differ by rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        One handle for the group; `synchronize` returns each tensor concatenated
        over ranks along dim 0.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, root).
        InvalidInputError: the tensor cannot be communicated; the other ranks fail too.
    """
    api = api_of(process_set)
    starts = [_gather_start(api, t.contiguous(), _part(name, n)) for n, t in enumerate(tensors)]
    return _start_group(starts, [_same] * len(tensors))


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[Any]:
    """Each tensor concatenated over ranks along dim 0 (all in flight together).

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
    return _results(grouped_allgather_async(tensors, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                        op: Any = None, process_set: Any = None) -> int:
    """Start `reducescatter`.

    Args:
        tensor: the input; the same shape and dtype on every rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: accepted for Horovod's signature; reducescatter compresses nothing.
        op: the reduction: Average (None: the default), Sum, Min, Max or Product.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A handle; `synchronize` returns this rank's slice.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated, or op is Adasum; the other
            ranks fail too.
    """
    api, rop = api_of(process_set), _reduce_op(None, op)
    return _register(_start_async(_scatter_start(api, tensor.contiguous(), rop, name)), _same)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                compression: Any = None, op: Any = None,
                                process_set: Any = None) -> int:
    """Start a reducescatter of each tensor, all in flight together.

    Args:
        tensors: the inputs; each the same shape and dtype on every rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: accepted for Horovod's signature; reducescatter compresses nothing.
        op: the reduction: Average (None: the default), Sum, Min, Max or Product.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        One handle for the group; `synchronize` returns this rank's slices in
        order.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated, or op is Adasum; the other
            ranks fail too.
    """
    api, rop = api_of(process_set), _reduce_op(None, op)
    starts = [_scatter_start(api, t.contiguous(), rop, _part(name, n))
              for n, t in enumerate(tensors)]
    return _start_group(starts, [_same] * len(tensors))


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: Any = None, op: Any = None,
                          process_set: Any = None) -> list[Any]:
    """Reduce each tensor over ranks and keep this rank's slice of dim 0 (all
    in flight together).

    Args:
        tensors: the inputs; each the same shape and dtype on every rank.
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        compression: accepted for Horovod's signature; reducescatter compresses nothing.
        op: the reduction: Average (None: the default), Sum, Min, Max or Product.
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        This rank's slices, in the order of `tensors`.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        MismatchError: on every rank, where the ranks' calls differ (shape, dtype, op).
        InvalidInputError: the tensor cannot be communicated, or op is Adasum; the other
            ranks fail too.
    """
    return _results(grouped_reducescatter_async(tensors, name, compression, op, process_set))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = None) -> int:
    """Start an alltoall.

    Args:
        tensor: the rows to send, split along dim 0; the dtype and the other dims are
            the same on every rank.
        splits: how many rows go to each rank, in rank order (integers; None: equal
            parts of dim 0).
        name: the collective's name; ranks match calls by it, and a name a call of this
            rank still holds is refused (None: matched by issue order).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A handle; as in Horovod, `synchronize` returns (output, received splits).

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
        InvalidInputError: `splits` holds non-integers, negative counts or does not sum
            to dim 0; the other ranks fail too.
    """
    api = api_of(process_set)

    def post(result: Any) -> Any:
        out, received = result
        return out, torch.tensor(received, dtype=torch.int32)

    start = start_alltoall(_start_async, lambda split_list: api.alltoall_async(
        tensor.contiguous(), split_list, name=name), splits)
    return _register(start, post)


def _results(handle: int) -> list[Any]:
    out: list[Any] = synchronize(handle)
    return out


def _part(name: str | None, n: int) -> str | None:
    return f"{name}.{n}" if name else None


def _then(first: Post, second: Post) -> Post:
    return lambda x: second(first(x))


def _gather_start(api: Any, t: torch.Tensor, name: str | None) -> Callable[[], Handle]:
    return lambda: api.allgather_async(t, name=name)


def _scatter_start(api: Any, t: torch.Tensor, rop: Any,
                   name: str | None) -> Callable[[], Handle]:
    return lambda: api.reduce_scatter_async(t, rop, name=name)


# -- the last Horovod 0.28 names: errors, the timeline, sparse allreduce, build probes ---
# What Horovod raises when a collective fails; asynclock's errors all derive from this.
HorovodInternalError = AsynclockError

_timeline_out: list[str] = []  # where stop_timeline() writes the merged trace


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's: record a timeline from now on (every rank calls it).

    Args:
        file_path: where rank 0 writes the merged Chrome trace; each rank writes its
            own events to `file_path.events` meanwhile.
        mark_cycles: accepted for Horovod's signature; asynclock has no cycles to mark.
    """
    coord = runtime.coordinator()
    timeline.start(f"{file_path}.events", rank=coord.rank, size=coord.size)
    _timeline_out[:] = [file_path]

    async def attach() -> None:
        timeline.attach(coord.lowlevel.engine)  # engine state is the loop's

    coord.lowlevel.run_sync(attach)


def stop_timeline() -> None:
    """Stop recording on every rank (collective: a barrier); rank 0 writes the trace."""
    coord = runtime.coordinator()
    out = _timeline_out[0] if _timeline_out else None

    async def finish() -> None:
        coord.lowlevel.engine.on_event = None
        await timeline.finish(coord, out=out)

    coord.lowlevel.run_sync(finish)
    _timeline_out.clear()


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: Any = None) -> Callable[[], torch.Tensor]:
    """Horovod's sparse allreduce: every rank's (index, value) pairs gathered, summed
    where indices repeat (`coalesce`), divided by the size for Average. As in
    Horovod, the handle is a function: call it for the result.

    Args:
        tensor: a sparse COO tensor of the same dense shape on every rank.
        name: the collective's name (its two allgathers are `name.indices` and
            `name.values`); None: matched by issue order.
        op: Average or Sum (Average divides the sum by the set's size).
        process_set: the ranks that take part: an added `ProcessSet` (None: all ranks).

    Returns:
        A function of no arguments that waits and returns the sparse sum.

    Raises:
        ValueError: the name is in use, or `process_set` is not added.
    """
    sparse = tensor.coalesce()
    api = api_of(process_set)
    indices, values = sparse.indices().t().contiguous(), sparse.values().contiguous()
    group = _start_async(lambda: GroupHandle([
        api.allgather_async(indices, name=f"{name}.indices" if name else None),
        api.allgather_async(values, name=f"{name}.values" if name else None)]))
    average = _reduce_op(None, op) is ReduceOp.AVERAGE

    def post(parts: list[Any]) -> torch.Tensor:
        every_index, every_value = parts
        if average:
            every_value = every_value / api.group_size
        return torch.sparse_coo_tensor(every_index.t(), every_value, sparse.shape).coalesce()

    handle = _register(group, post)
    return lambda: synchronize(handle)


def ccl_built() -> bool:
    """False: asynclock has no oneCCL support (Horovod's `hvd.ccl_built()`).

    Returns:
        False.
    """
    return False


def ddl_built() -> bool:
    """False: asynclock has no IBM DDL support (Horovod's `hvd.ddl_built()`).

    Returns:
        False.
    """
    return False
