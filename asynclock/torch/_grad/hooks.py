"""Thread side: autograd hooks hand gradients to buckets.

`register_post_accumulate_grad_hook` fires once a parameter's `.grad` holds
this pass's gradient, in whatever thread runs backward. The hook packs the
gradient into its bucket's buffer right there (the copy is part of
backward, off the event loop) and, when that completes a bucket, reports the
bucket to the scheduler on the loop. The only shared state is a few
counters under one lock, so a hook costs a copy plus O(1) bookkeeping.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .registry import ParamRegistry
from .step_run import StepRun
from .storage import GradStorage
from .tracing import RoundTrace, pack_span

TOO_MANY = ("Gradients were computed more than backward_passes_per_step times before call "
            "to step(). Increase backward_passes_per_step to accumulate gradients locally.")


class Bucketer:
    """Counts passes per parameter and reports complete buckets."""

    def __init__(self, registry: ParamRegistry, storage: GradStorage,
                 new_run: Callable[[], StepRun], notify: Callable[[StepRun, int], None]) -> None:
        self.registry, self.storage = registry, storage
        self._new_run, self._notify = new_run, notify
        self._lock = threading.Lock()
        self.trace = RoundTrace()  # the backward window, for the timeline
        self._run: StepRun | None = None
        self.scale = 1.0
        self.no_sync_depth = 0
        self.before: Callable[[int], None] | None = None
        self.on_loop_thread: Callable[[], bool] = lambda: False
        self._handles: list[Any] = []

    def register(self) -> None:
        # The hooks hold the bucketer weakly: torch keeps post-accumulate hooks where
        # the garbage collector cannot see them, so a strong reference would keep the
        # optimizer, its threads and windows alive for as long as the model lives.
        for i, p in enumerate(self.registry.params):
            self._handles.append(p.register_hook(  # type: ignore[no-untyped-call]
                _weakly(self._before_grad, i)))
            self._handles.append(p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                _weakly(self._on_grad, i)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @property
    def active(self) -> StepRun | None:
        """The round whose backward passes are under way, if any."""
        return self._run

    def _before_grad(self, i: int, grad: torch.Tensor) -> None:
        """Before autograd touches `.grad`.

        A gradient already launched this round must not be accumulated into
        while it travels (Horovod raises only after accumulating); and a
        deferred update must land before its gradient is reused.
        """
        if self.on_loop_thread():
            raise RuntimeError("backward runs on the event loop thread, which its gradient "
                               "buckets need: use `await step.backward(loss)`")
        run = self._run
        if run is not None and run.final[i]:
            raise AssertionError(TOO_MANY)
        if self.before is not None:
            self.before(i)
        self.storage.writable()  # autograd may accumulate into a shared buffer

    def _on_grad(self, i: int, p: torch.Tensor) -> None:
        if self.no_sync_depth:
            self.storage.accumulate(i)
            return
        with self._lock:
            run = self._run if self._run is not None else self._begin()
            if run.final[i]:
                raise AssertionError(TOO_MANY)
            run.countdown[i] -= 1
            final = run.final[i] = run.countdown[i] <= 0
        if not final:
            run.storage.accumulate(i)
            return
        with pack_span(i):
            run.storage.pack(i, self.scale, run.buffers)
        self._arrived(run, [i])

    def _begin(self) -> StepRun:
        self._run = self._new_run()
        self.trace.opened(self._run.number)
        return self._run

    def _arrived(self, run: StepRun, params: list[int]) -> None:
        """Record final gradients; report buckets that became complete."""
        complete: list[int] = []
        now = time.perf_counter()
        with self._lock:
            for i in params:
                run.final_order.append(i)
                run.final_at[i] = now - run.started_at
                for k in run.plan.param_buckets.get(i, ()):
                    run.missing[k] -= 1
                    if run.missing[k] == 0:
                        complete.append(k)
        for k in complete:
            self._notify(run, k)

    def close(self) -> StepRun:
        """End of this step's backward passes: pack whatever did not arrive.

        Parameters without a final gradient (unused on this rank, or fewer
        passes than `backward_passes_per_step`) are sent as they are, zeros
        if they have no gradient, like Horovod's `synchronize()`.
        """
        with self._lock:
            run = self._run if self._run is not None else self._begin()
            self._run = None
            left = [i for i, f in enumerate(run.final) if not f]
            for i in left:
                run.final[i] = True
        for i in left:
            run.storage.pack(i, self.scale, run.buffers)
        self._arrived(run, left)
        return run


def _weakly(method: Callable[[int, Any], Any], i: int) -> Callable[[Any], Any]:
    """`method(i, arg)` while its object lives; nothing once it is gone."""
    ref = weakref.WeakMethod(method)

    def hook(arg: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(i, arg)

    return hook
