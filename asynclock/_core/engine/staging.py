"""Host staging of CUDA tensors for the collectives, in caller order.

A CUDA tensor handed to a collective is viewed through a pinned host buffer:

1. at the call, `stage_tensor` allocates the pinned buffer (torch's caching
   host allocator: reused across steps, and never handed out again while a
   copy that uses it is pending) and takes the producer's event: the
   `BucketSync.ready` of an active `comm()` block, else an event recorded
   now on the current stream of the tensor's device;
2. `submit` queues the device-to-host copy on the device's d2h copy stream
   behind that event (a stream wait, never a device synchronize) and records
   `copied`; the operation is held in this lane's gate until `copied` has
   completed, then submitted to the engine like any host collective;
3. when the collective finishes, the result lands back with a
   host-to-device copy on the h2d stream, which records `done`; the current
   stream of the loop thread waits for `done`, and so does any consumer that
   calls `BucketSync.consume()`.

Why a gate: an operation's header (with up to 128 B of payload inline) must
be issued in the caller's order on every rank, and it cannot be issued
before the data reached the host. So once a staged operation waits for its
copy, every later operation on the same lane waits behind it and all are
released in order as copies complete. The gate is polled by the engine's
poller (`Engine.track`), so it inherits its backoff, keeps `drain()` honest
and shows up by name in stall reports. Cancelling a task that awaits a held
operation only detaches it, as for any operation: it is still submitted.

With a CUDA-aware MPI that handles non-blocking collectives on device memory
(see `device.paths`), eligible allreduces skip the copies: the
gate waits for the producer's event and the device buffer goes to MPI.

Every submission on a lane must come through `submit` (the collective API
does); an `engine.submit` that bypasses it could overtake a held operation.
Code that builds its own operations (e.g. gradient buckets) stages with
`as_buffer(t, writable=True, stage=True)` inside `BucketSync.comm()` and
submits with `staging.submit(engine, lane, op)`.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..base import tensors
from ..base.tensors import Buffer, InputFault, InputRejected, as_buffer
from ..device.device import copy_streams
from ..device.events import BucketSync, current_bucket_sync, record
from .device_pg import make_pg, pg_eligible
from .operation import Lane, Operation
from .progress import Engine

Array = Any  # numpy arrays; kept loose because results may be views of pinned memory


class Staged:
    """A CUDA tensor's pinned host copy: how it goes out and how results land.

    It doubles as the Buffer's `wrap`: out-of-place results (new host
    arrays) are wrapped as new device tensors.
    """

    __slots__ = ("device_tensor", "host", "host_wrap", "ready", "bucket_sync", "copied", "done")

    def __init__(self, device_tensor: Any, host: Any, host_wrap: Callable[[Array], Any],
                 ready: Any, bucket_sync: BucketSync | None) -> None:
        self.device_tensor = device_tensor
        self.host = host
        self.host_wrap = host_wrap
        self.ready = ready
        self.bucket_sync = bucket_sync
        self.copied: Any = None
        self.done: Any = None
        _USED[0] = True  # from now on `submit` looks at every operation

    # -- out -----------------------------------------------------------------
    def copy_out(self) -> Any:
        """Queue device→host behind the producer's event; return `copied`."""
        torch = _torch()
        streams = copy_streams(self.device_tensor.device)
        if self.ready is not None:
            streams.d2h.wait_event(self.ready)
        with torch.cuda.stream(streams.d2h):  # detach: a Parameter may be broadcast too
            self.host.copy_(self.device_tensor.detach(), non_blocking=True)
        self.device_tensor.record_stream(streams.d2h)  # no reuse before the copy ran
        self.copied = record(streams.d2h)
        return self.copied

    # -- back ----------------------------------------------------------------
    def __call__(self, arr: Array) -> Any:
        """Wrap an out-of-place host result as a new tensor on our device."""
        torch = _torch()
        host_result = self.host_wrap(arr)
        pinned = torch.empty(host_result.shape, dtype=host_result.dtype, pin_memory=True)
        pinned.copy_(host_result)
        streams = copy_streams(self.device_tensor.device)
        with torch.cuda.stream(streams.h2d):  # owned by h2d: nothing else can still use it
            out = torch.empty(host_result.shape, dtype=host_result.dtype,
                              device=self.device_tensor.device)
        out.record_stream(torch.cuda.current_stream(out.device))
        self._land(out, pinned)
        return out

    def landed(self, value: Any) -> Any:
        """In-place results: copy the host buffer back into the caller's tensor."""
        if value is self.device_tensor:
            self._land(self.device_tensor, self.host)
        return value

    def _land(self, dst: Any, src: Any) -> None:
        torch = _torch()
        h2d = copy_streams(dst.device).h2d
        with torch.cuda.stream(h2d):
            dst.detach().copy_(src, non_blocking=True)
        dst.record_stream(h2d)
        self.mark_done(record(h2d))
        torch.cuda.current_stream(dst.device).wait_event(self.done)

    def mark_done(self, done: Any) -> None:
        """Publish the event consumers wait for (also to the active BucketSync)."""
        self.done = done
        if self.bucket_sync is not None:
            self.bucket_sync.done = done
            self.bucket_sync.device = self.device_tensor.device


