"""One step's reduction round, shared by the three sides that touch it.

* thread side (autograd hooks, under the bucketer's lock): per-parameter
  countdowns for `backward_passes_per_step` and per-bucket missing counts;
* loop side (the scheduler): which buckets are ready, launched, done;
* consumer side (the thread that waits and applies the optimizer): which
  buckets were unpacked and which parameters were updated.

Completion is published through `threading.Event`s, because the consumers
are plain threads (the user's thread under the Horovod API, a worker thread
under the async API) and must never need the event loop to wait.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .buckets import Plan
from .storage import GradStorage


class StepRun:
    """Every bucket of the plan, reduced exactly once."""

    def __init__(self, number: int, generation: int, plan: Plan, storage: GradStorage,
                 passes: int, n_params: int, transport: Any = None) -> None:
        self.number, self.generation = number, generation
        self.plan, self.storage = plan, storage
        self.handed = storage.handed  # this round's handed gradients (`grouped`)
        self.buffers = storage.round_buffers()  # what each bucket reduces this round
        self.transport = transport  # None: one allreduce per bucket; else shared memory
        n = len(plan.buckets)
        # thread side
        self.countdown = [passes] * n_params
        self.final = [False] * n_params
        self.missing = [len(b.params) for b in plan.buckets]
        self.final_order: list[int] = []
        self.final_at = [0.0] * n_params
        self.started_at = time.perf_counter()
        # CUDA buckets: the event after the hooks' copies into bucket k (hook thread),
        # and the one after its reduction (loop), which unpacking waits for by stream
        self.ready_events: list[Any] = [None] * n
        self.done_events: list[Any] = [None] * n
        # loop side
        self.ready = [False] * n
        self.next = 0
        self.launched_at = [0.0] * n
        self.done_at = [0.0] * n
        self.completed = 0
        # published results
        self.done = [threading.Event() for _ in range(n)]
        self.errors: list[BaseException | None] = [None] * n
        self.released = threading.Event()  # no rank reads our buffers for this round any more
        self.release_error: BaseException | None = None
        if transport is None or n == 0:
            self.released.set()
        # consumer side
        self.unpacked = [False] * n
        self.buckets_left = {i: len(ks) for i, ks in plan.param_buckets.items()}
        self.stepped = [False] * n_params

    @property
    def size(self) -> int:
        return len(self.plan.buckets)

    def finish(self, k: int, error: BaseException | None) -> None:
        """Bucket k completed (or failed) on this rank: on the loop (scheduler), or in
        the shared-memory pipeline's thread, which then owns the bucket alone."""
        self.done_at[k] = time.perf_counter()
        self.errors[k] = error
        self.completed += 1
        self.done[k].set()

    def release(self, error: BaseException | None) -> None:
        self.release_error = error
        self.released.set()

    def all_done(self) -> bool:
        return all(e.is_set() for e in self.done)
