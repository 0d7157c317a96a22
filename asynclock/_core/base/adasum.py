"""Adasum (Horovod's `op=hvd.Adasum`): adaptive summation of one tensor over ranks.

Two gradients a and b combine as (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b:
orthogonal ones add, parallel ones average, so large-batch steps stay stable.
Horovod pairs ranks (0,1), (2,3), ... then the pair results, and so on, which
is why it needs a power-of-two number of ranks; so does this.

Here every rank gathers every rank's tensor (one checked allgather: dtype and
shape must agree) and computes the same tree in float64, so all ranks hold
identical bits. That moves size x the data of Horovod's halving/doubling
scheme, which is fine for the moderate sizes and rank counts it is used at;
it is checked against Horovod 0.28.1's results in the suite.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import InvalidInputError
from .ops import DTYPE_CODES, FLOAT_CODES
from .reduce import from_compute, to_compute
from .tensors import as_buffer

Array = np.ndarray[Any, Any]
FLOAT64 = DTYPE_CODES["float64"]


def check_size(size: int) -> None:
    """Refuse before any communication: the size is the same on every rank."""
    if size < 1 or size & (size - 1):
        raise InvalidInputError(f"Adasum needs a power-of-two number of ranks, not {size} "
                                "(Horovod's rule too)")


def combine(a: Array, b: Array) -> Array:
    """One Adasum step of two float64 vectors; a zero vector leaves its partner
    unchanged. No cut-off above zero: float64 keeps the dot products of tiny
    float32 vectors (Horovod's stability tests use values near float32's tiny)."""
    dot, a2, b2 = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / (2.0 * a2) if a2 > 0.0 else 1.0
    cb = 1.0 - dot / (2.0 * b2) if b2 > 0.0 else 1.0
    out: Array = ca * a + cb * b
    return out


def tree(rows: list[Array]) -> Array:
    """Pairs (0,1), (2,3), ..., then the pairs' results: Horovod's order."""
    while len(rows) > 1:
        rows = [combine(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    return rows[0]


def reduce_gathered(gathered: Any, like: Any) -> Any:
    """The Adasum of the gathered rows (one per rank), shaped and typed like `like`."""
    buf = as_buffer(gathered)
    if buf.code not in FLOAT_CODES:  # every rank gathered the same dtype: all raise alike
        raise InvalidInputError("Adasum needs a floating-point tensor")
    rows = to_compute(buf.array, buf.code).reshape(buf.shape[0], -1).astype(np.float64)
    result = tree(list(rows))
    mine = as_buffer(like)
    out = np.empty(mine.array.size, mine.array.dtype)
    from_compute(result if mine.code == FLOAT64 else result.astype(np.float32), mine.code, out)
    return mine.wrap(out.reshape(mine.shape))