def _torch() -> Any:
    return sys.modules["torch"]


def stage_tensor(t: Any) -> Buffer:
    """View CUDA tensor `t` through a pinned host buffer that `submit` fills.

    Called by `tensors.as_buffer(..., stage=True)` after the dtype check.
    Anything that makes staging impossible becomes an `InputRejected`, so
    the collective still joins the header round and every rank gets an error.
    """
    if not t.is_contiguous():
        raise InputRejected(InputFault.NON_CONTIGUOUS, f"{t.device} tensor of shape "
                            f"{tuple(t.shape)} (call .contiguous() first)")
    try:
        host = _torch().empty(t.shape, dtype=t.dtype, pin_memory=True)
        sync = current_bucket_sync()
        ready = sync.ready if sync is not None and sync.ready is not None else record(t)
    except Exception as exc:  # no CUDA runtime, pinned memory exhausted, ...
        raise InputRejected(InputFault.WRONG_DEVICE,
                            f"cannot stage {t.device} tensor through pinned host memory: "
                            f"{type(exc).__name__}: {exc}") from exc
    buf = as_buffer(host)
    staged = Staged(t, host, buf.wrap, ready, sync)
    buf.source, buf.wrap = t, staged
    return buf


def staged_of(op: Operation) -> Staged | None:
    """The staging record of an operation on a CUDA tensor, if it has one."""
    wrap = getattr(getattr(op, "buf", None), "wrap", None)
    return wrap if isinstance(wrap, Staged) else None


# -- ordered submission ---------------------------------------------------------
tensors.use_stager(stage_tensor)

_GATES: dict[Lane, LaneGate] = {}
_USED = [False]  # set by the first Staged of this process, or by the CPU twin
_TWIN = [False]  # ASYNCLOCK_CUDA_PATH=gloo-twin: CPU tensors take the NCCL path's code


def cpu_twin() -> bool:
    """Whether CPU tensors take the process-group path (`use_cpu_twin`)."""
    return _TWIN[0]


def use_cpu_twin() -> None:
    """CPU tensors of the user's calls take the process-group path (gloo), as CUDA
    tensors take it over NCCL: the tests' stand-in for a GPU."""
    _TWIN[0] = _USED[0] = True
_HOLD: list[Any] = [None]  # inside `holding(event)`: that event


def submit(engine: Engine, lane: Lane, op: Operation) -> Operation:
    """Submit `op` in caller order; CUDA operations wait for their copies first."""
    if not _GATES and not _USED[0] and _HOLD[0] is None:
        return engine.submit(op)  # a process that never staged: three global lookups
    staged = staged_of(op)
    if staged is None and _TWIN[0] and pg_eligible(op, lane):
        make_pg(op)  # the NCCL path's CPU twin: a CPU tensor through the gloo group
    hold = _HOLD[0]
    if staged is None and hold is None and lane not in _GATES:
        return engine.submit(op)
    event = _launch_or_announce(engine, staged, op, lane) if staged is not None else None
    if hold is not None:
        event = hold if event is None else _Both(event, hold)
    return submit_after(engine, lane, op, event)


class Flag:
    """An event (`query()`) that one thread sets and the loop reads."""

    __slots__ = ("is_set",)

    def __init__(self) -> None:
        self.is_set = False

    def set(self) -> None:
        self.is_set = True

    def query(self) -> bool:
        return self.is_set


class _Both:
    """Completed once both events have."""

    __slots__ = ("first", "second")

    def __init__(self, first: Any, second: Any) -> None:
        self.first, self.second = first, second

    def query(self) -> bool:
        return bool(self.first.query() and self.second.query())


@contextmanager
def holding(event: Any) -> Iterator[None]:
    """Operations submitted inside are held in their lane's gate, in caller
    order, until `event` completed: an `hvd.*_async` call hands back its handle
    before its collective starts, as Horovod's do (they start a cycle later)."""
    _HOLD[0] = event
    try:
        yield
    finally:
        _HOLD[0] = None


