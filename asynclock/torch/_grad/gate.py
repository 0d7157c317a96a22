"""Layer-gated forward: start the next forward before every bucket is in.

A forward pre-hook on each module that owns reduced parameters applies the
deferred update of those parameters (waiting only for their buckets) right
before the module runs. Front layers' buckets are launched first under the
priority plan, so the forward walks through the network roughly as their
gradients arrive, instead of waiting for the whole model.

Results are bit-identical to the ungated path as long as every parameter is
used through its owning module (the usual case). A parameter used directly
by another module (e.g. tied weights read via `other.weight`) may be read
before its update; when its gradient then arrives with the update still
pending, backward raises on every rank (`Updates.before_gradient`) rather
than train on the stale value; turn gating off for such models. (A parameter
that two modules both own, the usual way to tie weights, is applied by the
first of them to run.) The next `step()`, `state_dict()` and explicit
flushes apply whatever is still pending.

Under torch.compile the hooks run eagerly (`eager`), and code compiled
before they existed is dropped (`forget_compiled_code`): Dynamo does not
guard on module hooks and would keep running code that skips them.

Waiting blocks the thread that runs forward, so while updates are deferred
the forward must not run on the event-loop thread: under the async API use
`await step.forward(...)` (or `await step.flush()` first). Whether updates
are deferred depends only on program order (set when a step ends, cleared
once all are applied), never on timing, so this rule fails the same way
every time.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from .apply import Updates
from .compile_exempt import eager, forget_compiled_code
from .registry import ParamRegistry


def check_gate_covers(model: torch.nn.Module, registry: ParamRegistry) -> None:
    """Every reduced parameter needs a module in `model` whose pre-hook applies
    its update; one outside it would be read before its update, silently.
    Called before any hook is registered, so a refusal leaves nothing behind."""
    owned = {id(p) for p in model.parameters()}
    stray = [registry.names[i] for i, p in enumerate(registry.params) if id(p) not in owned]
    if stray:
        raise ValueError(f"gate_forward: parameters {stray[:5]}{' ...' if len(stray) > 5 else ''}"
                         " are not in the gated model, so nothing would apply their deferred "
                         "update before they are read: pass the model that holds every "
                         "parameter of the optimizer, or no gate")


class ForwardGate:
    """Forward pre-hooks on every module that owns reduced parameters."""

    def __init__(self, model: torch.nn.Module, registry: ParamRegistry,
                 updates: Updates) -> None:
        self.updates = updates
        self.enabled = True
        self._handles: list[Any] = []
        forget_compiled_code()  # before `eager` below imports Dynamo itself
        for module in model.modules():
            own = registry.indices(module.parameters(recurse=False))
            if own:
                self._handles.append(module.register_forward_pre_hook(
                    eager(partial(self._pre, own))))

    @property
    def modules(self) -> int:
        return len(self._handles)

    def _pre(self, own: list[int], module: torch.nn.Module, args: Any) -> None:
        if self.enabled:
            self.updates.ensure(own)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
