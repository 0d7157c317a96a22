"""Reduction operators, dtype codes and collective kinds shared by all ranks.

Codes are small integers because they travel in the fixed-size header every
collective exchanges first (see `base.header`).
"""

from __future__ import annotations

import enum

import numpy as np


class ReduceOp(enum.IntEnum):
    """Reduction applied by `allreduce` and `reduce_scatter` (Horovod names).

    `ADASUM` is Horovod's adaptive summation (`base.adasum`): it is no elementwise
    reduction, so no header carries it and no transport applies it; the Horovod API
    computes it from an allgather, and the async API's `adasum()` does."""

    SUM = 1
    AVERAGE = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5
    ADASUM = 6


Sum = ReduceOp.SUM
Average = ReduceOp.AVERAGE
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM
# What an allreduce applies element by element: every op but Adasum.
ELEMENTWISE_OPS = (Sum, Average, Min, Max, Product)

_OP_ALIASES = {"sum": Sum, "average": Average, "avg": Average, "mean": Average,
               "min": Min, "max": Max, "product": Product, "prod": Product,
               "adasum": Adasum}


def as_reduce_op(op: ReduceOp | str | int) -> ReduceOp:
    """Accept `asynclock.Sum`, `"sum"` or the code, so Horovod code ports as is
    (`"Adasum"` too: Horovod scripts name the op either way)."""
    if isinstance(op, str):
        try:
            return _OP_ALIASES[op.lower()]
        except KeyError:
            known = sorted(_OP_ALIASES)
            raise ValueError(f"unknown reduce op {op!r}; use one of {known}") from None
    return ReduceOp(int(op))


def is_adasum(op: object) -> bool:
    """Whether `op` names Adasum (the member, its code or its name, any case); anything
    else, valid or not, is left to `as_reduce_op` to take or refuse."""
    if isinstance(op, str):
        return op.lower() == "adasum"
    return isinstance(op, int) and op == ReduceOp.ADASUM


class Kind(enum.IntEnum):
    """Which collective a header announces; a mismatch here is an order bug."""

    ALLREDUCE = 1
    BROADCAST = 2
    ALLGATHER = 3
    REDUCE_SCATTER = 4
    ALLTOALL = 5
    BARRIER = 6
    BROADCAST_OBJECT = 7
    ALLGATHER_OBJECT = 8
    AGREE = 9
    JOIN = 10  # a rank that called join(): stands in for others' allreduces and barriers
    FILLER = 11  # a round that proposes nothing: keeps a lane with unmatched ops turning
    MAKE = 12  # making a communicator or window: agreed first, then made (`engine.making`)


# dtype codes: index into this table travels in headers.
DTYPE_NAMES: tuple[str, ...] = (
    "invalid", "float16", "float32", "float64", "bfloat16",
    "int8", "uint8", "int16", "int32", "int64", "bytes",
)
DTYPE_CODES: dict[str, int] = {name: i for i, name in enumerate(DTYPE_NAMES)}
BFLOAT16 = DTYPE_CODES["bfloat16"]
HALF_CODES = frozenset({DTYPE_CODES["float16"], BFLOAT16})
FLOAT_CODES = frozenset({DTYPE_CODES[n] for n in ("float16", "float32", "float64", "bfloat16")})

NUMPY_OF_CODE: dict[int, np.dtype[np.generic]] = {
    DTYPE_CODES["float16"]: np.dtype(np.float16),
    DTYPE_CODES["float32"]: np.dtype(np.float32),
    DTYPE_CODES["float64"]: np.dtype(np.float64),
    BFLOAT16: np.dtype(np.uint16),  # raw bits; arithmetic goes through float32
    DTYPE_CODES["int8"]: np.dtype(np.int8),
    DTYPE_CODES["uint8"]: np.dtype(np.uint8),
    DTYPE_CODES["int16"]: np.dtype(np.int16),
    DTYPE_CODES["int32"]: np.dtype(np.int32),
    DTYPE_CODES["int64"]: np.dtype(np.int64),
    DTYPE_CODES["bytes"]: np.dtype(np.uint8),
}
