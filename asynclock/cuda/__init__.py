"""CUDA for asynclock: events per bucket, stream waits, awaitable GPU work.

    from asynclock import cuda

    cuda.set_device()                    # GPU local_rank % device_count (ranks may share one)
    ready = cuda.record()                # event on the current stream (None on CPU)
    await cuda.wait(ready)               # await it without blocking the loop
    cuda.stream_wait(consumer, ready)    # consumer stream waits on the GPU, CPU does not

    sync = cuda.BucketSync()             # per gradient bucket, see BucketSync
    cuda.describe()                      # how CUDA tensors travel (staged or device-direct)

Collectives accept CUDA tensors: they are staged through pinned host memory
on asynclock's copy streams after the producer's event, or handed to MPI
directly when it handles device memory (`engine.staging`,
`device.paths`). Importing this package never imports torch,
and without CUDA every helper is a no-op (None events, waits that return).
"""

from __future__ import annotations

from .._core.device.device import available, set_device
from .._core.device.events import BucketSync, record, stream_wait
from .._core.device.paths import CudaSupport, cuda_support, describe, horovod_gpu
from .._core.device.waiting import WaitPolicy, WaitStatistics, statistics, wait

__all__ = [
    "BucketSync", "CudaSupport", "WaitPolicy", "WaitStatistics", "available", "cuda_support",
    "describe", "horovod_gpu", "record", "set_device", "statistics", "stream_wait", "wait",
]
