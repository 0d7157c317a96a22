"""Bucket plans: which gradient bytes travel together, and in which order.

A plan is a pure function of agreed inputs (the parameter order, sizes,
caps, fixed groups and the launch order), so every rank that is handed the
same inputs builds bit-for-bit the same buckets. Nothing here looks at a
clock: timing only enters through the launch order, which rank 0 computes
and broadcasts (see `priority` and `reducer`).

Layout: one flat buffer per communication dtype. Buckets are consecutive
ranges of it, filled in the parameter order, so every parameter occupies
one contiguous range even when it is partitioned across several buckets.
That lets `param.grad` be a view into the buffer (no copy back after the
allreduce), and lets a large tensor be cut so that later, more urgent
buckets can be launched between its parts.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """What the planner needs to know about one parameter."""

    numel: int
    group: str  # communication dtype name: one flat buffer per group
    itemsize: int


@dataclass(frozen=True, slots=True)
class Caps:
    """Size limits; `partition=False` never cuts a tensor (one per bucket at most cap);
    None leaves it to the transport (the reducer decides before it plans).

    `gather` (uncut plans only): a tensor of at least the cap takes a bucket of its
    own and leaves the open bucket open, so the small tensors between large ones
    gather into one bucket instead of going alone. gloo's rounds reduce a lone
    tensor in place, and each bucket is one more call."""

    bucket_bytes: int = 4 * MiB
    first_bucket_bytes: int = 1 * MiB
    partition: bool | None = True
    gather: bool = False

    def __post_init__(self) -> None:
        if self.bucket_bytes < 1 or self.first_bucket_bytes < 1:
            raise ValueError(f"bucket caps must be positive, got {self}")
        if self.gather and self.partition is not False:
            raise ValueError(f"gathering small tensors needs an uncut plan, got {self}")


@dataclass(frozen=True, slots=True)
class Segment:
    """Elements [start, stop) of a parameter's flat gradient at `offset` in its group buffer."""

    param: int
    start: int
    stop: int
    offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Bucket:
    """One allreduce: a contiguous range of a group buffer."""

    index: int
    group: str
    offset: int
    numel: int
    nbytes: int
    segments: tuple[Segment, ...]

    @property
    def params(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s.param for s in self.segments))

    @functools.cached_property
    def label(self) -> str:
        """A name for what the bucket holds (its dtype group and which elements of which
        parameters), not for the plan it belongs to: a re-plan that keeps a bucket keeps
        its label, and a bucket that changed gets another."""
        layout = [(s.param, s.start, s.stop) for s in self.segments]
        return f"b{self.index}.{zlib.crc32(repr((self.group, layout)).encode()):08x}"


@dataclass(frozen=True)
class Plan:
    """Buckets, the agreed launch order and where each parameter lives."""

    order: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    launch: tuple[int, ...]
    group_numel: dict[str, int]
    param_offset: dict[int, int]
    param_buckets: dict[int, tuple[int, ...]] = field(default_factory=dict)

    @functools.cached_property
    def crc(self) -> int:
        """Checksum of the layout and launch order: ranks compare it once per round,
        so a rank on another plan fails the round's check on every rank."""
        return zlib.crc32(repr([(b.group, b.numel) for b in self.buckets]
                               + list(self.launch)).encode())

    @functools.cached_property
    def segment(self) -> dict[tuple[int, int], Segment]:
        """(parameter, bucket) -> the parameter's segment in that bucket."""
        return {(s.param, b.index): s for b in self.buckets for s in b.segments}

    def launch_position(self) -> list[int]:
        """position[k] = where bucket k sits in the launch order."""
        pos = [0] * len(self.buckets)
        for n, k in enumerate(self.launch):
            pos[k] = n
        return pos


