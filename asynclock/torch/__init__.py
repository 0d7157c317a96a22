"""`import asynclock.torch as hvd`: Horovod's PyTorch API on asynclock.

    hvd.init()
    model = ...; optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for x, y in loader:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

The async API for custom loops is `coord.train_step(optimizer)` (see
`asynclock.torch._grad.step`). Gradients travel in agreed, overlapped buckets
(see `asynclock.torch._grad.reducer`).

Reduction operators, as in Horovod (`op=`; the default is Average): `Sum`, `Average`,
`Min`, `Max`, `Product`, and `Adasum` (for `allreduce` and `DistributedOptimizer`:
Horovod's adaptive summation, computed from an allgather).
`global_process_set` is the process set of all ranks (id 0), the default `process_set=`.

`elastic` is Horovod's `hvd.elastic` namespace: `hvd.elastic.run`, `TorchState`,
`ObjectState`, `State`, `ElasticSampler` and `HostsUpdatedInterrupt`, for jobs under
`horovodrun --gloo --min-np N --max-np M` that lose and gain ranks without restarting.
"""

from __future__ import annotations

from typing import Any

from .._core.base.ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .._core.runtime import coordinator as runtime
from .._core.runtime.coordinator import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from ._grad.compression import Compression, Compressor
from ._grad.options import Tuning, training_policy
from ._grad.reducer import quiesce_all, stop_workers
from ._grad.step import TrainStep, TrainStepStatistics, train_step
from ._grad.tracing import trace_module
from ._hvd import elastic
from ._hvd.differentiable import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from ._hvd.mpi_ops import (
    HorovodInternalError,
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    ccl_built,
    ddl_built,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    start_timeline,
    stop_timeline,
    synchronize,
)
from ._hvd.optimizer import DistributedOptimizer
from ._hvd.params import (
    broadcast_optimizer_state,
    broadcast_optimizer_state_async,
    broadcast_parameters,
    broadcast_parameters_async,
)
from ._hvd.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    process_set_by_id,
    process_sets,
    remove_process_set,
    setup_at_init,
)
from ._hvd.sync_batch_norm import SyncBatchNorm


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Horovod's `hvd.init()`: start this rank's coordinator (idempotent), then make
    `process_sets` (a list of `ProcessSet`, or "dynamic" for `add_process_set` later,
    which asynclock always allows)."""
    runtime.init(comm=comm, policy=training_policy())
    setup_at_init(process_sets)


def shutdown() -> None:
    """Finish every optimizer's outstanding round, then shut the coordinator down."""
    if runtime.is_initialized():
        quiesce_all()
    runtime.shutdown()
    stop_workers()


def mpi_threads_supported() -> bool:
    """True when asynclock's MPI transport runs with MPI_THREAD_MULTIPLE, like Horovod's
    (False on the other transports)."""
    backend = runtime.coordinator().backend
    level = getattr(backend, "thread_level", None)
    return level is not None and level >= 3  # MPI_THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True when collectives run on asynclock's MPI transport (mpi4py), False on the
    Horovod or single-process ones."""
    return runtime.coordinator().backend.name == "mpi"


def mpi_built() -> bool:
    """True, as for a Horovod built with MPI: MPI (mpi4py) is asynclock's transport."""
    return True


def gloo_enabled() -> bool:
    """False: asynclock's own transport is MPI (also when its Horovod transport runs
    Horovod's Gloo controller)."""
    return False


def gloo_built() -> bool:
    """False, as for a Horovod built without Gloo: asynclock's own transport is MPI."""
    return False


def nccl_built() -> int:
    """0, as for a Horovod built without NCCL: asynclock does not use NCCL."""
    return 0


def cuda_built() -> bool:
    """False, as for a Horovod built without GPU ops; collectives take CUDA tensors all the
    same, staged through pinned host memory or handed to a CUDA-aware MPI (see
    `asynclock.cuda`)."""
    return False


def rocm_built() -> bool:
    """False, as for a Horovod built without ROCm ops."""
    return False


def is_homogeneous() -> bool:
    """True, without checking (Horovod reports whether every host runs as many ranks)."""
    return True


__all__ = [
    "Adasum", "Average", "Compression", "Compressor", "DistributedOptimizer", "Max", "Min",
    "ProcessSet", "Product", "ReduceOp", "Sum", "SyncBatchNorm", "add_process_set",
    "global_process_set",
    "process_set_by_id", "process_sets", "remove_process_set", "TrainStep",
    "TrainStepStatistics", "Tuning", "allgather",
    "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "alltoall_async", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "reducescatter_async", "HorovodInternalError", "ccl_built", "ddl_built",
    "sparse_allreduce_async", "start_timeline", "stop_timeline", "broadcast_optimizer_state",
    "broadcast_optimizer_state_async", "broadcast_parameters", "broadcast_parameters_async",
    "cross_rank", "cross_size", "cuda_built", "elastic", "gloo_built", "gloo_enabled",
    "grouped_allreduce",
    "init", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "quiesce_all", "reducescatter", "rocm_built", "shutdown", "size", "synchronize",
    "trace_module", "train_step", "training_policy",
]
