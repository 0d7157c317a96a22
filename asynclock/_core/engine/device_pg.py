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

from ..base.header import INLINE_BYTES
from ..base.ops import FLOAT_CODES, ReduceOp
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


def make_pg(op: Operation) -> None:
    """Turn a built host operation into its process-group twin."""
    op.__class__ = _TWINS[type(op)]


def _tensor(op: Any) -> Any:
    """The caller's tensor: the device tensor of a staged CUDA tensor, else the torch
    tensor itself (the CPU twin)."""
    wrap = op.buf.wrap
    device = getattr(wrap, "device_tensor", None)
    return device if device is not None else op.buf.source


def _land(op: Any, target: Any) -> None:
    """Consumers of a CUDA result wait for this event (by stream); a CPU result is
    ready now."""
    mark = getattr(op.buf.wrap, "mark_done", None)
    if mark is not None:
        mark(record(target))


class PGAllreduceOp(AllreduceOp):
    """Allreduce of the caller's tensor on the channel's process group."""

    def fill_inline(self, slot: Any) -> None:
        """Never inline: only payloads above INLINE_BYTES come here."""

    def plan(self, rows: Any, payload: Any) -> list[Stage]:
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
        _land(self, target)
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
        _land(self, self.target)
        return self.target


_TWINS: dict[type, type] = {AllreduceOp: PGAllreduceOp, BroadcastOp: PGBroadcastOp}
