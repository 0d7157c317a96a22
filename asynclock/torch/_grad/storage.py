"""Flat gradient buffers: where packed gradients live while they travel.

When a parameter communicates in its own dtype ("direct"), its `.grad`
becomes a view into the flat buffer: the hook's copy is the only copy, the
allreduce works in place, and the reduced values are already in `.grad`.
Later backward passes accumulate straight into the view. When gradients are
compressed ("staged"), the buffer holds the compressed copy and reduced
values are cast back into `.grad` per bucket.

Scaling is fused into the pack copy: averaging multiplies by 1/size (or
1/predivide) while copying, so the reduction itself is a plain sum.

In a shared window the hook copies nothing: it hands autograd's tensor to
`HandedGrads` and points `.grad` at the view; the pipeline thread copies
only what peers read and sums its own chunk from the tensor (`shm_chunks`).
On Horovod's transport (`grouped`) the hook hands it over too and Horovod
copies it, scaling on the way; the buffer then holds unscaled values.

On gloo's round path (`hand_in_place`) autograd's tensor stays `.grad`: the
hook scales it in place, a bucket that holds only its elements is reduced
in place in it (`RoundBuffers.comm`), and only the elements it shares a
bucket with other parameters are copied in and, once reduced, back. Like
DDP's buckets, the gradient then lives until the next `zero_grad()`: one
freed right after its copy lets the allocator return memory to the system
during backward and page-fault it back for the next layer's gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..._core.base.tensors import Buffer, as_buffer
from .buckets import Bucket, Plan
from .grouped import GROUPED_DTYPES
from .registry import ParamRegistry
from .shm_chunks import HandedGrads, scaled_copy

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64)}


def _same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _dense(p: torch.Tensor) -> None:
    """A sparse gradient (`nn.Embedding(sparse=True)`) travels dense, as under
    Horovod's `sparse_as_dense=True`: buckets hold every element of every
    parameter, so the layout and the collectives stay the same on every rank
    whichever rows each rank's batch touched."""
    if p.grad is not None and p.grad.layout != torch.strided:
        p.grad = p.grad.to_dense()


