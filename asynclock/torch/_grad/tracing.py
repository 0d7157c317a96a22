"""Timeline slices for the training path: forward, backward, pack, unpack, step.

Why here and not in the user's loop: with `ASYNCLOCK_TIMELINE` set, a
Horovod-style script should show its whole step without edits, as
Horovod's own timeline does for its collectives, and more: the forward
pass (when the optimizer knows the model), the backward window (first
gradient hook to the end of the round), each bucket's pack and unpack, and
the optimizer update. Every function is a no-op costing one attribute test
when the timeline is off.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ... import timeline
from .compile_exempt import eager


def trace_module(model: torch.nn.Module, name: str = "forward") -> list[Any]:
    """Record each call of `model` as a compute slice in the timeline.

    `asynclock.torch.DistributedOptimizer(..., gate_forward=model)` does this for
    you; call it directly for a model the optimizer does not know.

    Args:
        model: the module whose forward calls to record (while a timeline records).
        name: the slices' name in the trace.

    Returns:
        The two hook handles; `.remove()` them to stop recording.
    """
    starts: list[float] = []

    def before(_module: torch.nn.Module, _inputs: Any) -> None:
        if timeline.active() is not None:
            starts.append(time.perf_counter())

    def after(_module: torch.nn.Module, _inputs: Any, _output: Any) -> None:
        tl = timeline.active()
        if tl is not None and starts:
            tl.complete(name, "compute", starts.pop(), time.perf_counter())

    return [model.register_forward_pre_hook(eager(before)),
            model.register_forward_hook(eager(after))]


class RoundTrace:
    """The backward window of one gradient round: first hook to round close."""

    __slots__ = ("handle",)

    def __init__(self) -> None:
        self.handle = 0

    def opened(self, round_number: int) -> None:
        if not self.handle:
            self.handle = timeline.begin("backward", "compute", round=round_number)

    def closed(self) -> None:
        handle, self.handle = self.handle, 0
        timeline.end(handle)


def pack_span(param: int) -> Any:
    """A gradient's copy into its bucket (autograd thread): exposed overhead, so
    it counts as communication in the exposed-communication metric."""
    return timeline.span("pack", "comm", param=param)


def unpack_span(bucket: int) -> Any:
    return timeline.span("unpack", "comm", bucket=bucket)


def step_span() -> Any:
    return timeline.span("optimizer", "optimizer")
