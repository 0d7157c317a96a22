"""Adapt torch tensors and numpy arrays to contiguous numpy buffers.

Every transport works on numpy views that share memory with the caller's
object, so in-place collectives write straight into the user's tensor.
Validation failures carry a small code, because a rank that rejects its
input still joins the header round and tells the others why.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import InvalidInputError
from .ops import BFLOAT16, DTYPE_CODES, DTYPE_NAMES, NUMPY_OF_CODE


class InputFault(enum.IntEnum):
    """Why a rank rejected its own input; sent to the other ranks."""

    NONE = 0
    NON_CONTIGUOUS = 1
    UNSUPPORTED_DTYPE = 2
    WRONG_DEVICE = 3
    NOT_A_TENSOR = 4
    READ_ONLY = 5
    BAD_ARGUMENT = 6
    UNPICKLABLE = 7


FAULT_TEXT = {
    InputFault.NON_CONTIGUOUS: "tensor is not contiguous (call .contiguous() first)",
    InputFault.UNSUPPORTED_DTYPE: "dtype is not supported",
    InputFault.WRONG_DEVICE: "tensor is on a device this transport cannot reach",
    InputFault.NOT_A_TENSOR: "argument is not a torch tensor or numpy array",
    InputFault.READ_ONLY: "in-place target is read-only",
    InputFault.BAD_ARGUMENT: "invalid argument",
    InputFault.UNPICKLABLE: "object cannot be pickled",
}


class InputRejected(InvalidInputError):
    """A local validation failure, with the code other ranks will see."""

    def __init__(self, fault: InputFault, detail: str) -> None:
        super().__init__(f"{FAULT_TEXT[fault]}: {detail}")
        self.fault = fault


_NUMPY_CODES = {np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                np.dtype(np.float64): "float64", np.dtype(np.int8): "int8",
                np.dtype(np.uint8): "uint8", np.dtype(np.int16): "int16",
                np.dtype(np.int32): "int32", np.dtype(np.int64): "int64"}


@dataclass(slots=True)
class Buffer:
    """A contiguous numpy view of the caller's data plus how to wrap results."""

    array: np.ndarray[Any, Any]
    code: int
    shape: tuple[int, ...]
    wrap: Callable[[np.ndarray[Any, Any]], Any]
    source: Any = None  # the caller's object: what in-place collectives return


def _torch() -> Any:
    """Return the torch module only if the caller already imported it."""
    return sys.modules.get("torch")


def as_buffer(obj: Any, *, writable: bool = False, stage: bool = False) -> Buffer:
    """Validate `obj` and view it as a flat numpy buffer sharing its memory.

    `stage=True` (the collective API) views a CUDA tensor through a pinned
    host buffer that `engine.staging.submit` fills; other callers get
    WRONG_DEVICE for it, since the view holds no data until then.
    """
    if isinstance(obj, np.ndarray):
        return _numpy_buffer(obj, writable)
    torch = _torch()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_buffer(obj, torch, stage)
    raise InputRejected(InputFault.NOT_A_TENSOR, f"got {type(obj).__name__}")


def _numpy_buffer(arr: np.ndarray[Any, Any], writable: bool) -> Buffer:
    """numpy: C-contiguous arrays of the supported dtypes only."""
    name = _NUMPY_CODES.get(arr.dtype)
    if name is None:
        raise InputRejected(InputFault.UNSUPPORTED_DTYPE, f"numpy dtype {arr.dtype}")
    if not arr.flags.c_contiguous:
        raise InputRejected(InputFault.NON_CONTIGUOUS, f"numpy array of shape {arr.shape}")
    if writable and not arr.flags.writeable:
        raise InputRejected(InputFault.READ_ONLY, f"numpy array of shape {arr.shape}")
    return Buffer(arr.reshape(-1), DTYPE_CODES[name], tuple(arr.shape), _wrap_numpy, arr)


def _wrap_numpy(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return arr


_TORCH_NAMES = ("float16", "float32", "float64", "bfloat16", "int8", "uint8", "int16",
                "int32", "int64")


_TORCH_CODES: dict[Any, int] = {}


def _torch_code(dtype: Any) -> int:
    """Map a torch dtype to our code (memoised: str(dtype) is slow on the hot path)."""
    code = _TORCH_CODES.get(dtype)
    if code is None:
        name = str(dtype).removeprefix("torch.")
        code = DTYPE_CODES[name] if name in _TORCH_NAMES else 0
        _TORCH_CODES[dtype] = code
    return code


def _torch_buffer(t: Any, torch: Any, stage: bool = False) -> Buffer:
    """torch: CPU, contiguous, supported dtype; bfloat16 travels as raw bits."""
    code = _torch_code(t.dtype)
    if not code:
        raise InputRejected(InputFault.UNSUPPORTED_DTYPE, f"torch dtype {t.dtype}")
    if not t.is_cpu:
        return _device_buffer(t, stage)
    if not t.is_contiguous():
        raise InputRejected(InputFault.NON_CONTIGUOUS, f"torch tensor of shape {tuple(t.shape)}")
    d = t.detach()
    arr = d.view(torch.int16).numpy().view(np.uint16) if code == BFLOAT16 else d.numpy()
    return Buffer(arr.reshape(-1), code, tuple(t.shape), _torch_wrapper(code, torch), t)


# How CUDA tensors are staged through host memory: the engine's staging module, a layer
# above, registers itself on import (`use_stager`).
_STAGER: list[Callable[[Any], Buffer]] = []


def use_stager(stage: Callable[[Any], Buffer]) -> None:
    _STAGER[:] = [stage]


def _device_buffer(t: Any, stage: bool) -> Buffer:
    """CUDA tensors are staged for the collectives; other devices are refused."""
    if stage and t.is_cuda and _STAGER:
        return _STAGER[0](t)
    hint = ("pass it to an asynclock collective (they stage CUDA tensors) or copy it with "
            ".cpu()" if t.is_cuda else "only CPU and CUDA tensors can be communicated; "
            "move it with .cpu()")
    raise InputRejected(InputFault.WRONG_DEVICE, f"{t.device} tensor; {hint}")


def _wrap_bfloat16(a: np.ndarray[Any, Any]) -> Any:
    torch = _torch()
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)


def _torch_wrapper(code: int, torch: Any) -> Callable[[np.ndarray[Any, Any]], Any]:
    """Results come back as torch tensors of the caller's dtype."""
    return _wrap_bfloat16 if code == BFLOAT16 else torch.from_numpy


def empty_like_code(code: int, n: int) -> np.ndarray[Any, Any]:
    """Allocate a flat numpy buffer able to hold `n` elements of dtype `code`."""
    return np.empty(n, NUMPY_OF_CODE[code])


def describe(code: int, shape: tuple[int, ...]) -> str:
    """Text such as `float32[4, 3]` used in mismatch messages."""
    return f"{DTYPE_NAMES[code]}{list(shape)}"
