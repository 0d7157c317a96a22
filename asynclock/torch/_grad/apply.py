"""Applying optimizer updates as reduced gradients arrive.

Three ways to finish a round, all producing the same parameters bit for
bit (an elementwise optimizer updates each parameter from its own gradient
and state only, so updating in subsets changes nothing but timing):

* whole: wait for every bucket, then one `optimizer.step()` (Horovod);
* per bucket: walk the launch order, step each parameter as soon as all of
  its buckets are in, while later buckets are still on the wire;
* deferred (layer-gated forward): return at once; a parameter is updated
  when something first needs it, i.e. its module's forward pre-hook, the
  next `step`, `state_dict` or an explicit flush (a gradient arriving
  before its update is an error: `before_gradient`).

Updates run in the consumer's thread (the user's thread, or a worker thread
under the async API), never on the event loop.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .step_run import StepRun

STALE_FORWARD = (
    "layer-gated forward: the gradient of {} arrived while its deferred update was still "
    "pending, so this step's forward read the old value: its module's forward pre-hook did "
    "not run (the parameter is used outside its own module, or the model was called through "
    "code that skips module hooks). Pass gate_forward=None (or set_forward_gate(False)) for "
    "this model")


@contextmanager
def only(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> Iterator[None]:
    """Temporarily narrow every param group to `params` (state is per parameter)."""
    keep = {id(p) for p in params}
    saved = [group["params"] for group in optimizer.param_groups]
    try:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in keep]
        yield
    finally:
        for group, ps in zip(optimizer.param_groups, saved, strict=True):
            group["params"] = ps


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every group's settings but its parameters, as they are now."""
    return [{k: v for k, v in group.items() if k != "params"}
            for group in optimizer.param_groups]


@contextmanager
def settings_of(optimizer: torch.optim.Optimizer,
                values: list[dict[str, Any]] | None) -> Iterator[None]:
    """Temporarily give the groups `values`: a deferred update applies the settings
    its round's `step()` saw, not what an LR scheduler set after it."""
    if values is None:
        yield
        return
    saved = hyperparameters(optimizer)
    try:
        for group, v in zip(optimizer.param_groups, values, strict=True):
            group.update(v)
        yield
    finally:
        for group, v in zip(optimizer.param_groups, saved, strict=True):
            group.update(v)


class Updates:
    """Tracks which parameters of a round were updated; applies the rest."""

    def __init__(self, params: list[torch.nn.Parameter], unpack: Callable[[StepRun, int], None],
                 step: Callable[[list[torch.nn.Parameter]], None],
                 zero: Callable[[list[torch.nn.Parameter], bool], None],
                 on_loop_thread: Callable[[], bool], describe: Callable[[int], str]) -> None:
        self.params = params
        self._describe = describe  # a parameter's name, dtype and shape, for errors
        self._on_loop_thread = on_loop_thread
        self._unpack, self._step, self._zero = unpack, step, zero
        self._lock = threading.RLock()
        self.pending: StepRun | None = None
        self._zero_after: bool | None = None  # set_to_none, once zero_grad was deferred
        self.applied = 0

    # -- the three ways ----------------------------------------------------------
    def whole(self, run: StepRun) -> None:
        for k in run.plan.launch:
            self._unpack(run, k)
        self._step_ready(run)

    def per_bucket(self, run: StepRun) -> None:
        for k in run.plan.launch:
            self._unpack(run, k)
            self._step_ready(run)

    def defer(self, run: StepRun) -> None:
        self.flush()
        self.pending = run

    # -- deferred updates land on demand ----------------------------------------
    def ensure(self, indices: Iterable[int]) -> None:
        """Parameters `indices` are about to be used: apply their updates first."""
        run = self.pending
        if run is None:
            return
        if self._on_loop_thread():
            raise RuntimeError(
                "updates are deferred (forward gating) and this code runs on the event loop "
                "thread, where waiting for gradient buckets would block the loop: run the "
                "forward with `await step.forward(fn, ...)`, call `await step.flush()` first, "
                "or pass gate_forward=False")
        with self._lock:
            if self.pending is not run:
                return
            needed = {k for i in indices if not run.stepped[i]
                      for k in run.plan.param_buckets.get(i, ())}
            position = run.plan.launch_position()
            for k in sorted(needed, key=position.__getitem__):
                self._unpack(run, k)
            self._step_ready(run)

    def before_gradient(self, i: int) -> None:
        """Parameter i's gradient is about to land in `.grad` (gated forward).

        Its module's forward pre-hook applies its deferred update before the
        forward reads it; still pending here means this gradient was computed
        from the old value (the hook did not run), and training on would
        silently differ from the ungated run. Every rank runs the same model,
        so every rank raises here.
        """
        run = self.pending
        if run is not None and not run.stepped[i]:
            raise RuntimeError(STALE_FORWARD.format(self._describe(i)))
        self.ensure((i,))

    def flush(self) -> None:
        """Apply every deferred update now (waits for outstanding buckets)."""
        run = self.pending
        if run is not None:
            self.ensure(range(len(self.params)))

    def zero_grad(self, set_to_none: bool) -> None:
        """Zero gradients now where updated, right after the update elsewhere."""
        with self._lock:
            run = self.pending
            done = [p for i, p in enumerate(self.params) if run is None or run.stepped[i]]
            self._zero(done, set_to_none)
            if run is not None:
                self._zero_after = set_to_none

    def _step_ready(self, run: StepRun) -> None:
        """Step every parameter whose buckets are all unpacked and not yet stepped."""
        with self._lock:
            ready = [i for i, s in enumerate(run.stepped)
                     if not s and run.buckets_left.get(i, 0) == 0]
            if not ready:
                return
            for i in ready:
                run.stepped[i] = True
            params = [self.params[i] for i in ready]
            self._step(params)
            self.applied += len(params)
            if self._zero_after is not None and run is self.pending:
                self._zero(params, self._zero_after)
            if all(run.stepped) and run is self.pending:
                self.pending, self._zero_after = None, None

