"""Ordering GPU work across streams with events: never a device-wide sync.

A gradient is produced on the compute stream (or a side stream of the
user's), copied or reduced on asynclock's streams, and consumed by the
optimizer and the next forward. Each hand-over is an event recorded on the
producing stream and waited for on the consuming one (`cudaStreamWaitEvent`,
which costs the CPU nothing), or awaited by a task (`asynclock.cuda.wait`).

Every helper is a no-op without CUDA work: `record` returns None when torch
was never imported or CUDA never initialised, and waiting on None returns.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from .device import active_torch, blocking_event


def record(where: Any = None) -> Any:
    """Record an event on a stream now.

    Events are made with `blocking=True` (cudaEventBlockingSync) so that a thread
    that synchronizes on one sleeps in the driver instead of spinning a core.

    Args:
        where: the stream: None for the current stream of the current device, a CUDA
            tensor for the current stream of its device, a `torch.cuda.Stream`, or a device.

    Returns:
        The event, or None when there is no CUDA work (torch not imported, CUDA
        not initialised, or a CPU tensor or device).
    """
    torch = active_torch()
    if torch is None:
        return None
    stream = resolve_stream(torch, where)
    if stream is None:
        return None
    return blocking_event(torch, stream)


def resolve_stream(torch: Any, where: Any) -> Any:
    """The stream `where` names (see `record`); None for CPU things."""
    if where is None:
        return torch.cuda.current_stream()
    if isinstance(where, torch.cuda.Stream):
        return where
    if isinstance(where, torch.Tensor):
        return torch.cuda.current_stream(where.device) if where.is_cuda else None
    device = torch.device(where)
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def stream_wait(consumer: Any = None, event: Any = None) -> None:
    """Make `consumer` wait for `event` on the GPU; the CPU does not wait.

    Args:
        consumer: the waiting stream, resolved like `record`'s `where`; None: the
            current stream of the event's device.
        event: the event to wait for; None (CPU work) is a no-op.

    Raises:
        RuntimeError: an event is given but CUDA is not initialised.
    """
    if event is None:
        return
    torch = active_torch()
    if torch is None:
        raise RuntimeError("stream_wait got an event but CUDA is not initialised")
    if consumer is None:
        consumer = getattr(event, "device", None)
    stream = resolve_stream(torch, consumer)
    if stream is not None:
        stream.wait_event(event)


class BucketSync:
    """One bucket's CUDA hand-overs: producer → communication → consumer.

    Per step, per bucket::

        sync.mark_ready()                  # in the gradient hook: the producer's stream
        with sync.comm():                  # on the loop: the collective stages after `ready`
            handle = grad.allreduce_async_(flat_bucket, "average")
        await handle
        sync.consume()                     # before the optimizer / next forward uses it

    `ready` is recorded in the autograd hook because autograd runs a hook
    with the gradient's producing stream as the current stream, so a user's
    own side stream is respected. The collective's device-to-host copy waits
    for `ready` on asynclock's copy stream, and its landing records `done`,
    which consumers wait for on their own streams. With no CUDA work every
    step is a no-op, so the same code runs on CPU.
    """

    __slots__ = ("ready", "done", "device")

    def __init__(self) -> None:
        self.ready: Any = None
        self.done: Any = None
        self.device: Any = None

    def mark_ready(self, where: Any = None) -> None:
        """Record `ready` on the producer's stream.

        Args:
            where: the stream: None for the current stream of the current device, a CUDA
                tensor for the current stream of its device, a `torch.cuda.Stream`, or a device.
        """
        self.ready = record(where)
        self.done = None
        if self.ready is not None:
            self.device = getattr(self.ready, "device", None)

    @contextmanager
    def comm(self) -> Iterator[BucketSync]:
        """Collectives started inside stage after `ready` and report `done` here.

        Yields:
            This `BucketSync`.
        """
        token = _BUCKET_SYNC.set(self)
        try:
            yield self
        finally:
            _BUCKET_SYNC.reset(token)

    def consume(self, where: Any = None) -> None:
        """Make the consumer's stream wait for `done`.

        It also retires `ready`, so a step that forgets `mark_ready` stages
        after the current stream instead of after last step's producer.

        Args:
            where: the consumer's stream, as `record`'s `where`; None: the current stream
                of the bucket's device.
        """
        self.ready = None
        stream_wait(self.device if where is None else where, self.done)

    async def wait_done(self) -> None:
        """Await `done` from a task, without blocking the loop."""
        from .waiting import wait

        await wait(self.done)

    def __repr__(self) -> str:
        return f"<BucketSync ready={self.ready is not None} done={self.done is not None}>"


_BUCKET_SYNC: ContextVar[BucketSync | None] = ContextVar("asynclock_bucket_sync", default=None)


def current_bucket_sync() -> BucketSync | None:
    """The BucketSync whose `comm()` block is active, if any."""
    return _BUCKET_SYNC.get()
