"""The last Horovod 0.28 names a script may touch: the timeline switch, sparse
allreduce, `HorovodInternalError` and the build probes.

A Horovod script that calls `hvd.start_timeline(path)` or catches
`hvd.HorovodInternalError` must not stop at an AttributeError after the import
line changed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ... import timeline
from ..._core.base.errors import AsynclockError
from ..._core.base.ops import ReduceOp
from ..._core.runtime import coordinator as runtime
from .grouped_ops import GroupHandle
from .mpi_ops import _reduce_op, _register, _start_async, synchronize
from .process_sets import api_of

# What Horovod raises when a collective fails; asynclock's errors all derive from this.
HorovodInternalError = AsynclockError

_timeline_out: list[str] = []  # where stop_timeline() writes the merged trace


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's: record from now on (every rank calls it). Each rank writes its own
    events next to `file_path`; `stop_timeline()` merges them into `file_path` on rank 0.
    asynclock has no cycles to mark: `mark_cycles` is accepted and ignored."""
    coord = runtime.coordinator()
    timeline.start(f"{file_path}.events", rank=coord.rank, size=coord.size)
    _timeline_out[:] = [file_path]

    async def attach() -> None:
        timeline.attach(coord.engine)  # engine state is the loop's

    coord.run_sync(attach)


def stop_timeline() -> None:
    """Stop recording on every rank (collective: a barrier); rank 0 writes the trace."""
    coord = runtime.coordinator()
    out = _timeline_out[0] if _timeline_out else None

    async def finish() -> None:
        coord.engine.on_event = None
        await timeline.finish(coord, out=out)

    coord.run_sync(finish)
    _timeline_out.clear()


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None, op: Any,
                           process_set: Any = None) -> Callable[[], torch.Tensor]:
    """Horovod's sparse allreduce: every rank's (index, value) pairs gathered, summed
    where indices repeat (`coalesce`), divided by the size for Average. As in
    Horovod, the handle is a function: call it for the result."""
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
    """False: asynclock has no oneCCL support (Horovod's `hvd.ccl_built()`)."""
    return False


def ddl_built() -> bool:
    """False: asynclock has no IBM DDL support (Horovod's `hvd.ddl_built()`)."""
    return False
