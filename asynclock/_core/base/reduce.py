"""Local arithmetic for reductions: rank-ordered folds and half precision.

Small allreduces are folded locally from the gathered contributions in rank
order, so every rank computes bit-identical results. Half types (float16,
bfloat16) accumulate in float32 and round once, which is also what the
large-message path does (it upcasts before MPI, which has no half types).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from .ops import BFLOAT16, DTYPE_CODES, FLOAT_CODES, ReduceOp

FLOAT16 = DTYPE_CODES["float16"]
HALF = frozenset({FLOAT16, BFLOAT16})

_UFUNC = {ReduceOp.SUM: np.add, ReduceOp.AVERAGE: np.add, ReduceOp.MIN: np.minimum,
          ReduceOp.MAX: np.maximum, ReduceOp.PRODUCT: np.multiply}

Array = np.ndarray[Any, Any]


def ufunc(op: ReduceOp) -> np.ufunc:
    """numpy's element-wise form of `op` (an average sums; the caller divides)."""
    return _UFUNC[op]


_TORCH_MIN = 4096  # below this numpy's casts are cheaper than crossing into torch


def torch_half(code: int) -> Any:
    """torch and its 16-bit dtype for `code`, if the program already imported torch:
    its half casts use SIMD and are far faster than numpy's float16 casts."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    return torch, torch.bfloat16 if code == BFLOAT16 else torch.float16


def to_compute(arr: Array, code: int) -> Array:
    """View or convert raw storage to an array numpy can do arithmetic on."""
    if code in HALF and arr.size >= _TORCH_MIN and arr.flags.c_contiguous:
        torch, dtype = torch_half(code)
        if torch is not None:
            out: Array = torch.from_numpy(arr.view(np.int16)).view(dtype).float().numpy()
            return out
    if code == BFLOAT16:
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if code == FLOAT16:
        return arr.astype(np.float32)
    return arr


def from_compute(arr: Array, code: int, out: Array) -> None:
    """Store compute-precision values into raw storage `out` (RNE rounding)."""
    if code in HALF and out.size >= _TORCH_MIN and out.flags.c_contiguous:
        torch, dtype = torch_half(code)
        if torch is not None:
            src = torch.from_numpy(np.ascontiguousarray(arr, np.float32)).reshape(out.shape)
            torch.from_numpy(out.view(np.int16)).view(dtype).copy_(src)
            return
    if code == BFLOAT16:
        bits = arr.astype(np.float32).view(np.uint32)
        rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
        nan = np.isnan(arr)
        out[...] = (rounded >> np.uint32(16)).astype(np.uint16)
        if nan.any():
            out[nan] = np.uint16(0x7FC0)
    elif code == FLOAT16:
        out[...] = arr.astype(np.float16)
    else:
        out[...] = arr


def fold(rows: Array, code: int, op: ReduceOp, size: int, out: Array) -> None:
    """Reduce `rows` (one per rank, rank order) into `out` in the caller's dtype."""
    if op is not ReduceOp.AVERAGE and code not in HALF:
        _UFUNC[op].reduce(rows, axis=0, out=out)  # common case: no temporaries
        return
    acc = _UFUNC[op].reduce(to_compute(rows, code), axis=0)
    if op is ReduceOp.AVERAGE:
        acc = divide(acc, code, size)
    from_compute(acc, code, out)


def divide(acc: Array, code: int, size: int) -> Array:
    """Average = sum / size; integers round toward zero, as Horovod's average does."""
    if code in FLOAT_CODES:
        out: Array = acc / acc.dtype.type(size)
        return out
    out = acc.copy()
    _truncating_divide(out, size)
    return out


def finish_average_inplace(arr: Array, code: int, size: int) -> None:
    """Divide a summed compute-precision buffer in place."""
    if code in FLOAT_CODES:
        arr /= arr.dtype.type(size)
    else:
        _truncating_divide(arr, size)


def _truncating_divide(arr: Array, size: int) -> None:
    """In place, rounding toward zero (numpy's integer division floors)."""
    negative = arr < 0
    np.negative(arr, out=arr, where=negative)
    np.floor_divide(arr, size, out=arr)
    np.negative(arr, out=arr, where=negative)
