"""The gradient reducer: buckets, hooks, scheduler and updates for one optimizer.

Both user-facing APIs (Horovod's `DistributedOptimizer` and the async
`train_step`) drive one `Reducer`:

1. hooks pack gradients into buckets as backward produces them
   (`hooks.Bucketer`), and report complete buckets to the loop;
2. the scheduler launches them in the agreed order (`scheduler`);
3. `close_round()` at the end of backward packs what did not arrive;
4. a consumer thread waits per bucket, unpacks and applies (`apply`).

The first round uses a guessed layout (reverse registration order, as DDP
does). At its end rank 0 proposes the layout from the order it observed
(and, with priority on, a launch order from its timeline) and broadcasts
it; every rank rebuilds the same plan from that. Nothing else about the
plan ever depends on local timing.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from ..._core.api.collectives import LaneCollectives
from ..._core.base import settings
from ..._core.base.errors import CollectiveTimeout, JoinedError, MismatchError
from ..._core.base.ops import ReduceOp
from ..._core.device.events import record, stream_wait
from ..._core.device.paths import describe as describe_path
from ..._core.engine import making
from ..._core.engine.device_pg import group_of
from ..._core.engine.operation import Lane
from ..._core.runtime.coordinator import Coordinator
from ..._core.transports.node_segment import free_bytes, share_file
from ..._core.transports.process_group import PGGroup
from .apply import Updates, hyperparameters
from .buckets import Caps, Plan, bucket_ready_times, build_plan
from .gloo_rounds import GlooRounds, bulk_min_bytes, rounds_group, takes_plan
from .hooks import Bucketer
from .loop_access import LoopAccess
from .priority import link_speed, priority_launch
from .registry import ParamRegistry
from .release import Held
from .rounds import CheckedRounds
from .scheduler import Scheduler
from .shard import Shards
from .shm import SharedArena, ShmTransport, eligible, file_bytes, mpi_window
from .step_run import StepRun
from .storage import GradStorage
from .tracing import unpack_span

log = logging.getLogger("asynclock.torch")
MiB = 1 << 20
_UNBOUNDED = 1 << 62  # a credit window that never holds a bucket back
_lanes: weakref.WeakKeyDictionary[Coordinator, int] = weakref.WeakKeyDictionary()
_live: weakref.WeakSet[Reducer] = weakref.WeakSet()


def quiesce_all() -> None:
    """Before shutdown: every live reducer applies deferred updates and waits
    until its last round released the shared buffers (nothing left in flight)."""
    for reducer in list(_live):
        reducer.quiesce()


def stop_workers() -> None:
    """After shutdown: end the shared-memory worker threads."""
    for reducer in list(_live):
        if reducer.transport is not None:
            reducer.transport.close()


def gradient_lane(coord: Coordinator) -> Lane:
    """The first reducer of a coordinator uses `coord.lowlevel.grad_lane`; each further one
    gets a channel of its own, made as an agreed call (`Coordinator.lowlevel.make_lanes`):
    every rank creates reducers in the same order, and a rank that makes one
    more than the others gets an error, as they do, instead of a hang. Rounds of
    different optimizers may then overlap in any timing without ever interleaving
    on one channel. A joined rank serves them all."""
    n = _lanes.get(coord, 0)
    if n == 0:
        _lanes[coord] = 1
        return coord.lowlevel.grad_lane
    lanes = coord.lowlevel.call_blocking(coord.lowlevel.make_lanes, "gradient lane",
                                lambda: [coord.backend.channel(f"grad{n}")], (False,))
    assert lanes is not None  # every rank is in the world
    _lanes[coord] = n + 1  # counted once made, on every rank alike
    coord.lowlevel.more_grad_lanes.extend(lanes)
    return lanes[0]


@dataclass(frozen=True)
class ReduceOptions:
    """Everything that shapes the reduction; identical on every rank."""

    op: ReduceOp = ReduceOp.AVERAGE
    predivide: float = 1.0
    wire_dtype: torch.dtype | None = None
    passes: int = 1
    caps: Caps = field(default_factory=Caps)
    window_bytes: int | None = 16 * MiB  # None: the transport's (`Reducer._resolved`)
    groups: tuple[tuple[int, ...], ...] = ()
    replan: bool = True
    priority: bool = False
    shm: bool = True  # shared-memory reduction when every rank is on one node
    stall_s: float = 60.0
    timeout_s: float | None = None

    def __post_init__(self) -> None:
        if self.op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise NotImplementedError(
                f"gradient reduction supports Average and Sum, not {self.op!r}")
        if self.predivide != 1.0 and self.op is not ReduceOp.AVERAGE:
            raise ValueError("gradient_predivide_factor not supported with op != Average")
        if self.passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {self.passes}")

    def fingerprint(self) -> str:
        """What must agree across ranks (stall reporting and timeouts may differ)."""
        return repr(replace(self, stall_s=0.0, timeout_s=None))

    def scales(self, size: int) -> tuple[float, float]:
        """(pre, post): Average = sum of x * pre, then * post; pre * post = 1/size."""
        if self.op is ReduceOp.SUM:
            return 1.0, 1.0
        if self.predivide == 1.0:
            return 1.0 / size, 1.0
        return 1.0 / self.predivide, self.predivide / size


class Finish(enum.Enum):
    WHOLE = "whole"
    PER_BUCKET = "per_bucket"
    DEFERRED = "deferred"


Params = list[torch.nn.Parameter]


class Reducer:
    """Owns the hooks on one optimizer's parameters."""

    def __init__(self, coord: Coordinator, loop: LoopAccess, registry: ParamRegistry,
                 options: ReduceOptions, step: Callable[[Params], None],
                 zero: Callable[[Params, bool], None], lane: Lane) -> None:
        self.coord, self.loop, self.registry = coord, loop, registry
        self.grad_lane = lane
        self._cut_by_choice = options.caps.partition is None  # the reducer may pick it
        self.options = options = self._resolved(options)
        self.on_gpu = registry.device.type == "cuda"
        if self.on_gpu and group_of(lane) is None:
            raise NotImplementedError(
                f"CUDA parameters ({registry.device}) need the NCCL path: every rank with a "
                f"GPU of its own and torch with NCCL; this job's: {describe_path()}")
        self.lane: LaneCollectives = coord.lowlevel.on_lane(lane)
        self.pre, self.post = options.scales(lane.size)  # a process set's, or the world's
        self.specs = registry.specs(options.wire_dtype)
        self.generation, self.rounds, self.passes = 0, 0, options.passes
        self.plan = self._plan(list(reversed(range(len(registry)))), None)
        self.storage = GradStorage(self.plan, registry, grouped=self._horovod_groups())
        assert options.window_bytes is not None  # resolved
        self.scheduler = Scheduler(coord.lowlevel.engine, lane, options.window_bytes)
        self.bucketer = Bucketer(registry, self.storage, self._new_run, self._notify)
        self.bucketer.scale = self.pre
        self.bucketer.on_loop_thread = loop.on_loop_thread
        self.replan_due = options.replan
        self.broken: BaseException | None = None  # a failed bucket desynchronizes the channel
        self.transport: CheckedRounds | None = None  # a round path: shared memory or gloo
        self._retired_counts = (0, 0)  # buckets of transports replaced by a re-plan
        self._previous: StepRun | None = None  # the last closed round
        self.storage.writable = self._writable
        self._zero, self._step = zero, step
        self.settings: list[dict[str, Any]] | None = None  # the groups' at the last step()
        self.shards: Shards | None = None  # sharded: this rank's pieces, in the node window
        self._shard_with: tuple[torch.optim.Optimizer, type[torch.optim.Optimizer]] | None = None
        self.updates = Updates(registry.params, self.unpack, self._apply, self._zero_grads,
                               loop.on_loop_thread, registry.describe)
        # a gradient lane of its own (not the coordinator's first, not a process set's)
        self.held = Held(coord, lane, lane in coord.lowlevel.more_grad_lanes)
        self.bucketer.register()
        _live.add(self)

    def _resolved(self, options: ReduceOptions) -> ReduceOptions:
        """Options with the lane's choices made where they were left to it (None).

        On Horovod's transport tensors are not cut and the credit window has no bound.
        Horovod fuses each bucket it is handed and runs them one after the other on its
        own thread, in its own cycles: the parts of a cut tensor are ready at the same
        moment, so cutting there only multiplies Horovod's responses (a negotiation and
        a collective each), and a bucket the window holds back waits for a later cycle.
        Elsewhere tensors are cut so front layers go first, within a 16 MiB window."""
        horovod = self._horovod_groups()
        if options.caps.partition is None:
            options = replace(options, caps=replace(options.caps, partition=not horovod))
        if options.window_bytes is None:
            options = replace(options, window_bytes=_UNBOUNDED if horovod else 16 * MiB)
        return options

    def _plan(self, order: list[int], launch: Any, caps: Caps | None = None) -> Plan:
        return build_plan(order, self.specs, caps or self.options.caps,
                          groups=self.options.groups, launch=launch)

    def _new_run(self) -> StepRun:
        self.rounds += 1
        handed = self.storage.handed
        if handed is not None and self.storage.grouped:
            self.storage.handed = handed.fresh()  # the last round's may still launch
        elif handed is not None:
            handed.clear()  # nothing of an earlier (maybe failed) round
        return StepRun(self.rounds, self.generation, self.plan, self.storage, self.passes,
                       len(self.registry), self.transport)

    def _notify(self, run: StepRun, k: int) -> None:
        """Bucket k is packed (hook thread): shared memory takes it directly, an
        allreduce goes through the scheduler on the loop (a CUDA bucket once the
        hooks' copies into it, queued on this thread's stream, are done)."""
        if self.on_gpu:
            run.ready_events[k] = record(run.storage.comm[k])
        if run.transport is not None:
            run.transport.packed(run, k)
        else:
            self.loop.call_soon(partial(self.scheduler.ready, run, k))

    def bucket_counts(self) -> tuple[int, int]:
        """Buckets launched and completed so far, whichever way they went."""
        s, t = self.scheduler.statistics(), self.transport
        launched, completed = self._retired_counts
        if t is not None:
            launched, completed = launched + t.launched, completed + t.completed
        return s.launched + launched, s.completed + completed

    def _apply(self, params: Params) -> None:
        """The consumer's optimizer step; sharded, the pipeline already updated them."""
        if self.shards is None:
            self._step(params)

    # -- sharding (`shard`) ----------------------------------------------------------
    def shard_after_replan(self, optimizer: torch.optim.Optimizer,
                           base: type[torch.optim.Optimizer]) -> None:
        """Shard `optimizer` (of class `base`) once round 1 is applied on the agreed plan."""
        self._shard_with = (optimizer, base)

    def start_shards(self) -> None:
        """Round 1's update is in: parameters and state move into the node's window."""
        if self._shard_with is not None:
            self.shards = start_sharding(self, *self._shard_with)

    def unshare(self) -> None:
        """Private parameters and state again (before the window goes away)."""
        shards, self.shards = self.shards, None
        if shards is not None:
            shards.unshare()

    def begin_update(self, optimizer: torch.optim.Optimizer) -> None:
        """A `step()` of the closed round: keep the groups' settings for its (maybe
        deferred) update, and hand them to the shards, which may now update."""
        self.settings = hyperparameters(optimizer)
        if self.shards is not None:
            hand_round(self, self.shards)

    def skip_update(self, run: StepRun, mode: Finish) -> None:
        """Sharded: finish a synchronized round that gets no `step()`, without an update."""
        if self.shards is not None:
            self.shards.hand_skip()
            _wake_pipeline(self)
        self.finish(run, mode)

    def close_step(self, optimizer: torch.optim.Optimizer) -> StepRun:
        """`step()`: close the round (the last deferred one lands with its own settings)."""
        run = self.close_round()
        self.begin_update(optimizer)
        return run

    def _zero_grads(self, params: Params, set_to_none: bool) -> None:
        if not set_to_none:
            self._writable()  # zeroing in place writes into (maybe shared) buffers
        self._zero(params, set_to_none)

    def quiesce(self) -> None:
        """Apply deferred updates and let the last round finish everywhere."""
        if self.broken is None and not self.coord._closed:
            self.updates.flush()
            self._writable()
        self.unshare()

    def remove(self) -> None:
        self.bucketer.remove()
        if self.transport is not None:
            self.transport.close()

    # -- agreement ------------------------------------------------------------------
    async def check_signature(self) -> None:
        """Every rank must reduce the same parameters the same way: compare once.

        Bucket ops are header-checked too, but a mismatch found here names
        its cause and leaves the gradient channel untouched.
        """
        mine = (self.registry.signature(), self.options.fingerprint())
        sigs = await self.lane.allgather_object(mine, name="grad.signature")
        if any(s[0] != sigs[0][0] for s in sigs):
            detail = "; ".join(f"rank {r}: {n} parameters (crc {c:#x})" for r, ((n, c), _) in
                               enumerate(sigs))
            raise MismatchError("ranks reduce different parameters (names, shapes or dtypes "
                                f"differ; check named_parameters and the model): {detail}")
        if any(s[1] != sigs[0][1] for s in sigs):
            detail = "; ".join(f"rank {r}: {o}" for r, (_, o) in enumerate(sigs))
            raise MismatchError(f"ranks use different gradient reduction options: {detail}")

    # -- end of backward -----------------------------------------------------------
    def close_round(self) -> StepRun:
        """Backward is over for this step: launch every bucket still missing."""
        if self.broken is not None:
            raise self.broken
        self.updates.flush()  # a deferred update must land before its gradient is reused
        run = self.bucketer.close()
        self.bucketer.trace.closed()
        self._previous = run
        return run

    # -- consumer side -------------------------------------------------------------
    def wait(self, run: StepRun, k: int) -> None:
        """Block this (non-loop) thread until bucket k is in, reporting stalls."""
        event = run.done[k]
        if event.is_set():
            return
        if self.loop.on_loop_thread():
            raise RuntimeError("waiting for a gradient bucket on the event loop thread would "
                               "block the loop; run this forward/step in a worker thread "
                               "(`await step.forward(...)`) or turn forward gating off")
        self._wait_reporting(run, k)

    def _wait_reporting(self, run: StepRun, k: int) -> None:
        self._block(run.done[k], lambda: self.describe(run, k))

    def wait_for(self, event: threading.Event, what: Callable[[], str]) -> None:
        """Block this (non-loop) thread on `event`, reporting stalls with `what()`."""
        self._block(event, what)

    def _block(self, event: threading.Event, what: Callable[[], str]) -> None:
        start, report_at = time.monotonic(), self.options.stall_s
        deadline = self.options.timeout_s
        while not event.wait(0.5):
            waited = time.monotonic() - start
            if deadline is not None and waited >= deadline:
                raise CollectiveTimeout(f"timed out after {waited:.0f}s: {what()}")
            if waited >= report_at:
                log.warning("asynclock stall: after %.0fs, %s", waited, what())
                report_at *= 2

    def _writable(self) -> None:
        """Shared buffers: wait until no rank reads the previous round from ours."""
        prev = self._previous
        if prev is not None and not prev.released.is_set():
            self._block(prev.released, lambda: (
                f"rank {self.coord.rank} waits for round {prev.number} to be released by "
                "every rank before reusing its shared gradient buffers"))

    def describe(self, run: StepRun, k: int) -> str:
        """Stall text: what this rank waits for and what it is itself missing."""
        missing = [self.registry.describe(i) for i in run.plan.buckets[k].params
                   if not run.final[i]]
        stats = self.scheduler.statistics()
        text = (f"rank {self.coord.rank} waits for gradient bucket {k} (round {run.number}, "
                f"plan g{run.generation}, {run.transport.what if run.transport else 'allreduce'} "
                f"'grad.g{run.generation}.b{k}')")
        if missing:
            return text + f"; this rank never produced gradients for: {', '.join(missing[:5])}"
        shared = run.transport.describe() if run.transport is not None else ""
        if shared:
            return f"{text}; {shared}"
        if self.scheduler.checking(run):
            return text + ("; the round's plan check is in flight: the other ranks have not "
                           "reached this round's backward")
        return text + (f"; launched {run.next}/{run.size} buckets here, {stats.in_flight} in "
                       "flight: the other ranks have not joined this allreduce")

    def unpack(self, run: StepRun, k: int) -> None:
        """Wait for bucket k and make its values the gradients (once per round)."""
        if run.unpacked[k]:
            return
        self.wait(run, k)
        error = run.errors[k]
        if error is not None:
            self.broken = error
            raise error
        with unpack_span(k):
            if run.done_events[k] is not None:  # NCCL wrote it: wait by stream, not host
                stream_wait(None, run.done_events[k])
            run.storage.unpack(k, 1.0 if run.transport is not None else self.post, run.buffers)
        run.unpacked[k] = True
        for i in run.plan.buckets[k].params:
            run.buckets_left[i] -= 1

    def complete(self, run: StepRun) -> None:
        """Unpack every bucket in launch order; the first failure is raised at once.

        Failures are collective (the header round decides them), so every
        rank raises the same error at the same bucket, and nobody waits for
        a later bucket that another rank might never launch.
        """
        for k in run.plan.launch:
            self.unpack(run, k)
        self._block(run.released, lambda: f"rank {self.coord.rank} waits for the release "
                    f"barrier of round {run.number}")  # callers may write .grad after this
        if run.release_error is not None:
            self.broken = run.release_error
            raise run.release_error

    # -- the one-time re-plan ------------------------------------------------------
    def maybe_replan(self, run: StepRun) -> bool:
        """After the first complete round: adopt rank 0's observed order everywhere
        (True when it did so now)."""
        if not self.replan_due:
            return False
        self.replan_due = False
        mine = (self._proposal(run) if self.grad_lane.rank == 0 else None,
                self.options.shm and not self.on_gpu and eligible(self.coord, self.grad_lane),
                self._gloo_min_bytes())
        try:
            every = self.loop.run(partial(self.lane.allgather_object, mine, name="grad.plan"))
        except JoinedError:  # a rank joined before its first round: re-plan when all are back
            self.replan_due = True
            return False
        order, launch = every[0][0]
        shm = all(ok for _, ok, _ in every)
        # rank 0 timed round 1's allreduces; shared-memory buckets keep pace with
        # backward, so they simply go in ready order (a priority order would make
        # early buckets wait for late ones in the one-at-a-time pipeline)
        plan = self._plan(list(order), None if shm else launch)
        least = [m for _, _, m in every]
        if shm or None in least:
            self._adopt(plan, shm)
            return True
        floor = max(m or 0 for m in least)
        gloo = takes_plan(plan, floor)
        whole = (self._plan(list(order), None, replace(self.options.caps, partition=False,
                                                       gather=True))
                 if self._cut_by_choice else None)
        if whole is not None and takes_plan(whole, floor):
            # gloo's rounds reduce a bucket that holds one whole tensor in place in the
            # tensor itself (`GradStorage.hand_in_place`); cut, a tensor's pieces would
            # share buckets with other tensors, and go as more calls for the same bytes.
            # Small tensors gather into shared buckets across the large ones
            # (`Caps.gather`): each bucket is one more gloo call
            plan, gloo = whole, True
        self._adopt(plan, False, gloo)
        return True

    def _gloo_min_bytes(self) -> int | None:
        """The smallest bucket this rank's gloo round path takes (None: no such path)."""
        if self.on_gpu or self._horovod_groups() or not settings.flag("ASYNCLOCK_GLOO_ROUNDS"):
            return None
        return bulk_min_bytes(self.grad_lane, self.coord.local_size)

    def _proposal(self, run: StepRun) -> tuple[list[int], tuple[int, ...] | None]:
        order = list(run.final_order)
        if not self.options.priority:
            return order, None
        plan = self._plan(order, None)
        ready = bucket_ready_times(plan, run.final_at)
        spans = [(a, b) for a, b in zip(run.launched_at, run.done_at, strict=True) if b > 0]
        spb = link_speed(spans, sum(b.nbytes for b in run.plan.buckets))
        if spb <= 0:
            return order, None
        return order, priority_launch(ready, [b.nbytes for b in plan.buckets],
                                      seconds_per_byte=spb)

    def _adopt(self, plan: Plan, shm: bool = False, gloo: bool = False) -> None:
        """Switch to `plan` (and, if every rank can, to shared-memory buckets, or to
        buckets over gloo that skip the loop)."""
        arena = self._make_arena(plan) if shm else None
        storage = GradStorage(plan, self.registry, arena, arena is None and self._horovod_groups())
        storage.adopt()
        storage.writable = self._writable
        if self.transport is not None:
            self.transport.close()
            launched, completed = self._retired_counts
            self._retired_counts = (launched + self.transport.launched,
                                    completed + self.transport.completed)
        engine = self.coord.lowlevel.engine
        self.transport = (
            ShmTransport(engine, self.grad_lane, arena, plan, storage.peers, self.post,
                         self.loop.call_soon, storage.handed) if arena is not None else
            GlooRounds(engine, self.grad_lane, self._gloo_group(), plan, self.post,
                       self.loop.call_soon) if gloo else None)
        # one pass a step: earlier passes accumulate in the buffer (`GradStorage.accumulate`)
        storage.hand_in_place = gloo and self.passes == 1
        if self.transport is not None:
            self.held.transports.append(self.transport)
        self.plan, self.storage = plan, storage
        self.bucketer.storage = storage
        self.generation += 1

    def _gloo_group(self) -> PGGroup:
        """The gloo round path's own group, connected now (every rank adopts the plan
        together, in this thread, which may block; the loop runs on)."""
        group: PGGroup = self.loop.run(partial(
            making.make, self.coord.lowlevel.engine, self.grad_lane, "gloo rounds",
            lambda: rounds_group(self.grad_lane, self.generation + 1),
            discard=PGGroup.abort))
        return group

    def _make_arena(self, plan: Plan) -> SharedArena | None:
        """The plan's shared window: MPI's, or a mapped file where there is no MPI world."""
        if mpi_window(self.coord, self.grad_lane):
            return self._make_mpi_arena(plan)
        return self._make_file_arena(plan)

    def _make_mpi_arena(self, plan: Plan) -> SharedArena:
        """Made as an agreed call on the gradient lane (`engine.making`): checked against
        every rank's call, then made on the lane's wait thread from its data
        communicator, which nothing else uses meanwhile."""
        comm = getattr(self.grad_lane.transport, "data", None)
        sizes = self._group_bytes(plan)
        arena: SharedArena = self.loop.run(partial(
            making.make, self.coord.lowlevel.engine, self.grad_lane, "shm window",
            lambda: SharedArena.over_mpi(comm, sizes), discard=SharedArena.close))
        return arena

    def _make_file_arena(self, plan: Plan) -> SharedArena | None:
        """A file in /dev/shm that every rank maps (`node_segment.share_file`), through
        two checked collectives on the lane; None on every rank when any rank lacks it."""
        sizes = self._group_bytes(plan)
        rank, size = self.grad_lane.rank, self.grad_lane.size
        nbytes = file_bytes(size, sizes)
        names = iter(("grad.shm.file", "grad.shm.mapped"))

        def allgather(obj: Any) -> list[Any]:
            every: list[Any] = self.loop.run(partial(self.lane.allgather_object, obj,
                                                     name=next(names)))
            return every

        mapping, missing = share_file(rank, nbytes, "grads", allgather)
        if mapping is not None:
            return SharedArena.over_file(rank, size, mapping, sizes)
        if rank == 0 and missing is None:
            log.warning("gradient buckets stay on the transport: no file of %d MiB fits in "
                        "/dev/shm (%d MiB free)", nbytes >> 20, free_bytes() >> 20)
        elif rank == 0:
            log.warning("gradient buckets stay on the transport: ranks %s could not map "
                        "the /dev/shm file", missing)
        return None

    def _horovod_groups(self) -> bool:
        """The lane's transport takes buckets as groups of handed tensors (`grouped`)."""
        return hasattr(self.grad_lane.transport, "iallreduce_grouped")

    def _group_bytes(self, plan: Plan) -> dict[str, int]:
        size = {s.group: s.itemsize for s in self.specs}
        return {g: n * size[g] for g, n in plan.group_numel.items()}

    # -- finishing a round -------------------------------------------------------
    def finish(self, run: StepRun, mode: Finish) -> None:
        """Apply the round's updates: whole, per bucket, or deferred (gated forward).

        The first round is always finished whole: it is the profiling round
        the agreed plan is built from.
        """
        if self.replan_due or mode is Finish.WHOLE:
            self.complete(run)
            replanned = self.maybe_replan(run)
            self.updates.whole(run)
            if replanned:
                self.start_shards()
        elif mode is Finish.PER_BUCKET:
            self.updates.per_bucket(run)
        else:
            self.updates.defer(run)

    def synchronize(self) -> StepRun:
        """Horovod's `synchronize()`: every gradient reduced, nothing applied."""
        run = self.close_round()
        self.complete(run)
        self.maybe_replan(run)
        return run


