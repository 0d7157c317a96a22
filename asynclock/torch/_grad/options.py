"""User options (Horovod's names plus asynclock's) turned into `ReduceOptions`.

Shared by `DistributedOptimizer` and `train_step`, so both APIs accept and
validate the same knobs the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..._core.base import settings
from ..._core.base.ops import ReduceOp, as_reduce_op
from ..._core.engine.progress import ProgressPolicy
from .buckets import Caps
from .compression import Compression, wire_dtype
from .reducer import MiB, ReduceOptions
from .registry import ParamRegistry


@dataclass(frozen=True)
class Tuning:
    """asynclock's own knobs for gradient buckets; defaults suit CPU ranks sharing memory.

    Pass one as `tuning=` to `DistributedOptimizer` or `coord.train_step`.

    Args:
        bucket_cap_mb: cap of a gradient bucket, in MiB.
        first_bucket_mb: cap of the first bucket, so communication starts early.
        window_mb: MiB of buckets in flight at once (the credit window); None: 16,
            and no bound on Horovod's transport, where Horovod queues buckets itself.
        partition: cut large tensors at bucket boundaries, so front layers go first;
            None: on, except on Horovod's transport (`horovodrun --gloo`), where
            Horovod fuses each bucket itself and a cut tensor's parts, ready together,
            would only go as more Horovod collectives, and where buckets go over gloo
            across hosts, which reduces a bucket holding one whole tensor in place in
            the tensor autograd made (no copy), and gathers the small tensors between
            large ones into one bucket.
        priority: launch front buckets first; None: on exactly when forward gating is on.
        replan: re-plan the bucket layout from the gradient order rank 0 observes.
        shm: gradient buckets through the node's shared memory when every rank is on
            one node (MPI's window, or a /dev/shm file under `horovodrun --gloo`).
        stall_s: seconds a step waits for its gradients before it logs what it waits
            for (then at doubling intervals); default ASYNCLOCK_STALL_S.
        timeout_s: seconds after which a step waiting for its gradients raises
            CollectiveTimeout (None: never).
    """

    bucket_cap_mb: float = 4.0
    first_bucket_mb: float = 1.0
    window_mb: float | None = None  # None: 16, unbounded on Horovod's transport
    partition: bool | None = None  # None: on, except on Horovod's transport
    priority: bool | None = None  # None: on exactly when forward gating is on
    replan: bool = True
    shm: bool = True  # shared-memory buckets when every rank is on one node
    stall_s: float = field(default_factory=lambda: settings.number("ASYNCLOCK_STALL_S"))
    timeout_s: float | None = None


def training_policy() -> ProgressPolicy:
    """Progress-engine settings for ranks whose core is busy training.

    The default polls tightly for 2 ms after every bit of progress; with
    dozens of bucket operations per step on one core per rank, that spinning
    measurably slows backward (`bench/train.py --threads` shows its CPU).
    200 µs keeps small-message latency low and gives the core back; for
    the same reason the spin after each issue stays at 50 µs (a bucket's
    header waits for the slowest rank's backward, often for milliseconds).
    ASYNCLOCK_BUSY_US and ASYNCLOCK_SPIN_US still win when set.

    Returns:
        The progress engine's policy `hvd.init()` uses.
    """
    policy = ProgressPolicy.from_env()
    if not settings.is_set("ASYNCLOCK_BUSY_US"):
        policy = replace(policy, busy_s=2e-4)
    if not settings.is_set("ASYNCLOCK_SPIN_US"):
        policy = replace(policy, spin_s=5e-5)
    return policy


def split_groups(registry: ParamRegistry, groups: Any) -> tuple[tuple[int, ...], ...]:
    """Horovod's `groups`: an int (that many even chunks) or lists of parameters."""
    if groups is None or groups == 0:
        return ()
    n = len(registry)
    if isinstance(groups, int):
        if groups < 0:
            raise ValueError(f"groups must be a non-negative int or a list of lists, got {groups}")
        size = -(-n // groups)
        return tuple(tuple(range(a, min(a + size, n))) for a in range(0, n, size))
    return _listed_groups(registry, groups)


def _listed_groups(registry: ParamRegistry,
                   groups: Sequence[Sequence[Any]]) -> tuple[tuple[int, ...], ...]:
    out, seen = [], set()
    for group in groups:
        idx = []
        for p in group:
            i = registry.index(p)
            if i is None:
                raise ValueError("groups must only contain trainable parameters of the optimizer")
            if i in seen:
                raise ValueError(f"parameter {registry.names[i]} appears in more than one group")
            seen.add(i)
            idx.append(i)
        if idx:
            out.append(tuple(idx))
    return tuple(out)


def build_options(registry: ParamRegistry, *, op: Any = ReduceOp.AVERAGE,
                  compression: Any = Compression.none, backward_passes_per_step: int = 1,
                  gradient_predivide_factor: float = 1.0, groups: Any = None,
                  tuning: Tuning = Tuning(), gated: bool = False) -> ReduceOptions:
    """Validate and combine; raises the same ValueError on every rank."""
    caps = Caps(int(tuning.bucket_cap_mb * MiB), int(tuning.first_bucket_mb * MiB),
                tuning.partition)
    priority = gated if tuning.priority is None else tuning.priority
    rop = as_reduce_op(op)
    if rop is ReduceOp.ADASUM:  # buckets reduce elementwise; Adasum combines whole steps
        raise ValueError("op=Adasum combines optimizer steps, not gradient buckets: "
                         "use hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)")
    return ReduceOptions(
        op=rop, predivide=float(gradient_predivide_factor),
        wire_dtype=wire_dtype(compression), passes=int(backward_passes_per_step), caps=caps,
        window_bytes=None if tuning.window_mb is None else max(1, int(tuning.window_mb * MiB)),
        groups=split_groups(registry, groups),
        replan=tuning.replan, priority=priority, shm=tuning.shm, stall_s=tuning.stall_s,
        timeout_s=tuning.timeout_s)
