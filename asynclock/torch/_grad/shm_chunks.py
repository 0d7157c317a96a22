"""Chunks of a shared-memory round, and gradients handed over without a copy.

Rank r owns chunk r of every bucket (`chunk`): it sums that chunk over every
rank's buffer, in rank order, and the other ranks copy the sum back. A peer
reads nothing of my buffer but the chunks it owns, so my own chunk never has
to be in my buffer before I reduce it. A hook therefore does not copy its
gradient: it hands the tensor autograd produced over (`HandedGrads.hand`),
the pipeline thread copies the parts peers will read (`fill`), and my
reduction reads my own part straight from the handed tensor, scaling it on
the way (`reduce_chunk`). On a 2-rank node that halves the copy (the
gradients are the size of the model, every step) and takes it off the
thread that runs backward.

Bits: every element is summed by one rank (its owner) and copied to the
others, so all ranks hold the same bits whichever way the owner computed
them. An averaging scale of 1/2^k (2, 4, 8 ranks) is exact, so the fused
scale-and-add gives the same bits as scaling first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._core.transports.shared_window import owned_slice
from .buckets import Bucket, Plan, Segment


def chunk(bucket: Bucket, r: int, n: int) -> tuple[int, int]:
    """Rank r's share [lo, hi) of the bucket, in group-buffer elements (the window's
    slice ownership, `owned_slice`)."""
    lo, hi = owned_slice(bucket.numel, r, n)
    return bucket.offset + lo, bucket.offset + hi


@dataclass(frozen=True, slots=True)
class Handed:
    """One parameter's part of one bucket, still in the tensor autograd made."""

    segment: Segment
    source: torch.Tensor  # the segment's elements, flat, not yet scaled
    scale: float


@dataclass(frozen=True, slots=True)
class Span:
    """A run [lo, hi) of my chunk (group elements): handed over, or in my buffer."""

    lo: int
    hi: int
    handed: Handed | None


def scaled_copy(source: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    if scale == 1.0:
        out.copy_(source)
    else:
        torch.mul(source, scale, out=out)


class HandedGrads:
    """Per bucket, the gradients hooks handed over this round and nobody copied yet.

    The hook thread appends before it reports the bucket packed; the pipeline
    thread reads after it saw that report (the report orders the two) and
    drops the bucket's list once its chunk is reduced. A new round starts
    with fresh lists (`clear`), so a failed round leaves nothing behind.
    """

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.by_bucket: list[list[Handed]] = []
        self.scale = 1.0  # the round's pack scale (`grouped`: Horovod applies it)
        self.clear()

    def fresh(self) -> HandedGrads:
        """An empty copy for the next round, while buckets of this one may still wait
        for their launch (Horovod groups read the lists at launch)."""
        new = HandedGrads.__new__(HandedGrads)
        new.plan, new.scale = self.plan, self.scale
        new.clear()
        return new

    def clear(self) -> None:
        self.by_bucket = [[] for _ in self.plan.buckets]

    def hand(self, i: int, grad: torch.Tensor, scale: float) -> None:
        """Parameter i's final gradient (contiguous, the buffer's dtype), uncopied."""
        flat = grad.view(-1)
        lists = self.by_bucket
        for k in self.plan.param_buckets[i]:
            seg = self.plan.segment[(i, k)]
            lists[k].append(Handed(seg, flat[seg.start: seg.stop], scale))

    def fill(self, b: Bucket, mine: torch.Tensor, me: int, n: int) -> None:
        """Copy into my buffer what peers will read of bucket b: all but my chunk."""
        lo, hi = chunk(b, me, n)
        for h in self.by_bucket[b.index]:
            a, z = h.segment.offset, h.segment.offset + h.segment.numel
            for x, y in ((a, min(z, lo)), (max(a, hi), z)):
                if x < y:
                    scaled_copy(h.source[x - a: y - a], h.scale, mine[x:y])

    def flush(self, b: Bucket, mine: torch.Tensor) -> None:
        """Copy all of bucket b into my buffer (it travels as a plain allreduce)."""
        for h in self.by_bucket[b.index]:
            a = h.segment.offset
            scaled_copy(h.source, h.scale, mine[a: a + h.segment.numel])
        self.by_bucket[b.index] = []

    def spans(self, b: Bucket, lo: int, hi: int) -> list[Span]:
        """My chunk [lo, hi) of bucket b cut where handed segments begin and end."""
        out: list[Span] = []
        at = lo
        for h in sorted(self.by_bucket[b.index], key=lambda h: h.segment.offset):
            a = max(h.segment.offset, lo)
            z = min(h.segment.offset + h.segment.numel, hi)
            if a >= z:
                continue
            if at < a:
                out.append(Span(at, a, None))
            out.append(Span(a, z, h))
            at = z
        if at < hi:
            out.append(Span(at, hi, None))
        return out

    def drop(self, k: int) -> None:
        self.by_bucket[k] = []


def reduce_chunk(parts: list[torch.Tensor], me: int, mine: torch.Tensor | None,
                 scale: float) -> None:
    """Sum every rank's part into `parts[me]`, in rank order whoever owns the chunk
    (IEEE addition commutes, it does not associate). `mine`: my contribution, not
    yet scaled, when it is not in `parts[me]`."""
    acc, n = parts[me], len(parts)
    if me < 2:
        _add_mine(parts[1 - me], mine, scale, acc)  # x0 + x1, the same bits as x1 + x0
    else:
        head = parts[0] + parts[1]
        for q in range(2, me):
            head.add_(parts[q])
        _add_mine(head, mine, scale, acc)
    for q in range(max(2, me + 1), n):
        acc.add_(parts[q])


def _add_mine(before: torch.Tensor, mine: torch.Tensor | None, scale: float,
              acc: torch.Tensor) -> None:
    """acc = before + my contribution (in acc already, or `mine` scaled)."""
    if mine is None:
        torch.add(before, acc, out=acc)
    elif scale == 1.0:
        torch.add(before, mine, out=acc)
    else:
        torch.add(before, mine, alpha=scale, out=acc)