def _handable(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """A gradient the shared-memory pipeline can read as it is (see shm_chunks)."""
    return (grad.is_contiguous() and grad.shape == view.shape and grad.dtype == view.dtype
            and grad.device == view.device)


def _nothing() -> None:
    return None


def _groupable(group: str, storage: GradStorage) -> bool:
    """A group Horovod can sum as handed tensors: a float dtype every parameter in it
    has itself (no compression cast)."""
    params = {s.param for b in storage.plan.buckets if b.group == group for s in b.segments}
    return (storage.flat[group].dtype in GROUPED_DTYPES
            and all(storage.direct[i] for i in params))


class RoundBuffers:
    """One round's tensor per bucket (`comm`: the buffer's range, or a range of a
    gradient reduced in place) and the parameters whose `.grad` stayed autograd's."""

    __slots__ = ("comm", "params")

    def __init__(self, comm: list[torch.Tensor]) -> None:
        self.comm = list(comm)
        self.params: set[int] = set()


class GradStorage:
    """Buffers and views for one plan; in a shared window when `arena` is given.

    `writable()` runs before any write into the buffers: with shared memory,
    other ranks may still be reading the previous round from them.
    """

    def __init__(self, plan: Plan, registry: ParamRegistry, arena: Any = None,
                 grouped: bool = False) -> None:
        self.plan, self.registry = plan, registry
        self.peers: dict[str, list[torch.Tensor]] = {}
        self.handed = None if arena is None and not grouped else HandedGrads(plan)
        if arena is not None:
            self.peers = {g: arena.buffers(g, _DTYPES[g], n) for g, n in plan.group_numel.items()}
            self.flat = {g: bufs[arena.rank] for g, bufs in self.peers.items()}
            for buf in self.flat.values():
                buf.zero_()
        else:
            self.flat = {g: torch.zeros(n, dtype=_DTYPES[g], device=registry.device)
                         for g, n in plan.group_numel.items()}
        self.writable: Callable[[], None] = _nothing
        self.comm = [self.flat[b.group][b.offset: b.offset + b.numel] for b in plan.buckets]
        self._buffers: dict[int, Buffer] = {}  # `buffer`
        self.region: dict[int, torch.Tensor] = {}
        self.direct: dict[int, bool] = {}
        self.group_of: dict[int, str] = {}
        for i, k in ((i, ks[0]) for i, ks in plan.param_buckets.items()):
            p, group = registry.params[i], plan.buckets[k].group
            off = plan.param_offset[i]
            self.region[i] = self.flat[group][off: off + p.numel()]
            self.direct[i] = p.dtype == self.flat[group].dtype
            self.group_of[i] = group
        self.grouped = {g for g in self.flat if grouped and _groupable(g, self)}
        # gloo's round path: reduce whole-bucket ranges of autograd's tensors in place
        self.hand_in_place = False
        self.hands = set(self.flat) if arena is not None else self.grouped  # handed groups

    def buffer(self, k: int) -> Buffer:
        """Bucket k's flat numpy view, made once per plan: the loop launches every bucket
        every round, and each torch call there waits for the GIL backward's thread holds."""
        buf = self._buffers.get(k)
        if buf is None:
            buf = self._buffers[k] = as_buffer(self.comm[k], writable=True)
        return buf

    def round_buffers(self) -> RoundBuffers:
        return RoundBuffers(self.comm)

    def grouped_bucket(self, k: int) -> bool:
        """Bucket k goes to Horovod as a group of handed tensors (see `grouped`)."""
        return self.plan.buckets[k].group in self.grouped

    def view(self, i: int) -> torch.Tensor:
        return self.region[i].view(self.registry.params[i].shape)

    # -- thread side: called from autograd hooks --------------------------------
    def accumulate(self, i: int) -> None:
        """A non-final pass: keep the running sum in the buffer (direct only)."""
        p = self.registry.params[i]
        _dense(p)  # later passes then add their sparse rows into a dense sum
        if i in self.region and self.direct[i]:
            view = self.view(i)
            if not _same(p.grad, view):
                assert p.grad is not None
                self.writable()
                view.copy_(p.grad)
                p.grad = view

    def pack(self, i: int, scale: float, into: RoundBuffers | None = None) -> None:
        """The final pass: scaled copy into the buffer (or scale in place; `into`: the
        round's buffers, where `hand_in_place` may leave the gradient in place)."""
        if i not in self.region:
            return
        self.writable()
        p = self.registry.params[i]
        _dense(p)
        if self.handed is not None:
            self.handed.scale = scale
        if p.grad is None:
            self._zero(i, p)
            return
        if self.direct[i]:
            self._pack_direct(i, p, scale, into)
            return
        if not p.grad.is_contiguous():
            p.grad = p.grad.contiguous()
        torch.mul(p.grad.view(-1), scale, out=self.region[i])

    def _pack_direct(self, i: int, p: torch.Tensor, scale: float,
                     into: RoundBuffers | None) -> None:
        view, group = self.view(i), self.group_of[i]
        scale_here = 1.0 if group in self.grouped else scale  # Horovod scales those
        if _same(p.grad, view):
            if scale_here != 1.0:
                view.mul_(scale_here)
            return
        assert p.grad is not None
        if self.handed is not None and group in self.hands and _handable(p.grad, view):
            self.handed.hand(i, p.grad, scale)  # the shm pipeline or Horovod copies it
        elif into is not None and self.hand_in_place and _handable(p.grad, view):
            self._keep_in_place(i, p.grad, scale, into)
            return
        else:
            scaled_copy(p.grad, scale_here, view)
        p.grad = view

    def _keep_in_place(self, i: int, grad: torch.Tensor, scale: float,
                       into: RoundBuffers) -> None:
        """`.grad` stays autograd's `grad`, scaled in place: each bucket that holds
        only its elements is reduced in place in it; the elements it shares a
        bucket with other parameters are copied into the buffer."""
        if scale != 1.0:
            grad.mul_(scale)
        flat = grad.view(-1)
        into.params.add(i)
        for k in self.plan.param_buckets[i]:
            bucket, seg = self.plan.buckets[k], self.plan.segment[(i, k)]
            if len(bucket.segments) == 1:
                into.comm[k] = flat[seg.start: seg.stop]
            else:
                at = seg.offset - bucket.offset
                into.comm[k][at: at + seg.numel].copy_(flat[seg.start: seg.stop])

    def _zero(self, i: int, p: torch.Tensor) -> None:
        """A parameter without a gradient on this rank contributes zeros (Horovod)."""
        self.region[i].zero_()
        p.grad = self.view(i) if self.direct[i] else torch.zeros_like(p)

    # -- consumer side: after the bucket arrived -------------------------------
    def unpack(self, k: int, post: float, into: RoundBuffers | None = None) -> None:
        """Make bucket k's reduced values the parameters' gradients (`into`: the
        round's buffers, where some stayed in autograd's tensors)."""
        bucket: Bucket = self.plan.buckets[k]
        src = self.comm[k] if into is None else into.comm[k]
        kept = set() if into is None else into.params
        for seg in bucket.segments:
            part = src[seg.offset - bucket.offset: seg.offset - bucket.offset + seg.numel]
            if self.direct[seg.param] and seg.param in kept and len(bucket.segments) > 1:
                grad = self.registry.params[seg.param].grad
                assert grad is not None
                torch.mul(part, post, out=grad.view(-1)[seg.start: seg.stop])
                continue
            if self.direct[seg.param]:
                if post != 1.0:
                    part.mul_(post)
                continue
            grad = self.registry.params[seg.param].grad
            assert grad is not None and grad.is_contiguous()
            torch.mul(part, post, out=grad.view(-1)[seg.start: seg.stop])

    def adopt(self) -> None:
        """After a re-plan: move current gradients into the new views."""
        for i in self.region:
            p = self.registry.params[i]
            _dense(p)
            if p.grad is not None and self.direct[i]:
                self.view(i).copy_(p.grad)
                p.grad = self.view(i)
