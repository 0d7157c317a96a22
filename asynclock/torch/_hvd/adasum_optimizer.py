"""`DistributedOptimizer(op=hvd.Adasum)`: Horovod's Adasum optimizer.

Adasum combines what each rank's optimizer would do, not raw gradients: every
rank takes its own optimizer step from the shared parameters with its own
gradients (its own momentum too), and the parameter changes are combined with
Adasum (`base.adasum`), so all ranks end on the same parameters. Here
the changes go out together at `step()` (one grouped Adasum); Horovod starts
them from gradient hooks. The results are checked against Horovod 0.28.1's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..._core.base.ops import ReduceOp
from .._grad.compression import Compression
from .mpi_ops import grouped_allreduce


class _AdasumOptimizer(torch.optim.Optimizer):
    """Methods copied into a dynamic subclass of the user's optimizer class."""

    _base_class: type[torch.optim.Optimizer]

    def __init__(self, params: Any, compression: Any) -> None:
        self._base_class.__init__(self, params)  # type: ignore[call-arg]
        self._compression = compression

    def _trained(self) -> list[torch.Tensor]:
        """Every trainable parameter, in the same order on every rank (one without a
        gradient simply does not move locally: its change is zero)."""
        return [p for group in self.param_groups for p in group["params"] if p.requires_grad]

    def step(self, closure: Any = None) -> Any:
        params = self._trained()
        starts = [p.detach().clone() for p in params]
        loss = self._base_class.step(self, closure)
        changes = [p.detach() - start for p, start in zip(params, starts, strict=True)]
        combined = grouped_allreduce(changes, op=ReduceOp.ADASUM, name="adasum.step",
                                     compression=self._compression)
        with torch.no_grad():
            for p, start, change in zip(params, starts, combined, strict=True):
                p.copy_(start + change)
        return loss

    def synchronize(self) -> None:
        """Nothing is in flight between steps (Horovod API compatibility)."""


def adasum_optimizer(optimizer: torch.optim.Optimizer, compression: Any = None) -> Any:
    """Wrap `optimizer` like Horovod's `DistributedOptimizer(..., op=hvd.Adasum)`."""
    base = optimizer.__class__
    cls = type(base.__name__, (base,), dict(_AdasumOptimizer.__dict__, _base_class=base))
    return cls(optimizer.param_groups, compression or Compression.none)
