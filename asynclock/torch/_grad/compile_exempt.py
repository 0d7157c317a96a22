"""Code that torch.compile must run as it is, not trace.

asynclock's hooks and SyncBatchNorm wait on locks, buckets and collectives.
Dynamo would try to trace them into a graph (warning about thread builtins
and profiler records) before breaking the graph around them; marked here,
they run eagerly and the rest of a compiled model stays compiled. Marking
imports Dynamo, which is slow, so it happens where such code is set up (a gated
optimizer, a SyncBatchNorm), not at `import asynclock.torch`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

F = TypeVar("F", bound=Callable[..., Any])


def eager(fn: F) -> F:
    """`fn`, which torch.compile calls without tracing into it."""
    return cast(F, torch.compiler.disable(fn, recursive=True))  # type: ignore[no-untyped-call]


def forget_compiled_code() -> None:
    """Drop code torch.compile made before now, if it made any.

    Dynamo does not guard on module hooks: code compiled for a model class
    before a hook was added (on any instance) keeps running without it. The
    gate's hooks apply deferred updates, so skipping them would silently
    read parameters before their update; recompiling picks them up.
    """
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()