# -- the sharded optimizer's steps (`shard_optimizer=True`; the state lives in `shard`) --
def check_shard_transport(coord: Any, lane: Any, options: ReduceOptions) -> None:
    """Sharding lives in the shared-memory window: say at once when there is none."""
    if not (options.shm and options.replan and eligible(coord, lane)
            and mpi_window(coord, lane)):
        raise ValueError("shard_optimizer=True needs the shared-memory window: every rank "
                         "on one node, the MPI backend with MPI_THREAD_MULTIPLE, and "
                         "Tuning(shm=True, replan=True) (ASYNCLOCK_NODE_WINDOW not 0)")


def start_sharding(reducer: Reducer, optimizer: torch.optim.Optimizer,
                   base: type[torch.optim.Optimizer]) -> Shards:
    """After round 1 (applied whole, every rank alike): move parameters and state
    into the node's window; the pipeline updates this rank's pieces from now on."""
    transport = reducer.transport
    if (not isinstance(transport, ShmTransport) or transport.pipeline is None
            or transport.arena is None):
        raise RuntimeError("shard_optimizer=True: not every rank could use the shared-"
                           "memory window, so the optimizer cannot be sharded")
    node, plan, flat = transport.arena.node, reducer.plan, reducer.storage.flat
    # its window is made as an agreed call on the gradient lane (`engine.making`), on the
    # lane's wait thread while this thread waits for it
    shards: Shards = reducer.loop.run(partial(
        making.make, reducer.coord.lowlevel.engine, reducer.grad_lane, "shard window",
        lambda: Shards(node, optimizer, base, reducer.registry, plan, flat)))
    shards.switch()
    transport.pipeline.shard = shards
    return shards


def hand_round(reducer: Reducer, shards: Shards) -> None:
    """A round's `step()`: its settings to the pipeline, which may now update."""
    shards.hand_hyper()
    _wake_pipeline(reducer)


def sync_shards(reducer: Reducer, shards: Shards) -> StepRun:
    """Sharded `synchronize()`: close the round and wait until every rank holds the
    whole averaged gradient in `.grad` (the update still waits for `step()`)."""
    run = reducer.close_round()
    request = shards.request_sync(run.number)
    _wake_pipeline(reducer)
    reducer.wait_for(request.done, lambda: (
        f"synchronize() of round {run.number} waits for every rank's reduced chunks "
        "(sharded optimizer)"))
    shards.forget_sync(run.number)
    if request.error is not None:
        reducer.broken = request.error
        raise request.error
    return run


def _wake_pipeline(reducer: Reducer) -> None:
    transport = reducer.transport
    if isinstance(transport, ShmTransport) and transport.pipeline is not None:
        transport.pipeline.wake()
