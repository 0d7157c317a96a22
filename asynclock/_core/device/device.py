"""Lazy access to torch's CUDA runtime, and which GPU this rank uses.

Nothing here imports torch at module import: `import asynclock` must stay
torch-free, and a process that never imported torch has no CUDA work that
could need ordering. The helpers that only *order* existing work (`record`,
`stream_wait`) therefore look torch up in `sys.modules` and do nothing when
it is absent or CUDA was never initialised; only `set_device` and
`available` import torch, because the caller asked about GPUs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..base import settings

_LOCAL_RANK_ENV = ("ASYNCLOCK_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                   "PMI_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID",
                   "HOROVOD_LOCAL_RANK", "LOCAL_RANK")


def loaded_torch() -> Any:
    """torch if the program imported it, else None (never imports it)."""
    return sys.modules.get("torch")


def active_torch() -> Any:
    """torch when CUDA is initialised in this process, else None.

    `torch.cuda.is_initialized()` is cheap and never creates a context, so
    CPU-only programs on a GPU machine pay nothing and allocate nothing.
    """
    torch = loaded_torch()
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch


def require_torch(what: str) -> Any:
    """torch with a usable CUDA runtime, or a clear error naming `what`."""
    torch = active_torch() or _import_torch()
    if torch is None or not torch.cuda.is_available():
        raise RuntimeError(f"{what} needs CUDA, but "
                           + ("torch is not installed" if torch is None
                              else f"torch {torch.__version__} sees no CUDA device"))
    return torch


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        return None
    return torch


def available() -> bool:
    """True when torch is installed with CUDA and sees at least one GPU.

    Returns:
        Whether a CUDA device can be used (imports torch).
    """
    torch = _import_torch()
    return bool(torch is not None and torch.cuda.is_available())


def env_local_rank() -> int:
    """The node-local rank from the launcher's environment (0 when unknown)."""
    for name in _LOCAL_RANK_ENV:
        value = settings.text(name) if name.startswith("ASYNCLOCK_") else os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def set_device(local_rank: int | None = None) -> int | None:
    """Select GPU `local_rank % device_count` for the calling thread.

    One rank per GPU when there are enough GPUs; several ranks share a GPU
    otherwise (each gets its own context, streams and pinned buffers, which
    is all asynclock needs).

    CUDA's current device is per host thread: asynclock's own CUDA calls
    always name the tensor's device explicitly, so the engine's loop thread
    does not need this call.

    Args:
        local_rank: this rank's index on its node; None: the coordinator's local rank
            when asynclock is initialised, else the launcher's environment.

    Returns:
        The device index, or None on a machine without CUDA.
    """
    torch = _import_torch()
    if torch is None or not torch.cuda.is_available():
        return None
    rank = _local_rank() if local_rank is None else local_rank
    index: int = rank % int(torch.cuda.device_count())
    torch.cuda.set_device(index)
    return index


# The coordinator knows the local rank once it runs; the device layer lies below it, so
# the coordinator registers itself here (`use_local_rank`).
_LOCAL_RANK: list[Callable[[], int | None]] = []


def use_local_rank(source: Callable[[], int | None]) -> None:
    """`source()`: this rank's local rank, or None before the coordinator runs."""
    _LOCAL_RANK[:] = [source]


def _local_rank() -> int:
    known = _LOCAL_RANK[0]() if _LOCAL_RANK else None
    return env_local_rank() if known is None else known


@dataclass(frozen=True, slots=True)
class CopyStreams:
    """One device's staging streams.

    Two streams, not one: a device-to-host copy waits for its producer (the
    backward pass that is still computing the next bucket), and a
    host-to-device landing queued behind it would wait for that producer
    too, stalling every finished bucket behind an unfinished one.
    """

    d2h: Any
    h2d: Any


_STREAMS: dict[int, CopyStreams] = {}


def copy_streams(device: Any) -> CopyStreams:
    """The process's high-priority copy streams for `device` (made once)."""
    torch = require_torch("staging a CUDA tensor")
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    streams = _STREAMS.get(index)
    if streams is None:
        # -1: the highest priority CUDA offers (out-of-range values are clamped).
        streams = CopyStreams(torch.cuda.Stream(index, priority=-1),
                              torch.cuda.Stream(index, priority=-1))
        _STREAMS[index] = streams
    return streams


def blocking_event(torch: Any, stream: Any) -> Any:
    """A blocking-sync event recorded on `stream`, marked for `wait`'s thread hand-off."""
    event = torch.cuda.Event(blocking=True)
    event.asynclock_blocking = True
    event.record(stream)
    return event
