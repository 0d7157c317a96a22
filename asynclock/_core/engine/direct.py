"""Allreduce on device memory through a CUDA-aware MPI (no host staging).

Chosen per operation by `engine.staging` when `cuda_support().direct`
(MPICH-family with GPU support, or ASYNCLOCK_CUDA_DIRECT=1), the channel is
an MPI channel, and the payload is too large to ride in the header: header
agreement, FIFO data stages and error reporting stay exactly those of the
host path, so ranks that stage and ranks that go direct still match (the
same MPI_Iallreduce with the same count and datatype). Half types (MPI has
no float16 sum; the host path accumulates in float32) and integer averages
(floor division on the host) keep using staging.

Device tensors go through the channel's usual `iallreduce` (mpi4py accepts
`__cuda_array_interface__`/DLPack objects where it expects a buffer).

The staging gate holds the operation until the producer's event completed:
MPI reads device memory on its own streams and knows nothing of ours.
"""

from __future__ import annotations

import sys
from typing import Any

from ..base.header import INLINE_BYTES
from ..base.ops import FLOAT_CODES, HALF_CODES, ReduceOp
from ..device.events import record
from ..device.paths import cuda_support
from .collective_ops import AllreduceOp
from .operation import Lane, Operation, Stage


def direct_eligible(op: Operation, lane: Lane) -> bool:
    """Whether this staged operation may hand its device buffer to MPI."""
    from ..transports.mpi import MPIChannel  # mpi4py itself stays unimported

    if type(op) is not AllreduceOp or not isinstance(lane.transport, MPIChannel):
        return False
    if not cuda_support().direct:
        return False
    code = op.buf.code
    if code in HALF_CODES or op.buf.array.nbytes <= INLINE_BYTES:
        return False
    return op.op is not ReduceOp.AVERAGE or code in FLOAT_CODES


def make_direct(op: Operation) -> None:
    """Turn a built host allreduce into its device-memory twin."""
    op.__class__ = DirectAllreduceOp


class DirectAllreduceOp(AllreduceOp):
    """Iallreduce on the CUDA tensor itself; the pinned host buffer is unused."""

    def fill_inline(self, slot: Any) -> None:
        """Never inline: only payloads above INLINE_BYTES come here."""

    def plan(self, rows: Any, payload: Any) -> list[Stage]:
        """The host path's data stage, on the same channel, with device buffers.

        The engine picks the transport (the channel, or its bulk view that
        runs the blocking collective in the wait thread), exactly as for a
        host buffer of this size, so a rank that stages and a rank that goes
        direct issue the same MPI call on the same communicator.
        """
        device = self.buf.wrap.device_tensor  # type: ignore[attr-defined]
        in_place = self.out is self.buf.array
        self.target = device if in_place else sys.modules["torch"].empty_like(device)
        send = None if in_place else device
        self.stage_bytes = self.buf.array.nbytes
        return [lambda t: t.iallreduce(send, self.target, self.op)]

    def finish(self) -> Any:
        """MPI has finished writing device memory; average on the current stream."""
        target = self.target
        if self.op is ReduceOp.AVERAGE:
            target.div_(self.lane.size)
        self.buf.wrap.mark_done(record(target))  # type: ignore[attr-defined]
        return target
