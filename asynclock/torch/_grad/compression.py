"""Gradient compression, Horovod's interface plus bfloat16.

The reducer only needs `wire_dtype`: floating gradients travel in that
dtype (cast while packing, cast back while unpacking); `compress` and
`decompress` keep Horovod's per-tensor protocol for `allreduce(...,
compression=...)`. With the MPI transport, half types are summed in float32
(MPI has no half arithmetic), so compression saves memory traffic on
transports with native half reductions (Horovod), not on MPI.
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """No compression: tensors travel in their own dtype.

    The base of `Compression.none`, `.fp16` and `.bf16`; a subclass sets `wire_dtype`,
    the dtype floating-point tensors travel in.
    """

    wire_dtype: torch.dtype | None = None

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The tensor as it travels.

        Args:
            tensor: the tensor to send.

        Returns:
            (the tensor in `wire_dtype`, the context `decompress` needs: the original
            dtype); integer tensors and `wire_dtype=None` pass through with context None.
        """
        if cls.wire_dtype is None or not tensor.dtype.is_floating_point:
            return tensor, None
        return tensor.to(cls.wire_dtype), tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """The received tensor in its original dtype.

        Args:
            tensor: what arrived.
            ctx: the context `compress` returned.

        Returns:
            `tensor` cast back to the dtype it had before `compress`.
        """
        return tensor if ctx is None else tensor.to(ctx)


class NoneCompressor(Compressor):
    wire_dtype = None


class FP16Compressor(Compressor):
    """Floating tensors travel as float16."""

    wire_dtype = torch.float16


class BF16Compressor(Compressor):
    """Floating tensors travel as bfloat16 (float32's range, 8-bit mantissa)."""

    wire_dtype = torch.bfloat16


class Compression:
    """`Compression.none`, `.fp16`, `.bf16`, as in `horovod.torch.Compression`."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


def wire_dtype(compression: Any) -> torch.dtype | None:
    """Accept the classes above or any object with Horovod's interface."""
    if compression is None:
        return None
    dtype = getattr(compression, "wire_dtype", None)
    if dtype is None and getattr(compression, "__name__", "") == "FP16Compressor":
        return torch.float16  # horovod.torch.Compression.fp16 passed in
    return dtype
