"""asynclock: an async (asyncio/trio) coordinator for data-parallel PyTorch on MPI and Horovod.

    async with asynclock.start() as coord:
        total = await coord.allreduce(tensor)

Importing asynclock initialises nothing: MPI starts at `init()`/`start()`.

Reduction operators (members of `ReduceOp`, for `op=`): `Sum`, `Average`, `Min`, `Max`,
`Product`.
"""

from __future__ import annotations

from typing import Any

from ._core.base.errors import (
    AsynclockError,
    BackendError,
    CollectiveTimeout,
    HostsUpdatedInterrupt,
    InvalidInputError,
    JoinedError,
    MismatchError,
    NotInitializedError,
    RankFailedError,
    RemoteInputError,
    ShutdownError,
    StallError,
    UnmatchedError,
)
from ._core.base.ops import Average, Max, Min, Product, ReduceOp, Sum
from ._core.base.version import __version__ as __version__
from ._core.engine import progress as _progress_module
from ._core.engine.handle import Handle
from ._core.engine.progress import EngineStatistics, ProgressPolicy
from ._core.runtime import coordinator as _coordinator_module
from ._core.runtime.coordinator import (
    Coordinator,
    coordinator,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start,
)
from ._core.runtime.elastic import ObjectState, State, run_elastic
from ._core.sync import Condition, ConsistencyPoint, Event, Lock, Semaphore, Sequential
from ._tools.checkpoint import Checkpointer, CheckpointError, find_latest
from ._tools.data import ShardSampler


def _train_step(coord: Coordinator, optimizer: Any, **options: Any) -> Any:
    from .torch._grad.step import train_step  # torch loads only when a step is asked for

    return train_step(coord, optimizer, **options)


def _timeline_on_start(engine: Any) -> None:
    from . import timeline

    timeline.attach(engine)


# The core calls up through these two registrations, never by importing the layers above.
_coordinator_module.use_train_step(_train_step)
_progress_module.on_engine_start(_timeline_on_start)


__all__ = [
    "AsynclockError", "Average", "BackendError", "CollectiveTimeout", "Coordinator",
    "EngineStatistics", "Handle", "InvalidInputError", "Max", "Min", "MismatchError",
    "NotInitializedError", "Product", "ProgressPolicy", "RankFailedError", "ReduceOp",
    "RemoteInputError", "ShutdownError", "StallError", "Sum", "UnmatchedError",
    "coordinator", "cross_rank", "cross_size", "init", "is_initialized", "local_rank",
    "local_size", "rank", "shutdown", "size", "start",
    # cross-rank primitives, checkpoints, data
    "CheckpointError", "Checkpointer", "Condition", "ConsistencyPoint", "Event", "JoinedError",
    "Lock",
    "Semaphore", "Sequential", "ShardSampler", "find_latest",
    # elastic jobs (horovodrun --min-np/--max-np)
    "HostsUpdatedInterrupt", "ObjectState", "State", "run_elastic",
]
