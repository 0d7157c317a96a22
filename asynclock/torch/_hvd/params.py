"""Start every rank from rank 0's model and optimizer state (Horovod's helpers).

Async versions take the coordinator and run on its loop; the synchronous
ones (`broadcast_parameters`, `broadcast_optimizer_state`, as in
`horovod.torch`) run those on the coordinator's private loop thread. Each
tensor's broadcast is named after the parameter, so ranks whose models
differ get a `MismatchError` naming it instead of silently mixing tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

from ..._core.engine.handle import Handle
from ..._core.runtime import coordinator as runtime


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
    """Overwrite every tensor in `params` with root's, in place, all in flight at once.

    Args:
        coord: the running coordinator, on whose loop this runs.
        params: a `state_dict()`, `named_parameters()`, or a list of tensors (named
            `param.n`); entries that are no tensors are skipped. Each tensor's broadcast is
            named after its key, so models that differ fail with MismatchError.
        root_rank: the world rank whose values are sent.

    Raises:
        ValueError: `params` is neither a dict nor an iterable.
        MismatchError: on every rank, where the ranks' tensors differ in name, shape or
            dtype.
    """
    handles: list[Handle] = []
    for name, tensor in _named_tensors(params):
        handles.append(coord.broadcast_async_(tensor, root_rank, name=name))
    for h in handles:
        await h


async def broadcast_optimizer_state_async(coord: runtime.Coordinator,
                                          optimizer: torch.optim.Optimizer,
                                          root_rank: int = 0, model: Any = None) -> None:
    """Root's optimizer state (buffers and hyperparameters) on every rank.

    As in Horovod, a rank whose optimizer has no state yet first creates it with
    one local step on zero gradients (`create_missing_state`), so that root's
    buffers have somewhere to go; then the whole state dict (hyperparameters too,
    also for a stateless optimizer) is loaded from root's. Its tensors travel as
    tensors, each broadcast named after its place in the state dict, to a tensor on
    the device of this rank's own at that place (CUDA state: the GPU path, NCCL
    where the job has it); the rest, with each tensor's shape and dtype in its
    place, as one object.

    Args:
        coord: the running coordinator, on whose loop this runs.
        optimizer: the optimizer (a `DistributedOptimizer` too); overwritten in place.
        root_rank: the world rank whose values are sent.
        model: the model, where it has sparse embeddings: their parameters get sparse
            zero gradients when missing state is made.

    Raises:
        ValueError: the optimizer is `torch.optim.LBFGS`, whose state cannot be broadcast.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    create_missing_state(optimizer, model)
    mine = optimizer.state_dict()
    sent: list[tuple[str, torch.Tensor]] = []
    skeleton = _hollow(mine, "optimizer.state", sent) if coord.rank == root_rank else None
    skeleton = await coord.broadcast_object(skeleton, root_rank, name="optimizer.state")
    if coord.rank == root_rank:
        tensors = [(name, t.detach().contiguous()) for name, t in sent]
        state = None
    else:
        own: dict[str, torch.Tensor] = {}
        _hollow(mine, "optimizer.state", [], own)
        tensors = []
        state = _fill(skeleton, "optimizer.state", own, tensors)
    handles = [coord.broadcast_async_(t, root_rank, name=name) for name, t in tensors]
    for h in handles:
        await h
    if state is not None:
        optimizer.load_state_dict(state)


class _Slot(NamedTuple):
    """A tensor's place in the broadcast state dict: what to receive it into."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _hollow(obj: Any, path: str, found: list[tuple[str, torch.Tensor]],
            by_path: dict[str, torch.Tensor] | None = None) -> Any:
    """`obj` with every tensor (in dicts, lists and tuples) replaced by its `_Slot`;
    the tensors in order into `found`, and by path into `by_path`."""
    if isinstance(obj, torch.Tensor):
        found.append((path, obj))
        if by_path is not None:
            by_path[path] = obj
        return _Slot(tuple(obj.shape), obj.dtype)
    if isinstance(obj, dict):
        return {k: _hollow(v, f"{path}.{k}", found, by_path) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_hollow(v, f"{path}.{i}", found, by_path) for i, v in enumerate(obj))
    return obj


def _fill(obj: Any, path: str, own: dict[str, torch.Tensor],
          made: list[tuple[str, torch.Tensor]]) -> Any:
    """The skeleton with a new tensor in each `_Slot`, on the device of this rank's own
    tensor at that place (CPU where it has none); the new tensors in order into `made`."""
    if isinstance(obj, _Slot):
        like = own.get(path)
        t = torch.empty(obj.shape, dtype=obj.dtype,
                        device=like.device if like is not None else "cpu")
        made.append((path, t))
        return t
    if isinstance(obj, dict):
        return {k: _fill(v, f"{path}.{k}", own, made) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_fill(v, f"{path}.{i}", own, made) for i, v in enumerate(obj))
    return obj


def create_missing_state(optimizer: torch.optim.Optimizer, model: Any = None) -> None:
    """An optimizer without state takes one local step with every trainable
    parameter's gradient set to zeros (sparse ones where the optimizer or the
    model's sparse embeddings want them), as Horovod does before broadcasting.

    A `DistributedOptimizer` steps as its wrapped class: its own `step()` would
    reduce gradients, a collective that ranks whose state exists never join. A
    sharded one keeps its state in the node's window and is left alone.
    """
    if optimizer.state_dict()["state"] or getattr(optimizer, "sharded", None) is not None:
        return
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            zeros = torch.zeros_like(p)
            if isinstance(optimizer, torch.optim.SparseAdam) or (
                    isinstance(optimizer, torch.optim.SGD) and id(p) in sparse):
                p.grad = zeros.to_sparse()
            elif p.grad is not None and p.grad.layout == torch.strided:
                p.grad.zero_()  # a DistributedOptimizer's bucket view stays in place
            else:
                p.grad = zeros
    local_class: type[torch.optim.Optimizer] = getattr(type(optimizer), "_base_class",
                                                       type(optimizer))
    local_class.step(optimizer)


def broadcast_parameters(params: Any, root_rank: int = 0) -> None:
    """`hvd.broadcast_parameters(model.state_dict(), root_rank=0)`: overwrite every
    tensor in `params` with root's, in place (all in flight at once).

    Args:
        params: a `state_dict()`, `named_parameters()`, or a list of tensors (named
            `param.n`); entries that are no tensors are skipped. Each tensor's broadcast is
            named after its key, so models that differ fail with MismatchError.
        root_rank: the world rank whose values are sent.

    Raises:
        ValueError: `params` is neither a dict nor an iterable.
        MismatchError: on every rank, where the ranks' tensors differ in name, shape or
            dtype.
    """
    coord = runtime.coordinator()
    coord.lowlevel.run_sync(broadcast_parameters_async, coord, params, root_rank)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0,
                              model: Any = None) -> None:
    """`hvd.broadcast_optimizer_state(optimizer, root_rank=0)`: root's optimizer
    state (buffers and hyperparameters) on every rank.

    A rank whose optimizer has no state yet first creates it with one local step on
    zero gradients, as Horovod does.

    Args:
        optimizer: the optimizer (a `DistributedOptimizer` too); overwritten in place.
        root_rank: the world rank whose values are sent.
        model: the model, where it has sparse embeddings: their parameters get sparse
            zero gradients when missing state is made.

    Raises:
        ValueError: the optimizer is `torch.optim.LBFGS`, whose state cannot be broadcast.
    """
    coord = runtime.coordinator()
    coord.lowlevel.run_sync(broadcast_optimizer_state_async, coord, optimizer, root_rank, model)
