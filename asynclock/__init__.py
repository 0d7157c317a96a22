"""asynclock: an async (asyncio/trio) coordinator for data-parallel PyTorch on MPI and Horovod.

    async with asynclock.start() as coord:
        total = await coord.allreduce(tensor)

Importing asynclock initialises nothing: MPI starts at `init()`/`start()`.
"""

from __future__ import annotations

from .checkpoint import Checkpointer, CheckpointError, find_latest
from .data import ShardSampler
from .errors import (
    AsynclockError,
    BackendError,
    CollectiveTimeout,
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
from .handle import Handle
from .ops import Average, Max, Min, Product, ReduceOp, Sum
from .progress import EngineStatistics, ProgressPolicy
from .runtime import (
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
from .sync import Condition, ConsistencyPoint, Event, Lock, Semaphore, Sequential

__version__ = "0.1.0"

__all__ = [
    "AsynclockError", "Average", "BackendError", "CollectiveTimeout", "Coordinator",
    "EngineStatistics", "Handle", "InvalidInputError", "Max", "Min", "MismatchError",
    "NotInitializedError", "Product", "ProgressPolicy", "RankFailedError", "ReduceOp",
    "RemoteInputError", "ShutdownError", "StallError", "Sum", "UnmatchedError",
    "coordinator", "cross_rank", "cross_size", "init", "is_initialized", "local_rank",
    "local_size", "rank", "shutdown", "size", "start",
    # cross-rank primitives, checkpoints, data (issue 5)
    "CheckpointError", "Checkpointer", "Condition", "ConsistencyPoint", "Event", "JoinedError",
    "Lock",
    "Semaphore", "Sequential", "ShardSampler", "find_latest",
]
