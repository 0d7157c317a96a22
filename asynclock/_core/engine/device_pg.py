"""CUDA tensors over NCCL, through the channel's private process group.

Where every rank has a GPU of its own and torch has NCCL (`transports.process_group`,
`ASYNCLOCK_CUDA_PATH`), an allreduce, broadcast, allgather, reduce-scatter or alltoall
of a CUDA tensor keeps its data on the GPU. Everything before the data stage is the
host path's: the header round checks and orders the call on every rank, so NCCL sees
the calls in the same order everywhere, errors and stall reports are the same, and a
cancelled caller leaves the operation to the engine. Only the data stage differs:

- it is issued behind the producer: the staging gate holds the operation until the
  tensor's ready event (recorded on the caller's stream when the call was made)
  completed, so NCCL never reads a tensor a kernel is still writing;
- it is NCCL's own collective on the device tensor, on NCCL's stream; its `Work` is
  polled with `Work.is_completed()`, which queries NCCL's end event (no host
  synchronize, no `Work.wait()` that blocks the loop);
- an average sums, then scales on the device, on the stream that waited for NCCL;
  consumers wait for the event recorded after it (`mark_done`), by stream;
- sizes that differ by rank (an allgather's dim 0, a reduce-scatter's uneven split)
  are padded to the largest on the device, as torch's collectives take one size per
  rank; an alltoall's splits are exchanged over MPI first, as on the host path; a
  reduce-scatter is an alltoall of the slices, folded on the device. Data
  that is only moved (broadcast, allgather, alltoall) travels as bytes, so every dtype
  goes; reductions take the dtypes both NCCL and gloo reduce (`PG_REDUCE_CODES`).

The choice is per call and rank (a CUDA tensor above the inline size), so the header
says it (`header.PROCESS_GROUP`): ranks that chose different transports fail the call
alike, and a joined rank stands in on the live ranks' transport (`stand_in`).

`ASYNCLOCK_CUDA_PATH=gloo-twin` runs this same code on CPU tensors with a gloo
group: the CPU twin that CI runs where there is no GPU.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ..base.header import INLINE_BYTES, PROCESS_GROUP, W_DIM0, W_NBYTES, Call
from ..base.ops import BFLOAT16, DTYPE_CODES, DTYPE_NAMES, FLOAT_CODES, NUMPY_OF_CODE, ReduceOp
from ..base.tensors import Buffer
from ..device.events import record
from ..transports.process_group import PGGroup, PGRequest
from .collective_ops import AllgatherOp, AllreduceOp, AlltoallOp, BroadcastOp, ReduceScatterOp
from .operation import Lane, Operation, Stage

# What NCCL and gloo both reduce (neither takes int16): one rule for both backends.
PG_REDUCE_CODES = FLOAT_CODES | {DTYPE_CODES[n] for n in ("int8", "uint8", "int32", "int64")}


def group_of(lane: Lane) -> PGGroup | None:
    """The lane's process group for device data, if its channel has one."""
    return getattr(lane.transport, "device_group", None)


def pg_eligible(op: Operation, lane: Lane) -> bool:
    """Whether this operation's data goes through the lane's process group.

    An allreduce or broadcast larger than the header's inline payload (smaller ones
    ride in the header round; the size is the same on every rank, or the header
    round fails the call); an allgather or alltoall whatever its size, as its size
    differs by rank and every rank must choose alike; a reduce-scatter (nothing of it
    rides inline). Reductions in a dtype both backends reduce, and no integer average
    (the host path divides as numpy)."""
    kind = type(op)
    if kind not in _BASES or group_of(lane) is None:
        return False
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(_tensor(op), torch.Tensor):
        return False
    buf = op.buf  # type: ignore[attr-defined]
    if kind in (AllgatherOp, AlltoallOp):
        return True
    if kind is BroadcastOp:
        return bool(buf.array.nbytes > INLINE_BYTES)
    if buf.code not in PG_REDUCE_CODES or (
            op.op is ReduceOp.AVERAGE and buf.code not in FLOAT_CODES):  # type: ignore[attr-defined]
        return False
    return kind is ReduceScatterOp or bool(buf.array.nbytes > INLINE_BYTES)


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
    """Turn a built host operation into its process-group twin (before its header
    round: the header says where its data goes)."""
    op.__class__ = _TWINS[type(op)]
    _say_process_group(op)


def _say_process_group(op: Operation) -> None:
    op.call = op.call._replace(root=op.call.root | PROCESS_GROUP)


def stand_in(lane: Lane, call: Call, identity: np.ndarray[Any, Any], op: ReduceOp
             ) -> AllreduceOp:
    """A joined rank's part in the live ranks' allreduce through the lane's group:
    `identity` as a tensor where the group reduces (the rank's GPU for NCCL, the CPU
    for gloo), reduced in place."""
    torch = sys.modules["torch"]
    bits = identity.view(np.int16) if call.dtype == BFLOAT16 else identity
    tensor = torch.from_numpy(bits).view(getattr(torch, DTYPE_NAMES[call.dtype]))
    buf = device_buffer(tensor.to(_group_of_lane(lane).device()))
    return PGAllreduceOp(lane, call, buf, buf.array, op)


def _tensor(op: Any) -> Any:
    """The caller's tensor: the device tensor of a staged CUDA tensor, else the torch
    tensor itself (the CPU twin)."""
    wrap = op.buf.wrap
    device = getattr(wrap, "device_tensor", None)
    return device if device is not None else op.buf.source


def _bytes(tensor: Any) -> Any:
    """A contiguous tensor's memory as flat bytes (a view: writes land in it)."""
    return tensor.detach().reshape(-1).view(sys.modules["torch"].uint8)