def release_ready(engine: Engine) -> None:
    """Submit now what `engine`'s gates may release, instead of at the poller's
    next test (loop thread)."""
    for gate in [g for g in _GATES.values() if g.engine is engine]:
        gate.Test()


def held_lanes() -> dict[Lane, LaneGate]:
    """The lanes whose operations wait for CUDA copies (later ones queue behind);
    the live mapping, so a fast path can test `lane in held` without a call."""
    return _GATES


def submit_after(engine: Engine, lane: Lane, op: Operation, event: Any) -> Operation:
    """Submit `op` once `event` (anything with `query()`, or None) completed.

    Caller order on `lane` is kept: while anything is held, later
    submissions queue behind it, whatever their own event.
    """
    gate = _GATES.get(lane)
    if gate is None:
        if event is None or event.query():
            return engine.submit(op)
        gate = _GATES[lane] = LaneGate(engine, lane)
        gate.add(op, event)
        engine.track(gate, f"cuda staging gate on {lane.transport.name}")
        return op
    gate.add(op, event)
    return op


def _launch_or_announce(engine: Engine, staged: Staged, op: Operation, lane: Lane) -> Any:
    """Start the copies; if CUDA refuses, the header round still happens.

    `op` already holds its sequence number, so the other ranks expect it:
    a header carrying our fault takes its place, and they fail too.
    """
    try:
        return _launch(staged, op, lane)
    except Exception as exc:
        fault = InputFault.WRONG_DEVICE
        submit_after(engine, lane, Operation(lane, op.call._replace(fault=int(fault))), None)
        raise InputRejected(fault, f"staging {staged.device_tensor.device} tensor failed: "
                            f"{type(exc).__name__}: {exc}") from exc


def _launch(staged: Staged, op: Operation, lane: Lane) -> Any:
    """Pick the path for one CUDA operation; return the event that gates it."""
    from .direct import direct_eligible, make_direct

    if pg_eligible(op, lane):
        make_pg(op)
        return staged.ready
    if direct_eligible(op, lane):
        make_direct(op)
        return staged.ready
    op.__class__ = _landing_class(type(op))
    return staged.copy_out()


_LANDING: dict[type, type] = {}


def _landing_class(cls: type) -> type:
    """`cls` whose result lands back on the device (cached per class).

    The operation was built by the collective API; swapping in a subclass
    that only adds the landing keeps every other behaviour identical. An
    in-place result lands when `finish()` returns `buf.source` (the
    convention of `collective_ops`); an operation class of another module
    that wants the landing follows the same convention.
    """
    landing = _LANDING.get(cls)
    if landing is None:
        def finish(self: Any) -> Any:
            staged = self.buf.wrap
            return staged.landed(cls.finish(self))  # type: ignore[attr-defined]

        landing = type(f"Staged{cls.__name__}", (cls,), {"finish": finish})
        _LANDING[cls] = landing
    return landing


class LaneGate:
    """Holds a lane's submissions back, in caller order, behind unfinished copies.

    It is also the request the engine tracks: `Test()` releases every
    operation at the head whose event completed, and reports done (and
    retires the gate) once nothing is held.
    """

    def __init__(self, engine: Engine, lane: Lane) -> None:
        self.engine = engine
        self.lane = lane
        self.pending: deque[tuple[Operation, Any]] = deque()
        self.released = 0

    def add(self, op: Operation, event: Any) -> None:
        self.pending.append((op, event))

    def release(self) -> bool:
        """Submit each head whose event completed; True when nothing is held.

        Without a spin: nobody waits inside this call, and the poller tests
        the released operations at its own cadence."""
        pending = self.pending
        engine = self.engine
        while pending:
            op, event = pending[0]
            if event is not None and not event.query():
                return False
            pending.popleft()
            self.released += 1
            engine.no_spin = True
            try:
                engine.submit(op)
            finally:
                engine.no_spin = False
        return True

    def Test(self) -> bool:  # noqa: N802 - the request protocol's spelling
        if not self.release():
            return False
        if _GATES.get(self.lane) is self:
            del _GATES[self.lane]
        return True

    def Wait(self) -> None:  # noqa: N802
        raise RuntimeError("a staging gate is polled on the loop, never waited for in a thread")

    def __repr__(self) -> str:
        return f"<LaneGate {self.lane.transport.name}: {len(self.pending)} held>"


def held(lane: Lane) -> int:
    """How many operations wait in `lane`'s gate (0 when it has none)."""
    gate = _GATES.get(lane)
    return len(gate.pending) if gate is not None else 0
