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

import functools
import importlib.util
import os
import subprocess
import sys
from typing import Any, cast

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
from .._core.transports.process_group import backend_usable
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
    the process sets.

    Args:
        comm: an mpi4py communicator to run on (None: the whole MPI world).
        process_sets: a list of `ProcessSet`s to add now, or "dynamic" (sets added
            later with `add_process_set`, which asynclock always allows); None: none.

    Raises:
        ValueError: an ASYNCLOCK_* value is invalid.
        MismatchError: on every rank, where settings that must agree differ.
        InvalidInputError: a process set is empty or names a rank outside the world.
    """
    runtime.init(comm=comm, policy=training_policy())
    setup_at_init(process_sets)


def shutdown() -> None:
    """Finish every optimizer's outstanding round, then shut the coordinator down.

    Idempotent; `hvd.init()` may start a new coordinator after it.
    """
    if runtime.is_initialized():
        quiesce_all()
    runtime.shutdown()
    stop_workers()


def _backend() -> Any:
    """The running coordinator's backend, or None before `init()` and after `shutdown()`."""
    return runtime.coordinator().backend if runtime.is_initialized() else None


def _controller() -> str | None:
    """How this job's collectives move: "mpi" (asynclock's MPI transport, or Horovod's
    MPI controller under it), "gloo" (Horovod's Gloo controller), or None (not
    initialized, or one process without either)."""
    backend = _backend()
    if backend is None:
        return None
    if backend.name == "horovod":
        return str(backend.controller)
    return "mpi" if backend.name == "mpi" else None


def mpi_threads_supported() -> bool:
    """Whether MPI runs with MPI_THREAD_MULTIPLE, as Horovod's.

    Returns:
        True where the MPI library granted MPI_THREAD_MULTIPLE.

    Raises:
        ValueError: MPI is not enabled (before `init()`, under `horovodrun --gloo`),
            as Horovod raises.
    """
    if _controller() != "mpi":
        raise ValueError("Horovod MPI is not enabled; Please make sure it's installed and "
                         "enabled.")
    level = getattr(_backend(), "thread_level", None)
    return level is not None and level >= 3  # MPI_THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """True once `init()` made this job's collectives run over MPI: asynclock's MPI
    transport, or Horovod's MPI controller under its Horovod transport.

    Returns:
        Whether collectives run over MPI (False before `init()`).
    """
    return _controller() == "mpi"


def mpi_built() -> bool:
    """True when this job can run on MPI: mpi4py, asynclock's MPI binding, is installed
    (as Horovod's says whether it was built with MPI, whatever the job runs on).

    Returns:
        Whether mpi4py is installed.
    """
    return importlib.util.find_spec("mpi4py") is not None


def gloo_enabled() -> bool:
    """True once `init()` made this job run on Horovod's Gloo controller (`horovodrun
    --gloo`, where asynclock's data stages go through Horovod).

    Returns:
        Whether the job runs on Horovod's Gloo controller (False before `init()`).
    """
    return _controller() == "gloo"


def gloo_built() -> bool:
    """True when this job can run on Gloo: asynclock runs there through a Horovod built
    with Gloo, so this is that Horovod's own `gloo_built()` (False without Horovod).

    Returns:
        The installed Horovod's `gloo_built()`; False without Horovod.
    """
    return _horovod_built("gloo_built")


@functools.cache
def _horovod_built(query: str) -> bool:
    """Ask the installed Horovod what it was built with: the loaded one if this process
    runs on it, else a subprocess (importing Horovod here would load its MPI library
    into a job that runs on another)."""
    loaded = sys.modules.get("horovod.torch")
    if loaded is not None:
        return bool(getattr(loaded, query)())
    if importlib.util.find_spec("horovod") is None:
        return False
    code = f"import horovod.torch as h; print('BUILT', int(h.{query}()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "BUILT 1" in out.stdout


def nccl_built() -> int:
    """NCCL's version code, as Horovod's (2.9 on: 2xxyy), where this job moves CUDA
    tensors over NCCL: asynclock's MPI transport with every rank holding torch's NCCL
    and a GPU of its own, agreed at `init()` (`asynclock.cuda.describe()` says which
    path and why); else 0: host staging, a CUDA-aware MPI, or Horovod's transport,
    whose data stages hand Horovod host buffers. Before `init()`: whether this rank
    could, as far as it alone knows.

    Returns:
        NCCL's version code, or 0.
    """
    if runtime.is_initialized():
        path = getattr(_backend(), "device_path", None)
        usable = path is not None and path.path == "nccl"
    else:
        wanted = os.environ.get("ASYNCLOCK_CUDA_PATH", "").strip() or "auto"
        usable = wanted in ("auto", "nccl") and backend_usable("nccl")
    return _nccl_version() if usable else 0


def _nccl_version() -> int:
    """torch's NCCL as NCCL_VERSION_CODE (`NCCL_VERSION(X, Y, Z)` in nccl.h)."""
    import torch

    major, minor, patch = (int(v) for v in cast(Any, torch.cuda).nccl.version()[:3])
    if (major, minor) >= (2, 9):
        return major * 10000 + minor * 100 + patch
    return major * 1000 + minor * 100 + patch


def cuda_built() -> bool:
    """True when torch here is built with CUDA: collectives then take CUDA tensors,
    staged through pinned host memory or handed to a CUDA-aware MPI (see
    `asynclock.cuda`), as a Horovod built with CUDA takes them.

    Returns:
        Whether torch has CUDA.
    """
    import torch

    return torch.version.cuda is not None


def rocm_built() -> bool:
    """False: asynclock has not been run on ROCm builds of torch.

    Returns:
        False.
    """
    return False


def is_homogeneous() -> bool:
    """True, without checking (Horovod reports whether every host runs as many ranks).

    Returns:
        True.
    """
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
