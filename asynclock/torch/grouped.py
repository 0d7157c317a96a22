"""Buckets Horovod fuses itself: gradients handed to Horovod without a copy.

On Horovod's transport a bucket used to start from asynclock's flat buffer,
which the hook had filled with a scaled copy of each gradient; Horovod then
copied the buckets in flight into its fusion buffer and back out. The first
copy was asynclock's alone: a scaled copy of the whole model every step, on
the thread that runs backward (bench/train.py, MLP: the largest kernel of
the step after the matrix products). Here the hook hands autograd's tensor
over, as the shared-memory path does (`shm_chunks.HandedGrads`), and the
bucket goes to Horovod as a group of one tensor per segment: the handed
tensor in, its slice of the flat buffer out. A segment whose gradient is
already in the buffer (accumulated there, zeros, not handable) goes in
place. Horovod applies the averaging scale in its fusion buffer
(`prescale`), so `GradStorage` leaves these groups unscaled.

Rank consistency: a group has one entry per segment of the agreed plan,
whatever each rank handed, so every rank issues the same Horovod group.
A round whose check failed (a joined rank stands in for its buckets) sends
plain buckets instead: `settle` first brings the scaled data into the buffer
on the loop (one bucket's copy, on that rare path).
"""

from __future__ import annotations

import torch

from .buckets import Bucket
from .shm_chunks import HandedGrads, scaled_copy

GROUPED_DTYPES = frozenset({torch.float32, torch.float64})  # Horovod's CPU sums


def _sources(handed: HandedGrads, b: Bucket) -> dict[int, torch.Tensor]:
    return {h.segment.offset: h.source for h in handed.by_bucket[b.index]}


def entries(handed: HandedGrads, b: Bucket, flat: torch.Tensor
            ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per segment of bucket b, in plan order: what goes in, and where the sum lands."""
    sources = _sources(handed, b)
    outputs = [flat[s.offset: s.offset + s.numel] for s in b.segments]
    return [sources.get(s.offset, out) for s, out in zip(b.segments, outputs, strict=True)], outputs


def settle(handed: HandedGrads, b: Bucket, flat: torch.Tensor) -> None:
    """Bring bucket b into the buffer, scaled, for a plain allreduce."""
    sources, scale = _sources(handed, b), handed.scale
    for s in b.segments:
        out = flat[s.offset: s.offset + s.numel]
        source = sources.get(s.offset)
        if source is not None:
            scaled_copy(source, scale, out)
        elif scale != 1.0:
            out.mul_(scale)
    handed.drop(b.index)
