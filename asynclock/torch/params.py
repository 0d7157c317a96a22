"""Start every rank from rank 0's model and optimizer state (Horovod's helpers).

Async versions take the coordinator and run on its loop; the synchronous
ones (`broadcast_parameters`, `broadcast_optimizer_state`, as in
`horovod.torch`) run those on the coordinator's private loop thread. Each
tensor's broadcast is named after the parameter, so ranks whose models
differ get a `MismatchError` naming it instead of silently mixing tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .. import runtime
from ..handle import Handle


def _named_tensors(params: Any) -> list[tuple[str, torch.Tensor]]:
    """A state_dict, named_parameters() or a plain list of tensors, as Horovod takes."""
    if isinstance(params, dict):
        items: Iterable[Any] = sorted(params.items())
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (f"param.{n}", p) for n, p in enumerate(params)]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    return [(str(k), v.data if isinstance(v, torch.nn.Parameter) else v)
            for k, v in items if isinstance(v, torch.Tensor)]


async def broadcast_parameters_async(coord: runtime.Coordinator, params: Any,
                                     root_rank: int = 0) -> None:
    """Overwrite every tensor in `params` with root's, in place, all in flight at once."""
    handles: list[Handle] = []
    for name, tensor in _named_tensors(params):
        handles.append(coord.broadcast_async_(tensor, root_rank, name=name))
    for h in handles:
        await h


async def broadcast_optimizer_state_async(coord: runtime.Coordinator,
                                          optimizer: torch.optim.Optimizer,
                                          root_rank: int = 0) -> None:
    """Root's optimizer state (buffers and hyperparameters) on every rank.

    Unlike Horovod, no zero-gradient step is taken to create missing state:
    the whole state dict is broadcast and loaded, so an empty state stays
    empty everywhere and parameters never move.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state = optimizer.state_dict() if coord.rank == root_rank else None
    state = await coord.broadcast_object(state, root_rank, name="optimizer.state")
    if coord.rank != root_rank:
        optimizer.load_state_dict(state)


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """`hvd.broadcast_parameters(model.state_dict(), root_rank=0)`."""
    coord = runtime.coordinator()
    coord.run_sync(broadcast_parameters_async, coord, params, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Any = None) -> None:
    """`hvd.broadcast_optimizer_state(optimizer, root_rank=0)`."""
    coord = runtime.coordinator()
    coord.run_sync(broadcast_optimizer_state_async, coord, optimizer, root_rank)
