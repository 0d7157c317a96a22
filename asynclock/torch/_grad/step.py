"""The async train step: overlap backward, communication and side tasks.

    step = coord.train_step(optimizer)
    async with step:
        loss = loss_fn(model(x), y)
        await step.backward(loss)      # backward in a worker thread
    # leaving the block: buckets waited for, optimizer applied, grads zeroed

Backward runs in a worker thread, so the event loop (and every side task on
it: evaluation, logging, prefetch) stays live while hooks launch buckets.
Waiting for buckets and applying the optimizer also happen in a worker
thread. With `gate_forward=True` the block returns as soon as every bucket
is launched, and the next `await step.forward(fn, ...)` updates each layer
just before it runs.

Cancellation: once backward started on a rank, the round is part of every
rank's collective sequence, so leaving the block (by cancellation or an
error) still finishes it, shielded, and applies the update like the other
ranks do; the cancellation or error is re-raised afterwards. A block left
before any backward starts no collective at all.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import torch

from ..._core.base.ops import ReduceOp
from ..._core.runtime.coordinator import Coordinator
from .apply import only, settings_of
from .compression import Compression
from .gate import ForwardGate, check_gate_covers
from .loop_access import running_loop
from .options import Tuning, build_options
from .reducer import Finish, Params, Reducer, check_shard_transport, gradient_lane
from .registry import ParamRegistry
from .shard import check_shardable

log = logging.getLogger("asynclock.torch")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TrainStepStatistics:
    """Exact counters of one optimizer's reducer (`step.statistics()`).

    Attributes:
        steps: `async with step:` blocks finished.
        rounds: gradient rounds (reductions of every bucket) started.
        buckets: buckets in the current plan.
        plan_generation: how often the bucket layout was planned (re-plans included).
        launched: buckets launched so far.
        completed: buckets reduced so far.
        in_flight_bytes: bucket bytes in flight now (bounded by `Tuning.window_mb`).
        deferred_pending: whether a gated update waits to be applied.
        updates_applied: optimizer updates applied (one per bucket where updates are).
    """

    steps: int
    rounds: int
    buckets: int
    plan_generation: int
    launched: int
    completed: int
    in_flight_bytes: int
    deferred_pending: bool
    updates_applied: int


class TrainStep:
    """Reusable per optimizer; each `async with` block is one optimizer step.

    Made by `coord.train_step(optimizer, **options)`. The first entry makes the
    gradient channel and the hooks, and checks parameters and options across ranks.

    Args:
        coord: the running coordinator; the step runs on its event loop.
        optimizer: the plain torch optimizer (not a `DistributedOptimizer`).
        model: the model; needed with `gate_forward=True` (its modules get the gates).
        named_parameters: `model.named_parameters()`: names for error messages and stall
            reports; names must be unique.
        op: `Average` (default) or `Sum`.
        compression: a `Compressor` for the gradients on the wire (`Compression.fp16`,
            `.bf16`).
        backward_passes_per_step: backward passes accumulated locally before each
            reduction.
        gradient_predivide_factor: Horovod's: divide by this before the sum, and by
            size/factor after.
        groups: Horovod's: an int (that many even groups) or lists of parameters reduced
            together.
        per_bucket_step: apply the optimizer to each bucket's parameters as soon as the
            bucket is reduced.
        gate_forward: leave the block once every bucket is launched; the next
            `await step.forward(model, ...)` updates each layer just before it runs.
        zero_grad: zero the gradients (to None) when the block ends.
        tuning: asynclock's own knobs (None: `Tuning()`).
        shard_optimizer: one copy of parameters and optimizer state per node (one node,
            MPI, CPU parameters, an elementwise optimizer).

    Raises:
        ValueError: on every rank alike: `optimizer` is a `DistributedOptimizer`,
            `gate_forward` without `model`, names that are not unique, groups that repeat
            a parameter, Adasum, or `shard_optimizer` with what it cannot shard.
    """

    def __init__(self, coord: Coordinator, optimizer: torch.optim.Optimizer, *,
                 model: torch.nn.Module | None = None, named_parameters: Any = None,
                 op: Any = ReduceOp.AVERAGE, compression: Any = Compression.none,
                 backward_passes_per_step: int = 1, gradient_predivide_factor: float = 1.0,
                 groups: Any = None, per_bucket_step: bool = False, gate_forward: bool = False,
                 zero_grad: bool = True, tuning: Tuning | None = None,
                 shard_optimizer: bool = False) -> None:
        if hasattr(optimizer, "_reducer"):
            raise ValueError("pass the plain torch optimizer, not a DistributedOptimizer")
        if shard_optimizer:
            check_shardable(optimizer, compressed=compression not in (None, Compression.none),
                            process_set=None, groups=groups)
        if gate_forward and model is None:
            raise ValueError("gate_forward=True needs model=... (its modules get the gates)")
        self.coord, self.optimizer, self.model = coord, optimizer, model
        self.registry = ParamRegistry(optimizer.param_groups, named_parameters)
        self.options = build_options(self.registry, op=op, compression=compression,
                                     backward_passes_per_step=backward_passes_per_step,
                                     gradient_predivide_factor=gradient_predivide_factor,
                                     groups=groups, tuning=tuning or Tuning(),
                                     gated=gate_forward)
        self.loop = running_loop()
        self.mode = (Finish.DEFERRED if gate_forward else
                     Finish.PER_BUCKET if per_bucket_step else Finish.WHOLE)
        self._reducer: Reducer | None = None
        self.gate: ForwardGate | None = None
        self.zero_grad = zero_grad
        self._inside = False
        self._backwards = 0
        self._steps = 0
        self.closed = False
        self._shard_wanted = shard_optimizer

    @property
    def reducer(self) -> Reducer:
        """The reducer (plan, scheduler) behind this step.

        Raises:
            RuntimeError: the step has not been entered yet.
        """
        if self._reducer is None:
            raise RuntimeError("the train step has not been entered yet (`async with step:`)")
        return self._reducer

    async def _build(self) -> None:
        """First entry: a channel (an agreed make, `Coordinator.lowlevel.make_lanes`, waited for
        from a worker thread), the hooks, and the cross-rank agreement on parameters
        and options."""
        model = None
        if self.mode is Finish.DEFERRED:
            assert self.model is not None
            model = self.model
            check_gate_covers(model, self.registry)
        lane = await anyio.to_thread.run_sync(gradient_lane, self.coord)
        self._shard_wanted = self._shard_wanted and lane.size > 1  # one rank: nothing to share
        if self._shard_wanted:
            check_shard_transport(self.coord, lane, self.options)
        reducer = Reducer(self.coord, self.loop, self.registry, self.options,
                          self._step_params, self._zero_params, lane)
        self._reducer = reducer
        reducer.held.watch(self.optimizer)  # its threads and windows end when it is dropped
        if self._shard_wanted:
            reducer.shard_after_replan(self.optimizer, type(self.optimizer))
        try:
            if model is not None:  # off the loop: it may import Dynamo, which is slow
                await anyio.to_thread.run_sync(self._make_gate, model, reducer)
                reducer.bucketer.before = reducer.updates.before_gradient
            await reducer.check_signature()
        except BaseException:
            self.close()
            raise

    def _make_gate(self, model: torch.nn.Module, reducer: Reducer) -> None:
        """Set `gate` in the worker thread itself: a cancelled wait for it then
        still leaves the hooks where `close` finds them."""
        self.gate = ForwardGate(model, self.registry, reducer.updates)

    def close(self) -> None:
        """Remove every hook; the optimizer and model are plain torch again (sharded:
        private parameters and state again, unless a gated update is still pending:
        `await step.flush()` first)."""
        if self._reducer is not None and self._reducer.updates.pending is None:
            self._reducer.unshare()
        if self._reducer is not None:
            self._reducer.remove()
        if self.gate is not None:
            self.gate.remove()
        self.closed = True

    # -- applying updates (called by the reducer in a worker thread) -------------------
    def _step_params(self, params: Params) -> None:
        with only(self.optimizer, params), settings_of(self.optimizer, self.reducer.settings):
            self.optimizer.step()

    def _zero_params(self, params: Params, set_to_none: bool) -> None:
        with only(self.optimizer, params):
            self.optimizer.zero_grad(set_to_none)

    # -- the block ------------------------------------------------------------------
    async def __aenter__(self) -> TrainStep:
        if self._inside:
            raise RuntimeError("this train step is already open; steps of one optimizer "
                               "do not nest")
        if self.closed:
            raise RuntimeError("this train step was closed; call coord.train_step() again")
        if self._reducer is None:
            await self._build()
        self._inside, self._backwards = True, 0
        return self

    async def backward(self, loss: torch.Tensor, gradient: torch.Tensor | None = None,
                       retain_graph: bool | None = None) -> None:
        """`loss.backward()` in a worker thread; buckets launch as gradients arrive.

        Args:
            loss: the loss tensor.
            gradient: passed to `loss.backward` (for a non-scalar loss).
            retain_graph: passed to `loss.backward`.
        """
        self._backwards += 1
        await anyio.to_thread.run_sync(partial(loss.backward, gradient, retain_graph))

    async def forward(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` (e.g. the model) in a worker thread.

        Needed with `gate_forward=True`: a gated layer may wait for its
        buckets, which must not block the event loop.

        Args:
            fn: the function to run, typically the model.
            *args: passed to `fn`.
            **kwargs: passed to `fn`.

        Returns:
            What `fn` returns.
        """
        result: T = await anyio.to_thread.run_sync(partial(fn, *args, **kwargs))
        return result

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally; the block's end reduces once.

        Yields:
            Nothing; the block runs with reduction off.

        Raises:
            RuntimeError: the step has not been entered yet.
        """
        self.reducer.bucketer.no_sync_depth += 1
        try:
            yield
        finally:
            self.reducer.bucketer.no_sync_depth -= 1

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._reducer is None:
            return
        try:
            started = self._backwards > 0 or self.reducer.bucketer.active is not None
            if exc_type is not None and not started:
                return  # nothing was launched on this rank: no collective to finish
            with anyio.CancelScope(shield=True):
                await self._finish_round(failing=exc_type is not None)
        finally:
            self._inside = False

    async def _finish_round(self, failing: bool) -> None:
        try:
            await anyio.to_thread.run_sync(self._finish)
        except Exception as err:
            if not failing:
                raise
            log.error("asynclock: finishing the step after an error failed too: %s", err)
        self._steps += 1

    def _finish(self) -> None:
        """Worker thread: close the round, then wait, unpack and apply per the mode."""
        self.reducer.finish(self.reducer.close_step(self.optimizer), self.mode)
        if self.zero_grad:
            self.reducer.updates.zero_grad(True)

    async def flush(self) -> None:
        """Apply updates deferred by forward gating now (e.g. before evaluation)."""
        await anyio.to_thread.run_sync(self.reducer.updates.flush)

    def statistics(self) -> TrainStepStatistics:
        """This step's exact counters; no communication.

        Returns:
            Steps, rounds, buckets and bytes in flight.

        Raises:
            RuntimeError: the step has not been entered yet.
        """
        r = self.reducer
        s = r.scheduler.statistics()
        launched, completed = r.bucket_counts()
        return TrainStepStatistics(self._steps, r.rounds, len(r.plan.buckets), r.generation,
                                   launched, completed, s.in_flight_bytes,
                                   r.updates.pending is not None, r.updates.applied)


_cache: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[Coordinator, TrainStep, dict[
    str, Any]]] = weakref.WeakKeyDictionary()


def train_step(coord: Coordinator, optimizer: torch.optim.Optimizer,
               **options: Any) -> TrainStep:
    """The train step of `optimizer` on `coord` (made once, then reused).

    Args:
        coord: the running coordinator.
        optimizer: the plain torch optimizer.
        **options: the keyword arguments of `TrainStep` (`model`, `op`, `tuning`, ...);
            a later call for the same optimizer passes the same ones, or none.

    Returns:
        The optimizer's `TrainStep` on `coord`.

    Raises:
        ValueError: the optimizer's step exists with other options, or the options
            are invalid (see `TrainStep`).
    """
    hit = _cache.get(optimizer)
    if hit is not None and hit[0] is coord and not coord._closed and not hit[1].closed:
        if options and options != hit[2]:
            raise ValueError("train_step(optimizer, ...) was already created with other options")
        return hit[1]
    step = TrainStep(coord, optimizer, **options)
    _cache[optimizer] = (coord, step, options)
    return step


def close_steps_of(coord: Coordinator) -> None:
    """An elastic reset abandons `coord`: its train steps drop their hooks (the
    next `coord.train_step(optimizer)` on the new world makes a new step) and the
    gradients of the step it interrupted, which the next step would add to."""
    for optimizer, (owner, step, _options) in list(_cache.items()):
        if owner is coord and not step.closed:
            step.close()
            optimizer.zero_grad(set_to_none=True)
