"""CUDA tensors over NCCL, through the channel's private process group.

Where every rank has a GPU of its own and torch has NCCL (`transports.process_group`,
`ASYNCLOCK_CUDA_PATH`), an allreduce or broadcast of a CUDA tensor keeps its data on
the GPU. Everything before the data stage is the host path's: the header round checks
and orders the call on every rank, so NCCL sees the calls in the same order everywhere,
errors and stall reports are the same, and a cancelled caller leaves the operation to
the engine. Only the data stage differs:

- it is issued behind the producer: the staging gate holds the operation until the
  tensor's ready event (recorded on the caller's stream when the call was made)
  completed, so NCCL never reads a tensor a kernel is still writing;
- it is NCCL's own collective on the device tensor, on NCCL's stream; its `Work` is
  polled with `Work.is_completed()`, which queries NCCL's end event (no host
  synchronize, no `Work.wait()` that blocks the loop);
- an average sums, then scales on the device, on the stream that waited for NCCL;
  consumers wait for the event recorded after it (`mark_done`), by stream.

`ASYNCLOCK_CUDA_PATH=gloo-twin` runs this same code on CPU tensors with a gloo
group: the CPU twin that CI runs where there is no GPU.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ..base.header import INLINE_BYTES
from ..base.ops import FLOAT_CODES, NUMPY_OF_CODE, ReduceOp
from ..base.tensors import Buffer
from ..device.events import record
from ..transports.process_group import PGGroup, PGRequest
from .collective_ops import AllreduceOp, BroadcastOp
from .operation import Lane, Operation, Stage


def group_of(lane: Lane) -> PGGroup | None:
    """The lane's process group for device data, if its channel has one."""
    return getattr(lane.transport, "device_group", None)


def pg_eligible(op: Operation, lane: Lane) -> bool:
    """Whether this operation's data goes through the lane's process group: an
    allreduce or broadcast larger than the header's inline payload (smaller ones ride
    in the header round), not an integer average (the host path divides as numpy)."""
    if group_of(lane) is None or type(op) not in (AllreduceOp, BroadcastOp):
        return False
    buf = op.buf  # type: ignore[attr-defined]
    torch = sys.modules.get("torch")
    if buf.array.nbytes <= INLINE_BYTES or torch is None \
            or not isinstance(_tensor(op), torch.Tensor):
        return False
    if type(op) is AllreduceOp:
        return op.op is not ReduceOp.AVERAGE or buf.code in FLOAT_CODES
    return True


def device_buffer(tensor: Any) -> Buffer:
    """A contiguous device tensor as a collective's buffer, for the process-group path
    only: its header words come from a zero-stride placeholder of the same dtype and
    size (no host memory); the data never leaves the device."""
    from ..base.tensors import _torch_code

    code = _torch_code(tensor.dtype)
    holder = np.lib.stride_tricks.as_strided(np.zeros(1, NUMPY_OF_CODE[code]),
                                             shape=(tensor.numel(),), strides=(0,))
    return Buffer(holder, code, tuple(tensor.shape), _DeviceWrap(tensor), tensor)


class _DeviceWrap:
    """A device buffer's wrap: the tensor itself is the result."""

    def __init__(self, tensor: Any) -> None:
        self.device_tensor = tensor

    def __call__(self, array: Any) -> Any:
        return self.device_tensor


def make_pg(op: Operation) -> None:
    """Turn a built host operation into its process-group twin."""
    op.__class__ = _TWINS[type(op)]


def _tensor(op: Any) -> Any:
    """The caller's tensor: the device tensor of a staged CUDA tensor, else the torch
    tensor itself (the CPU twin)."""
    wrap = op.buf.wrap
    device = getattr(wrap, "device_tensor", None)
    return device if device is not None else op.buf.source


def _land(op: Any, target: Any) -> Any:
    """The event consumers of a CUDA result wait for (by stream), recorded after the
    collective and the scaling; None for a CPU result, which is ready now."""
    event = record(target)
    mark = getattr(op.buf.wrap, "mark_done", None)
    if mark is not None:
        mark(event)
    return event


class PGAllreduceOp(AllreduceOp):
    """Allreduce of the caller's tensor on the channel's process group (a gradient
    bucket's too: its data stage is `data_stages`, which a checked bucket runs
    without a header round)."""

    def fill_inline(self, slot: Any) -> None:
        """Never inline: only payloads above INLINE_BYTES come here."""

    def data_stages(self) -> list[Stage]:
        tensor = _tensor(self)
        in_place = self.out is self.buf.array
        self.target = tensor if in_place else sys.modules["torch"].clone(tensor)
        self.stage_bytes = 0  # polled by the engine: nothing blocks a thread
        group = group_of(self.lane)
        assert group is not None
        return [lambda t: PGRequest(group.issue_allreduce(self.target, self.op))]

    def finish(self) -> Any:
        target = self.target
        if self.op is ReduceOp.AVERAGE:
            target.div_(self.lane.size)
        self.done_event = _land(self, target)
        return target


class PGBroadcastOp(BroadcastOp):
    """Broadcast of the caller's tensor, in place, on the channel's process group."""

    def fill_inline(self, slot: Any) -> None:
        """Never inline: only payloads above INLINE_BYTES come here."""

    def plan(self, rows: Any, payload: Any) -> list[Stage]:
        tensor = _tensor(self)
        in_place = self.out is self.buf.array
        self.target = tensor if in_place else sys.modules["torch"].clone(tensor)
        self.stage_bytes = 0
        group = group_of(self.lane)
        assert group is not None
        return [lambda t: PGRequest(group.issue_broadcast(self.target, self.root))]

    def finish(self) -> Any:
        self.done_event = _land(self, self.target)
        return self.target


_TWINS: dict[type, type] = {AllreduceOp: PGAllreduceOp, BroadcastOp: PGBroadcastOp}


def pg_class(cls: type) -> type:
    """`cls` (an allreduce, e.g. a gradient bucket's) with its data stage on the
    process group: cached per class."""
    twin = _TWINS.get(cls)
    if twin is None:
        assert issubclass(cls, AllreduceOp)
        twin = _TWINS[cls] = type(f"PG{cls.__name__}", (cls,), {
            "fill_inline": PGAllreduceOp.fill_inline, "data_stages": PGAllreduceOp.data_stages,
            "finish": PGAllreduceOp.finish})
    return twin


def make_pg_bucket(op: Operation) -> None:
    """A gradient bucket's allreduce, on the lane's process group."""
    op.__class__ = pg_class(type(op))
