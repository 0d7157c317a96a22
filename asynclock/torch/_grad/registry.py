"""The parameters whose gradients are reduced, in an order every rank shares.

Index i means the same parameter on every rank: the optimizer's
param_groups order, trainable parameters only (frozen ones never get a
gradient, so they are left alone). Names follow Horovod's rules.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .buckets import ParamSpec


def _named(param_groups: Sequence[dict[str, Any]],
           named_parameters: Iterable[Any] | None) -> dict[int, str]:
    """id(param) -> name, validated the way Horovod validates it."""
    if named_parameters is None:
        return {id(p): f"allreduce.noname.{g}.{j}"
                for g, group in enumerate(param_groups) for j, p in enumerate(group["params"])}
    pairs = list(named_parameters)
    if any(not isinstance(pair, tuple) for pair in pairs):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters().")
    names = [k for k, _ in pairs]
    dups = sorted({k for k in names if names.count(k) > 1})
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. "
                         f"Found duplicates: {', '.join(dups)}")
    return {id(v): k for k, v in pairs}


class ParamRegistry:
    """Trainable parameters of an optimizer with their names and sizes."""

    def __init__(self, param_groups: Sequence[dict[str, Any]],
                 named_parameters: Iterable[Any] | None = None) -> None:
        names = _named(param_groups, named_parameters)
        everything = [p for group in param_groups for p in group["params"]]
        unnamed = [id(p) for p in everything if id(p) not in names]
        if unnamed:
            raise ValueError("named_parameters was specified, but one or more model parameters "
                             f"were not named. Python object ids: {', '.join(map(str, unnamed))}")
        self.params: list[torch.nn.Parameter] = [p for p in everything if p.requires_grad]
        devices = sorted({str(p.device) for p in self.params})
        if len(devices) > 1:
            raise NotImplementedError(
                f"the gradient reducer works on parameters of one device, these are on "
                f"{devices}: one optimizer per device (one rank per GPU, as with DDP)")
        # where the buckets live: CUDA buckets travel over NCCL (`Reducer.check_device`)
        self.device = self.params[0].device if self.params else torch.device("cpu")
        self.names = [names[id(p)] for p in self.params]
        self.frozen = [p for p in everything if not p.requires_grad]
        self._index = {id(p): i for i, p in enumerate(self.params)}

    def __len__(self) -> int:
        return len(self.params)

    def index(self, p: torch.Tensor) -> int | None:
        return self._index.get(id(p))

    def indices(self, params: Iterable[torch.Tensor]) -> list[int]:
        """Registry indices of those of `params` that are reduced here."""
        return [i for p in params if (i := self._index.get(id(p))) is not None]

    def specs(self, comm_dtype: torch.dtype | None) -> list[ParamSpec]:
        """Planner input: `comm_dtype` (compression) overrides floating dtypes."""
        out = []
        for p in self.params:
            dtype = comm_dtype if comm_dtype is not None and p.dtype.is_floating_point else p.dtype
            out.append(ParamSpec(p.numel(), str(dtype).removeprefix("torch."),
                                 torch.empty((), dtype=dtype).element_size()))
        return out

    def signature(self) -> tuple[int, int]:
        """(count, crc of names, shapes and dtypes): equal on every rank or a bug."""
        text = ";".join(f"{n}:{tuple(p.shape)}:{p.dtype}"
                        for n, p in zip(self.names, self.params, strict=True))
        return len(self.params), zlib.crc32(text.encode())

    def describe(self, i: int) -> str:
        p = self.params[i]
        return f"{self.names[i]} {str(p.dtype).removeprefix('torch.')}{list(p.shape)}"
