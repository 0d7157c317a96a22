"""Horovod's `DistributedOptimizer`, on asynclock's bucketed, overlapped reducer.

Built the way Horovod builds it (a subclass of the user's optimizer class,
created on the fly), so `isinstance(opt, torch.optim.SGD)`, LR schedulers and
`state_dict()` keep working. Hooks fire in the user's thread during
`loss.backward()` and launch buckets through the coordinator's private loop
thread; `step()` waits for the buckets and applies the optimizer.

Beyond Horovod (keyword-only): `per_bucket_step=True` applies the update
per bucket as buckets arrive; `gate_forward=model` returns from `step()` at
once and lets the next forward start on layers whose buckets are in; and
`no_sync()` accumulates gradients locally without communicating.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from ..._core.base.ops import ReduceOp, is_adasum
from ..._core.engine.operation import Lane
from ..._core.runtime import coordinator as runtime
from .._grad.apply import only, settings_of
from .._grad.gate import ForwardGate, check_gate_covers
from .._grad.loop_access import private_loop
from .._grad.options import Tuning, build_options
from .._grad.reducer import (
    Finish,
    Params,
    Reducer,
    check_shard_transport,
    gradient_lane,
    sync_shards,
)
from .._grad.registry import ParamRegistry
from .._grad.shard import Shards, check_shardable, refuse_unsharded
from .._grad.step_run import StepRun
from .._grad.tracing import step_span, trace_module

ZERO_GRAD_RACE = ("optimizer.zero_grad() was called after loss.backward() but before "
                  "optimizer.step() or optimizer.synchronize(). This is prohibited as it can "
                  "cause a race condition.")
STEP_AFTER_SYNC = ("optimizer.step() called without optimizer.skip_synchronize() context after "
                   "optimizer.synchronize(). This can cause training slowdown. You may want to "
                   "consider using optimizer.skip_synchronize() context if you use "
                   "optimizer.synchronize() in your code.")


class _DistributedOptimizer(torch.optim.Optimizer):
    """Methods copied into the dynamic subclass of the user's optimizer class."""

    _base_class: type[torch.optim.Optimizer]

    def __init__(self, params: Any, named_parameters: Any, options: dict[str, Any],
                 tuning: Tuning, mode: Finish, gate_model: torch.nn.Module | None,
                 process_set: Any = None, shard: bool = False) -> None:
        self._base_class.__init__(self, params)  # type: ignore[call-arg]
        registry = ParamRegistry(self.param_groups, named_parameters)  # refuses duplicates
        self._recipe = _Recipe(registry, options, tuning, gate_model, process_set, shard)
        self._mode = mode
        self._attach()
        _OPTIMIZERS[next(_made)] = self

    def _attach(self) -> None:
        """Hooks, a reducer and its gradient channel on the current coordinator."""
        registry, options, tuning, gate_model, process_set, shard = self._recipe
        coord = runtime.coordinator()
        opts = build_options(registry, tuning=tuning, gated=gate_model is not None, **options)
        if gate_model is not None:
            check_gate_covers(gate_model, registry)
        loop = private_loop(coord)
        lane = _lane_for(coord, process_set)
        shard = shard and lane.size > 1  # one rank alone has nothing to share
        if shard:
            check_shard_transport(coord, lane, opts)
        self._reducer = Reducer(coord, loop, registry, opts, self._step_params, self._zero_params,
                                lane)
        self._reducer.held.watch(self)  # its threads and windows end when it is dropped
        self._shard_wanted = shard
        self._synced: StepRun | None = None  # sharded: synchronized, not yet stepped
        if shard:
            self._reducer.shard_after_replan(self, self._base_class)
        self._should_synchronize = True
        self._synchronized = False
        self._gate: ForwardGate | None = None
        self._traced: list[Any] = []
        try:
            if gate_model is not None:
                self._gate = ForwardGate(gate_model, registry, self._reducer.updates)
                self._traced = trace_module(gate_model)
                self._reducer.bucketer.before = self._reducer.updates.before_gradient
            coord.lowlevel.run_sync(self._reducer.check_signature)
        except BaseException:
            self._remove_hooks()
            raise

    def _leave_world(self) -> None:
        """The world is being re-formed (`hvd.elastic`): drop the hooks and the reducer,
        whose channel dies with the old coordinator; the state stays."""
        self._remove_hooks()
        self._gate, self._traced = None, []
        self._base_class.zero_grad(self, True)  # the interrupted step's would add to the next

    def _join_world(self) -> None:
        """The re-formed world stands: a reducer on its coordinator, with a new gradient
        channel, a plan for the new world size and its first round's layout guess."""
        process_set = self._recipe.process_set
        if process_set is not None and getattr(process_set, "process_set_id", 0) != 0:
            raise ValueError("a DistributedOptimizer over a process set does not carry "
                             "across an elastic reset: its ranks changed")
        self._attach()

    def _remove_hooks(self) -> None:
        for handle in self._traced:
            handle.remove()
        self._reducer.remove()
        if self._gate is not None:
            self._gate.remove()

    # -- applying updates (called by the reducer) --------------------------------------
    def _step_params(self, params: Params) -> None:
        with step_span(), settings_of(self, self._reducer.settings):
            if len(params) == len(self._reducer.registry.params):
                self._base_class.step(self)
                return
            with only(self, params):
                self._base_class.step(self)

    def _zero_params(self, params: Params, set_to_none: bool) -> None:
        with only(self, params):
            self._base_class.zero_grad(self, set_to_none)

    # -- Horovod's API ---------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every gradient is reduced (launching whatever did not launch).

        Sharded, too: every rank's chunks are copied back, so `.grad` is the whole
        average (to clip it in place); the update itself waits for `step()`."""
        self._skip_synchronized()
        shards = self._reducer.shards
        if shards is not None:
            self._synced = sync_shards(self._reducer, shards)
        else:
            self._reducer.synchronize()
        self._synchronized = True

    def _skip_synchronized(self) -> None:
        """Sharded: a round synchronized and never stepped (GradScaler skips `step()`
        where it finds inf or NaN) is finished without an update before the next one."""
        run, self._synced = self._synced, None
        if run is not None:
            self._reducer.skip_update(run, self._mode)

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """`step()` inside this block does not synchronize (after a manual one)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None and self._shard_wanted:
            raise refuse_unsharded("optimizer.step(closure)")
        if not self._should_synchronize:
            self._synchronized = False
            return self._step_synchronized(closure)
        if self._synchronized:
            warnings.warn(STEP_AFTER_SYNC, stacklevel=2)
        self._synchronized = False
        if self._synced is not None:  # sharded: the synchronized round, not a new one
            return self._step_synchronized(None)
        if closure is not None:
            self._reducer.synchronize()  # a backward run before step(closure)
            with step_span():
                return self._base_class.step(self, self._reduced(closure))
        if self._mode is Finish.WHOLE:
            self._reducer.synchronize()
            with step_span():
                return self._base_class.step(self)
        self._reducer.finish(self._reducer.close_step(self), self._mode)
        return None

    def _reduced(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        """The closure, then its backward's gradients reduced: the base optimizer steps
        on (and LBFGS re-evaluates with) the rank average, as it does without a closure."""
        def closure_then_reduce() -> Any:
            loss = closure()
            self._reducer.synchronize()
            return loss
        return closure_then_reduce

    def _step_synchronized(self, closure: Callable[[], Any] | None) -> Any:
        """`step()` after `synchronize()`: apply the reduced (maybe clipped) gradients."""
        run, self._synced = self._synced, None
        if self._reducer.shards is not None:
            if run is None:
                raise refuse_unsharded("optimizer.step() inside skip_synchronize() without "
                                       "synchronize() first")
            self._reducer.begin_update(self)
            self._reducer.finish(run, self._mode)
            return None
        result = self._base_class.step(self, None if closure is None else self._reduced(closure))
        if self._shard_wanted and self._reducer.transport is not None:
            self._reducer.start_shards()  # round 1, synchronized by hand, was re-planned
        return result

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._skip_synchronized()
        if self._reducer.bucketer.active is not None:
            raise AssertionError(ZERO_GRAD_RACE)
        self._reducer.updates.zero_grad(set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self._reducer.passes = passes

    # -- asynclock's additions ------------------------------------------------------------
    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate locally (like DDP's `no_sync`)."""
        self._reducer.bucketer.no_sync_depth += 1
        try:
            yield
        finally:
            self._reducer.bucketer.no_sync_depth -= 1

    def apply_pending(self) -> None:
        """Apply every update deferred by forward gating (waits for its buckets)."""
        self._reducer.updates.flush()

    def set_forward_gate(self, enabled: bool) -> None:
        """Switch layer-gated forward on or off (it needs `gate_forward=model`)."""
        if self._gate is None:
            raise ValueError("forward gating was not set up: pass gate_forward=model")
        self.apply_pending()
        self._gate.enabled = enabled
        self._mode = Finish.DEFERRED if enabled else self._plain_mode()

    def _plain_mode(self) -> Finish:
        """Sharded: `step()` waits for every bucket as its pieces are updated (the
        whole-step path would apply the user's optimizer to whole parameters)."""
        return Finish.PER_BUCKET if self._shard_wanted else Finish.WHOLE

    def state_dict(self) -> dict[str, Any]:
        """Sharded, too: the state is a view of the node's window (no rank is asked)."""
        self.apply_pending()
        return self._base_class.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.apply_pending()
        self._base_class.load_state_dict(self, state_dict)  # sharded: a hook fills the window

    @property
    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """Horovod's map from each reduced parameter to its name."""
        registry = self._reducer.registry
        return dict(zip(registry.params, registry.names, strict=True))

    @property
    def sharded(self) -> Shards | None:
        """The node's shared parameters and this rank's pieces, once sharding started."""
        return self._reducer.shards

    @property
    def reducer(self) -> Reducer:
        """The reducer (plan, scheduler statistics) behind this optimizer."""
        return self._reducer


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,  # noqa: N802
                         compression: Any = None, backward_passes_per_step: int = 1,
                         op: Any = ReduceOp.AVERAGE, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = None, *, per_bucket_step: bool = False,
                         gate_forward: torch.nn.Module | None = None,
                         tuning: Tuning | None = None, shard_optimizer: bool = False) -> Any:
    """Wrap `optimizer` so that `step()` applies gradients averaged over all ranks.

    Args:
        optimizer: the local optimizer; the result is an instance of a subclass of its
            class, over the same parameter groups (`isinstance` and LR schedulers keep
            working).
        named_parameters: `model.named_parameters()`: names for error messages and stall
            reports (None: `param.n`); names must be unique.
        compression: a `Compressor` for the gradients on the wire (None:
            `Compression.none`; `Compression.fp16`, `Compression.bf16`).
        backward_passes_per_step: backward passes accumulated locally before each
            reduction.
        op: `Average` (default), `Sum`, or `Adasum` (then Horovod's Adasum optimizer,
            which combines whole steps).
        gradient_predivide_factor: Horovod's: divide by this before the sum, and by
            size/factor after.
        num_groups: Horovod's: reduce the parameters in this many even groups together
            (0: no groups).
        groups: Horovod's: an int as `num_groups`, or lists of parameters reduced together;
            takes precedence over `num_groups`.
        sparse_as_dense: accepted for Horovod's signature: sparse gradients always
            travel dense.
        process_set: average over this added `ProcessSet`'s members only (None: all
            ranks); a rank outside it steps on its own gradients.
        per_bucket_step: apply the optimizer to each bucket's parameters as soon as the
            bucket is reduced.
        gate_forward: the model: `step()` returns at once and each layer's next forward
            waits only for its own parameters' updates.
        tuning: asynclock's own knobs (None: `Tuning()`).
        shard_optimizer: one copy of parameters and optimizer state per node (one node,
            MPI, CPU parameters, an elementwise optimizer): each rank updates only the
            chunks it reduces.

    Returns:
        The distributed optimizer. Beyond the local optimizer's methods it has
        `synchronize()`, `skip_synchronize()`, `set_backward_passes_per_step(n)` (Horovod's),
        `no_sync()`, `apply_pending()` and `set_forward_gate(enabled)`.

    Raises:
        ValueError: on every rank alike, for an invalid combination: names that are
            not unique or miss a parameter, groups that repeat or name no parameter of
            the optimizer, `shard_optimizer` with what it cannot shard, an unregistered
            or already served process set, or `torch.optim.SparseAdam`.
    """
    if is_adasum(op):
        from .adasum_optimizer import adasum_optimizer

        return adasum_optimizer(optimizer, compression)
    del sparse_as_dense  # sparse gradients always travel dense here (storage._dense)
    _refuse_sparse_only_optimizer(optimizer)
    from .._grad.compression import Compression

    if shard_optimizer:
        check_shardable(optimizer, compressed=compression not in (None, Compression.none),
                        process_set=process_set, groups=groups or num_groups)
    options = {"compression": compression or Compression.none,
               "backward_passes_per_step": backward_passes_per_step, "op": op,
               "gradient_predivide_factor": gradient_predivide_factor,
               "groups": groups if groups is not None else (num_groups or None)}
    mode = (Finish.DEFERRED if gate_forward is not None
            else Finish.PER_BUCKET if per_bucket_step or shard_optimizer else Finish.WHOLE)
    base = optimizer.__class__
    if not _member_of(process_set):
        local = type(base.__name__, (base,), dict(_OutsideTheSet.__dict__, _base_class=base))
        return local(optimizer.param_groups)
    cls = type(base.__name__, (base,), dict(_DistributedOptimizer.__dict__, _base_class=base))
    return cls(optimizer.param_groups, named_parameters, options, tuning or Tuning(), mode,
               gate_forward, process_set, shard_optimizer)


class _OutsideTheSet(torch.optim.Optimizer):
    """A rank outside the optimizer's process set steps on its own gradients, as
    in Horovod: no hooks, nothing to synchronize."""

    _base_class: type[torch.optim.Optimizer]

    def __init__(self, params: Any) -> None:
        self._base_class.__init__(self, params)  # type: ignore[call-arg]

    def synchronize(self) -> None:
        return None

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        yield

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        yield

    def set_backward_passes_per_step(self, passes: int) -> None:
        return None


def _member_of(process_set: Any) -> bool:
    """This rank belongs to `process_set` (or there is none: the world)."""
    if process_set is None or getattr(process_set, "process_set_id", 0) == 0:
        return True
    subset = getattr(process_set, "subset", None)
    return subset is None or subset.removed or bool(subset.included)


def _refuse_sparse_only_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Reduced gradients come back dense (Horovod's `sparse_as_dense=True`), which
    SparseAdam refuses at its first step; say so at once, on every rank."""
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError("DistributedOptimizer reduces sparse gradients as dense ones "
                         "(Horovod's sparse_as_dense=True), and SparseAdam takes sparse "
                         "gradients only: use torch.optim.Adam (or SGD) instead")


_SERVED: set[int] = set()  # ids of process sets whose gradient lane has an optimizer
# Live optimizers in the order they were made: after a reset each makes its gradient
# channel again, a collective that every rank must issue in the same order.
_OPTIMIZERS: weakref.WeakValueDictionary[int, _DistributedOptimizer] = (
    weakref.WeakValueDictionary())
_made = itertools.count()


class _Recipe(NamedTuple):
    """What a `DistributedOptimizer` was made from, to make its reducer again after
    an elastic reset."""

    registry: ParamRegistry
    options: dict[str, Any]
    tuning: Tuning
    gate_model: torch.nn.Module | None
    process_set: Any
    shard: bool


def leave_world() -> None:
    """Before an elastic reset: every live `DistributedOptimizer` drops its reducer."""
    for optimizer in list(_OPTIMIZERS.values()):
        optimizer._leave_world()


def join_world() -> None:
    """After an elastic reset: every live `DistributedOptimizer` gets a new reducer."""
    for optimizer in list(_OPTIMIZERS.values()):
        optimizer._join_world()


def _lane_for(coord: Any, process_set: Any) -> Lane:
    """The world's gradient lane, or a process set's own: its members average over the set.

    Members build the optimizer, in the same order; one optimizer per set, so two
    optimizers' rounds never interleave on one channel."""
    if process_set is None or getattr(process_set, "process_set_id", 0) == 0:
        return gradient_lane(coord)
    subset = getattr(process_set, "subset", None)
    if subset is None or subset.removed:
        raise ValueError(f"{process_set} is not registered: hvd.add_process_set() it first")
    if subset.ident in _SERVED:
        raise ValueError(f"process set {list(subset.ranks)} already has a DistributedOptimizer")
    _SERVED.add(subset.ident)
    lane: Lane = subset.grad_lane
    return lane

