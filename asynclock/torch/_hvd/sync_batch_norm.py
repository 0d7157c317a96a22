"""SyncBatchNorm on CPU (and GPU): batch statistics over every rank's batch.

torch's `nn.SyncBatchNorm` and Horovod's `SyncBatchNorm` are built on
`torch.batch_norm_stats` and friends, which exist only for CUDA; with small
per-rank batches on CPU, plain BatchNorm normalises each rank by its own few
samples. This one uses ordinary tensor ops: the forward allreduces
(sum, sum of squares, count) per channel in float64, the backward allreduces
(sum dy, sum dy*x_hat), so the input gradient is that of BatchNorm over the
concatenated global batch; weight and bias gradients stay local sums, which
the optimizer's average turns into the global ones (as in torch and Horovod).

Its collectives go on the coordinator's `model_lane`: layers run in the same
order on every rank, whatever other tasks do on the user lane. From the
async API call the model in a worker thread (the forward blocks on them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..._core.runtime import coordinator as runtime
from .._grad.compile_exempt import eager

Reduce = Callable[[torch.Tensor], torch.Tensor]


class SyncBatchNorm(_BatchNorm):
    """Horovod's `hvd.SyncBatchNorm`: training statistics over all ranks; eval as usual.

    Its collectives run on the coordinator's model lane, so every rank must run the
    layer in the same order; from the async API, call the model in a worker thread.

    Args:
        *args: `num_features`, `eps`, `momentum`, `affine`, `track_running_stats`, as
            `torch.nn.BatchNorm1d`'s.
        **kwargs: the same, by keyword (`device` and `dtype` too).
    """

    _eager_forward = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        cls = SyncBatchNorm
        if not cls._eager_forward:  # collectives inside: torch.compile must not trace them
            cls.forward = eager(cls.forward)  # type: ignore[method-assign]
            cls._eager_forward = True

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise `x` with the mean and variance over every rank's batch
        (in training; in eval, with the running statistics).

        Args:
            x: a batch of at least two dimensions, channels in dim 1.

        Returns:
            The normalised batch.

        Raises:
            ValueError: `x` has fewer than two dimensions.
            NotInitializedError: `hvd.init()` has not run.
        """
        self._check_input_dim(x)
        coord = runtime.coordinator()
        if not self.training or coord.size == 1:
            return super().forward(x)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        momentum = 0.1 if self.momentum is None else self.momentum
        out: torch.Tensor = _SyncBatchNormFn.apply(  # type: ignore[no-untyped-call]
            x, self.weight, self.bias, self.running_mean, self.running_var, self.eps, momentum,
            _model_lane_sum(coord))
        return out

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Every BatchNorm*d in `module` replaced by a SyncBatchNorm with its state.

        Args:
            module: a model, or a single batch-norm layer; changed in place.

        Returns:
            `module` (a new SyncBatchNorm where `module` itself is a batch-norm layer).
        """
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            new = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats)
            new.load_state_dict(module.state_dict())
            new.train(module.training)
            return new
        for name, child in module.named_children():
            module.add_module(name, cls.convert_sync_batchnorm(child))
        return module


def _model_lane_sum(coord: Any) -> Reduce:
    """A blocking sum over ranks on the model lane, from any thread but the loop's."""
    api = coord.lowlevel.on_lane(coord.lowlevel.model_lane)

    def reduce(t: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = coord.lowlevel.call_blocking(api.allreduce, t, "sum")
        return out

    return reduce


def _shape(x: torch.Tensor) -> list[int]:
    return [1, x.size(1)] + [1] * (x.dim() - 2)


def _dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None,
                bias: torch.Tensor | None, running_mean: torch.Tensor | None,
                running_var: torch.Tensor | None, eps: float, momentum: float,
                reduce: Reduce) -> torch.Tensor:
        c, dims, shape = x.size(1), _dims(x), _shape(x)
        wide = x.detach().to(torch.float64)
        count = torch.tensor([x.numel() / c], dtype=torch.float64)
        stats = reduce(torch.cat([wide.sum(dims), (wide * wide).sum(dims), count]))
        total = float(stats[-1])
        mean = stats[:c] / total
        var = (stats[c:2 * c] / total - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        _update_running(running_mean, running_var, mean, var, total, momentum)
        xhat = (x - mean.to(x.dtype).view(shape)) * invstd.to(x.dtype).view(shape)
        ctx.save_for_backward(xhat, weight, invstd.to(x.dtype))
        ctx.total, ctx.reduce, ctx.has_bias = total, reduce, bias is not None
        if weight is None:
            return xhat
        y = xhat * weight.view(shape)
        return y + bias.view(shape) if bias is not None else y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        xhat, weight, invstd = ctx.saved_tensors
        c, dims, shape = dy.size(1), _dims(dy), _shape(dy)
        sum_dy, sum_dy_xhat = dy.sum(dims), (dy * xhat).sum(dims)
        grad_x = None
        if ctx.needs_input_grad[0]:
            both = ctx.reduce(torch.cat([sum_dy, sum_dy_xhat]).to(torch.float64))
            mean_dy = (both[:c] / ctx.total).to(dy.dtype).view(shape)
            mean_dy_xhat = (both[c:] / ctx.total).to(dy.dtype).view(shape)
            scale = invstd if weight is None else invstd * weight
            grad_x = (dy - mean_dy - xhat * mean_dy_xhat) * scale.view(shape)
        grad_w = sum_dy_xhat if weight is not None and ctx.needs_input_grad[1] else None
        grad_b = sum_dy if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b, None, None, None, None, None


def _update_running(running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                    mean: torch.Tensor, var: torch.Tensor, total: float,
                    momentum: float) -> None:
    """torch's rule: the running variance takes the unbiased global variance."""
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = var * (total / max(total - 1.0, 1.0))
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
