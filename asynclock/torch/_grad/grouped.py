"""Buckets Horovod fuses itself: gradients handed to Horovod without a copy.

On Horovod's transport, a bucket that started from asynclock's flat buffer
would need the hook to fill it with a scaled copy of each gradient, and
Horovod then copies the buckets in flight into its fusion buffer and back
out. The first copy would be asynclock's alone: a scaled copy of the whole
model every step, on the thread that runs backward, and for a memory-bound
model one of the step's largest kernels. Here the hook hands autograd's tensor
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
from .shm_chunks import HandedGrads

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
    """Bring bucket b into the buffer, scaled, for a plain allreduce: scale what is
    in it already (packed unscaled), then copy the handed tensors in (`flush`)."""
    if handed.scale != 1.0:
        sources = _sources(handed, b)
        for s in b.segments:
            if s.offset not in sources:
                flat[s.offset: s.offset + s.numel].mul_(handed.scale)
    handed.flush(b, flat)