class _Done:
    """A data stage with nothing to move, finished at once (every rank knows it)."""

    def Test(self) -> bool:  # noqa: N802 - the engine's request protocol
        return True

    def Wait(self) -> None:  # noqa: N802
        """Nothing to wait for."""


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
        group = _group(self)
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
        group = _group(self)
        return [lambda t: PGRequest(group.issue_broadcast(_bytes(self.target), self.root))]

    def finish(self) -> Any:
        self.done_event = _land(self, self.target)
        return self.target


class PGAllgatherOp(AllgatherOp):
    """Allgather of the caller's tensor on the channel's process group; dim 0 may
    differ by rank: each rank's bytes are padded to the largest, then packed."""

    def fill_inline(self, slot: Any) -> None:
        """Never inline: every rank takes this path whatever its size."""

    def plan(self, rows: Any, payload: Any) -> list[Stage]:
        torch = sys.modules["torch"]
        tensor = _tensor(self)
        row_bytes = math.prod(self.shape[1:]) * tensor.element_size()
        dim0s = [int(d) for d in rows[:, W_DIM0]]
        self.shape = (sum(dim0s), *self.shape[1:])
        self.counts = [d * row_bytes for d in dim0s]
        self.widest = most = max(self.counts)
        self.dtype = tensor.dtype
        self.stage_bytes = 0
        send = _bytes(tensor)
        if send.numel() < most:
            send = torch.cat([send, send.new_zeros(most - send.numel())])
        self.gathered = send.new_empty(most * len(dim0s))
        if most == 0:
            return []
        group = _group(self)
        return [lambda t: PGRequest(group.issue_allgather(self.gathered, send))]

    def finish(self) -> Any:
        data, most = self.gathered, self.widest
        if any(n != most for n in self.counts):
            data = sys.modules["torch"].cat(
                [data[r * most: r * most + n] for r, n in enumerate(self.counts)])
        result = data.view(self.dtype).reshape(self.shape)
        self.done_event = _land(self, result)
        return result


class PGReduceScatterOp(ReduceScatterOp):
    """Reduce-scatter of the caller's tensor on the channel's process group: an
    alltoall hands rank r every rank's r-th slice (an uneven split padded to the
    largest), which rank r then folds on the device, in the tensor's dtype. Not the
    backends' own reduce-scatter: gloo's makes no progress until it is waited for,
    and a polled one would never finish; the alltoall moves the same bytes."""

    def plan(self, rows: Any, payload: Any) -> list[Stage]:
        tensor = _tensor(self).detach().reshape(-1)
        counts, size = self.counts, self.lane.size
        most = max(counts)
        self.stage_bytes = 0
        self.target = tensor.new_empty(most * size)
        if most == 0:
            return []
        send = tensor
        if any(n != most for n in counts):
            send = tensor.new_zeros(most * size)
            start = 0
            for r, n in enumerate(counts):
                send[r * most: r * most + n].copy_(tensor[start: start + n])
                start += n
        split = [most] * size
        group = _group(self)
        return [lambda t: PGRequest(group.issue_alltoall(self.target, send, split, split))]

    def finish(self) -> Any:
        size, mine = self.lane.size, self.counts[self.lane.rank]
        parts = self.target.view(size, -1)[:, :mine] if mine else self.target[:0]
        result = _fold(parts, self.op) if mine else parts
        if self.op is ReduceOp.AVERAGE:
            result.div_(size)
        result = result.reshape(self.shape)
        self.done_event = _land(self, result)
        return result


def _fold(parts: Any, op: ReduceOp) -> Any:
    """Every rank's slice (one per row) reduced to one, in their dtype."""
    if op in (ReduceOp.SUM, ReduceOp.AVERAGE):
        return parts.sum(0, dtype=parts.dtype)
    if op is ReduceOp.PRODUCT:
        return parts.prod(0, dtype=parts.dtype)
    return parts.amax(0) if op is ReduceOp.MAX else parts.amin(0)


class PGAlltoallOp(AlltoallOp):
    """Alltoall of the caller's tensor: the splits go over MPI first (as on the host
    path), then the rows, as bytes, on the channel's process group."""

    def plan(self, rows: Any, payload: Any) -> list[Stage]:
        self.stage_bytes = 0
        self.moved = int(rows[:, W_NBYTES].sum())  # agreed: 0 on every rank or none
        return [lambda tr: tr.ialltoall(self.send_splits, self.recv_splits), self._pg_stage]

    def _pg_stage(self, transport: Any) -> Any:
        tensor = _tensor(self)
        self.dtype = tensor.dtype
        row_bytes = self.row_elems * tensor.element_size()
        sends = [int(s) * row_bytes for s in self.send_splits]
        takes = [int(s) * row_bytes for s in self.recv_splits]
        send = _bytes(tensor)
        self.target = send.new_empty(sum(takes))
        if not self.moved:
            return _Done()
        return PGRequest(_group(self).issue_alltoall(self.target, send, takes, sends))

    def finish(self) -> Any:
        shape = (int(self.recv_splits.sum()), *self.buf.shape[1:])
        result = self.target.view(self.dtype).reshape(shape)
        self.done_event = _land(self, result)
        return result, [int(s) for s in self.recv_splits]


def _group(op: Operation) -> PGGroup:
    return _group_of_lane(op.lane)


def _group_of_lane(lane: Lane) -> PGGroup:
    group = group_of(lane)
    assert group is not None  # the device path is agreed: every rank of the lane has one
    return group


_TWINS: dict[type, type] = {AllreduceOp: PGAllreduceOp, BroadcastOp: PGBroadcastOp,
                            AllgatherOp: PGAllgatherOp, ReduceScatterOp: PGReduceScatterOp,
                            AlltoallOp: PGAlltoallOp}
_BASES = tuple(_TWINS)  # the collectives that have a process-group form


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
    _say_process_group(op)
