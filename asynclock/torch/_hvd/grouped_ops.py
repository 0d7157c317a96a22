"""Horovod's grouped and remaining `*_async` collectives, on the same handles.

A Horovod script that calls `hvd.grouped_allgather`, `grouped_reducescatter`,
`grouped_allreduce_async_` or `reducescatter_async` must not stop at an
AttributeError. A group starts all its collectives in one hop to the loop
thread (a hop costs as much as a small collective), so they are in flight together, and its
handle's `synchronize` returns the list of results in order.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

from ..._core.engine.handle import Handle
from .._grad.compression import Compression
from .mpi_ops import (
    Post,
    _prepare,
    _reduce_op,
    _register,
    _same,
    _start_async,
    start_allreduce,
    start_alltoall,
    synchronize,
    then,
)
from .process_sets import api_of


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
    """Start an allreduce of a copy of each tensor; one handle for the group."""
    api = api_of(process_set)
    prepared = [_prepare(t, average, compression, op, prescale_factor, postscale_factor)
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
    """Allreduce each tensor (all in flight together)."""
    return _results(grouped_allreduce_async(tensors, average, name, compression, op,
                                            prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None,
                             name: str | None = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = None) -> int:
    """In place: `synchronize` writes each result into its tensor and returns them."""
    n = grouped_allreduce_async(tensors, average, name, Compression.none, op, prescale_factor,
                                postscale_factor, process_set)
    return then(n, lambda out: [t.copy_(r) for t, r in zip(tensors, out, strict=True)])


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None,
                       name: str | None = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0, process_set: Any = None) -> list[Any]:
    """In-place `grouped_allreduce`: write each reduction into its tensor (all in
    flight together) and return the tensors."""
    return _results(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                             postscale_factor, process_set))


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = None) -> int:
    """Start `grouped_allgather`; one handle for the group, whose `synchronize`
    returns each tensor concatenated over ranks along dim 0."""
    api = api_of(process_set)
    starts = [_gather_start(api, t.contiguous(), _part(name, n)) for n, t in enumerate(tensors)]
    return _start_group(starts, [_same] * len(tensors))


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = None) -> list[Any]:
    """Each tensor concatenated over ranks along dim 0 (all in flight together)."""
    return _results(grouped_allgather_async(tensors, name, process_set))


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, compression: Any = None,
                        op: Any = None, process_set: Any = None) -> int:
    """Start `reducescatter`; `synchronize` returns this rank's slice."""
    api, rop = api_of(process_set), _reduce_op(None, op)
    return _register(_start_async(_scatter_start(api, tensor.contiguous(), rop, name)), _same)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None,
                                compression: Any = None, op: Any = None,
                                process_set: Any = None) -> int:
    """Reduce each tensor (Average unless `op`), keep this rank's slice of dim 0."""
    api, rop = api_of(process_set), _reduce_op(None, op)
    starts = [_scatter_start(api, t.contiguous(), rop, _part(name, n))
              for n, t in enumerate(tensors)]
    return _start_group(starts, [_same] * len(tensors))


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None,
                          compression: Any = None, op: Any = None,
                          process_set: Any = None) -> list[Any]:
    return _results(grouped_reducescatter_async(tensors, name, compression, op, process_set))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = None) -> int:
    """Start an alltoall; as in Horovod, `synchronize` returns (output, received_splits)."""
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