class _Packer:
    """Fills buckets group by group; a bucket closes when it reaches its cap."""

    def __init__(self, specs: Sequence[ParamSpec], caps: Caps) -> None:
        self.specs, self.caps = specs, caps
        self.buckets: list[Bucket] = []
        self.open: dict[str, list[Segment]] = {}
        self.used: dict[str, int] = {}  # bytes in the open bucket
        self.fill: dict[str, int] = {}  # elements assigned in the group buffer
        self.offsets: dict[int, int] = {}

    def cap(self) -> int:
        return self.caps.first_bucket_bytes if not self.buckets else self.caps.bucket_bytes

    def close(self, group: str) -> None:
        segs = self.open.pop(group, [])
        self.used.pop(group, None)
        if segs:
            self._emit(group, segs)

    def _emit(self, group: str, segs: list[Segment]) -> None:
        """The next bucket: `segs`, from the first one's offset on."""
        numel = sum(s.numel for s in segs)
        itemsize = self.specs[segs[0].param].itemsize
        self.buckets.append(Bucket(len(self.buckets), group, segs[0].offset, numel,
                                   numel * itemsize, tuple(segs)))

    def take(self, i: int, start: int, count: int) -> None:
        spec = self.specs[i]
        offset = self.fill.get(spec.group, 0)
        self.offsets.setdefault(i, offset)
        self.open.setdefault(spec.group, []).append(Segment(i, start, start + count, offset))
        self.fill[spec.group] = offset + count
        self.used[spec.group] = self.used.get(spec.group, 0) + count * spec.itemsize

    def add(self, i: int) -> None:
        """Pack parameter i; cut it at bucket boundaries when partitioning."""
        spec, start = self.specs[i], 0
        if self.caps.gather and spec.numel * spec.itemsize >= self.cap():
            self.alone(i)
            return
        while start < spec.numel:
            used = self.used.get(spec.group, 0)
            room = max((self.cap() - used) // spec.itemsize, 0 if used else 1)
            if room <= 0 or (not self.caps.partition and self.used.get(spec.group)
                             and (spec.numel - start) > room):
                self.close(spec.group)
                continue
            count = spec.numel - start if not self.caps.partition else min(room, spec.numel - start)
            self.take(i, start, count)
            start += count
            if self.used[spec.group] >= self.cap():
                self.close(spec.group)

    def alone(self, i: int) -> None:
        """Parameter i as a bucket of its own, past the open one (`Caps.gather`): its
        range in the group buffer lies inside the open bucket's until `_laid_out`."""
        spec = self.specs[i]
        offset = self.fill.get(spec.group, 0)
        self.offsets[i] = offset
        self.fill[spec.group] = offset + spec.numel
        self._emit(spec.group, [Segment(i, 0, spec.numel, offset)])

    def add_group(self, members: Sequence[int]) -> None:
        """A fixed group is one bucket per dtype, never cut, never shared."""
        groups = dict.fromkeys(self.specs[i].group for i in members)
        for g in groups:
            self.close(g)
        for i in members:
            if self.specs[i].numel:
                self.take(i, 0, self.specs[i].numel)
        for g in groups:
            self.close(g)


def build_plan(order: Sequence[int], specs: Sequence[ParamSpec], caps: Caps, *,
               groups: Sequence[Sequence[int]] = (),
               launch: Sequence[int] | None = None) -> Plan:
    """Buckets for parameters in `order` (the order their gradients become ready).

    `groups` are fixed buckets (Horovod's `groups=`): a group is emitted when
    its last member appears in `order`. `launch` defaults to bucket order.
    """
    _check_order(order, len(specs))
    packer = _Packer(specs, caps)
    member_of = {i: n for n, g in enumerate(groups) for i in g}
    left = [len(set(g)) for g in groups]
    for i in order:
        if i in member_of:
            n = member_of[i]
            left[n] -= 1
            if left[n] == 0:
                packer.add_group(list(dict.fromkeys(groups[n])))
        elif specs[i].numel:
            packer.add(i)
    for g in list(packer.open):
        packer.close(g)
    if caps.gather:
        _laid_out(packer)
    return _finish(order, packer, launch)


def _laid_out(packer: _Packer) -> None:
    """Lay each group's buckets out one after another in bucket order, so every bucket
    is again one contiguous range (a gathering bucket's tensors were placed around the
    lone tensors that went before it closed)."""
    at: dict[str, int] = {}
    buckets = []
    for b in packer.buckets:
        offset = at.get(b.group, 0)
        segments, here = [], offset
        for s in b.segments:
            segments.append(Segment(s.param, s.start, s.stop, here))
            packer.offsets[s.param] = here
            here += s.numel
        at[b.group] = here
        buckets.append(Bucket(b.index, b.group, offset, b.numel, b.nbytes, tuple(segments)))
    packer.buckets = buckets


def _finish(order: Sequence[int], packer: _Packer, launch: Sequence[int] | None) -> Plan:
    buckets = tuple(packer.buckets)
    chosen = tuple(range(len(buckets))) if launch is None else tuple(int(k) for k in launch)
    if sorted(chosen) != list(range(len(buckets))):
        raise ValueError(f"launch order {list(chosen)[:8]}... is not a permutation of "
                         f"{len(buckets)} buckets")
    where: dict[int, list[int]] = {}
    for b in buckets:
        for s in b.segments:
            where.setdefault(s.param, []).append(b.index)
    return Plan(tuple(order), buckets, chosen, dict(packer.fill), dict(packer.offsets),
                {i: tuple(dict.fromkeys(ks)) for i, ks in where.items()})


def _check_order(order: Sequence[int], n: int) -> None:
    if sorted(order) != list(range(n)):
        raise ValueError(f"parameter order must be a permutation of range({n})")


def bucket_ready_times(plan: Plan, param_ready: Sequence[float]) -> list[float]:
    """A bucket is ready when its last parameter is."""
    return [max(param_ready[s.param] for s in b.segments) for b in plan.buckets]
