"""Data-parallel input: consistent sharding per epoch, and joins for uneven ends.

`ShardSampler` gives every rank its share of one permutation that all ranks
compute alike from `(seed, epoch)`, with no communication; with torch
available it reproduces `torch.utils.data.DistributedSampler` index for
index (padding by wrapping round, or dropping the tail), so switching to
asynclock keeps the data order.

`Join` handles ranks that run out of batches first (hvd.join / DDP Join):
every allreduce issued through it is preceded by a tiny descriptor
allgather in which active ranks say what they reduce and joined ranks say
they are done. A joined rank, looping in `join()`, answers each active
round with the operation's identity (zeros for sum/average), so the
active ranks' collectives complete and their averages divide by the full
world size, as in Horovod. `join()` returns, on every rank, the last rank
to join (the highest rank among those that joined in the last round).
"""

from __future__ import annotations

import math
import sys
import zlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import MismatchError
from .ops import BFLOAT16, DTYPE_NAMES, NUMPY_OF_CODE, ReduceOp, as_reduce_op
from .tensors import as_buffer

if TYPE_CHECKING:
    from .collectives import Collectives
    from .runtime import Coordinator


class ShardSampler:
    """Indices of this rank's shard for the current epoch (a torch Sampler too).

    even=True (default): every rank gets the same count, by padding with
    indices from the start (drop_last=False) or dropping the tail
    (drop_last=True), exactly like DistributedSampler. even=False: rank r
    gets `perm[r::size]`, uneven by at most one; pair it with `Join`.
    """

    def __init__(self, n: int, *, rank: int, size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, even: bool = True, generator: str = "auto") -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a world of {size}")
        self.n, self.rank, self.size = n, rank, size
        self.shuffle, self.seed, self.drop_last, self.even = shuffle, seed, drop_last, even
        self.generator = _pick_generator(generator)
        self.epoch = 0

    @classmethod
    def for_coordinator(cls, coord: Coordinator, n: int, **kw: Any) -> ShardSampler:
        return cls(n, rank=coord.rank, size=coord.size, **kw)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch on every rank: a new permutation, the same everywhere."""
        self.epoch = epoch

    @property
    def num_samples(self) -> int:
        if not self.even:
            return len(range(self.rank, self.n, self.size))
        if self.drop_last and self.n % self.size:
            return math.ceil((self.n - self.size) / self.size)
        return math.ceil(self.n / self.size)

    def __len__(self) -> int:
        return self.num_samples

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices())

    def permutation(self) -> list[int]:
        """The whole epoch's order, identical on every rank."""
        if not self.shuffle:
            return list(range(self.n))
        if self.generator == "torch":
            import torch

            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            perm: list[int] = torch.randperm(self.n, generator=g).tolist()
            return perm
        rng = np.random.Generator(np.random.PCG64(self.seed + self.epoch))
        order: list[int] = rng.permutation(self.n).tolist()
        return order

    def indices(self) -> list[int]:
        perm = self.permutation()
        if not self.even:
            return perm[self.rank::self.size]
        total = self.num_samples * self.size
        if self.drop_last:
            perm = perm[:total]
        elif perm:
            perm = (perm * math.ceil(total / len(perm)))[:total]
        return perm[self.rank:total:self.size]

    def batches(self, batch_size: int, drop_last: bool = False) -> Iterator[list[int]]:
        """This rank's indices in batches; the last one may be short."""
        idx = self.indices()
        stop = len(idx) - len(idx) % batch_size if drop_last else len(idx)
        for i in range(0, stop, batch_size):
            yield idx[i:i + batch_size]


def _pick_generator(name: str) -> str:
    """`auto`: torch's (DistributedSampler order) when torch is importable."""
    if name != "auto":
        if name not in ("torch", "numpy"):
            raise ValueError(f"generator must be auto, torch or numpy, not {name!r}")
        return name
    if "torch" in sys.modules:
        return "torch"
    try:
        import torch  # noqa: F401
    except ImportError:
        return "numpy"
    return "torch"


# -- join ----------------------------------------------------------------------------
_ACTIVE, _JOINED = 1, 0
_WORDS = 5  # state, dtype code, op, numel, crc32(name)


class Join:
    """Allreduces that tolerate ranks with fewer batches; `await join()` at the end."""

    def __init__(self, coord: Coordinator, api: Collectives | None = None) -> None:
        self._api: Collectives = api if api is not None else coord
        self.rank, self.size = coord.rank, coord.size
        self._reset()

    def _reset(self) -> None:
        self._round = 0
        self._joined_at: dict[int, int] = {}

    async def allreduce(self, tensor: Any, op: ReduceOp | str = "sum", *,
                        name: str | None = None) -> Any:
        """Out-of-place allreduce; joined ranks contribute the op's identity."""
        rop = await self._announce(tensor, op, name)
        flat = await self._api.allreduce(_flat(tensor), rop, name="join")
        return flat.reshape(tensor.shape)

    async def allreduce_(self, tensor: Any, op: ReduceOp | str = "sum", *,
                         name: str | None = None) -> Any:
        """In-place allreduce (tensor must be contiguous); returns `tensor`."""
        rop = await self._announce(tensor, op, name)
        await self._api.allreduce_(_flat(tensor), rop, name="join")
        return tensor

    async def _announce(self, tensor: Any, op: ReduceOp | str, name: str | None) -> ReduceOp:
        rop = as_reduce_op(op)
        buf = as_buffer(tensor)
        desc = [_ACTIVE, buf.code, int(rop), buf.array.size, zlib.crc32((name or "").encode())]
        self._check(await self._exchange(desc))
        return rop

    async def join(self) -> int:
        """This rank is out of data: shadow the others until all joined; returns
        the last rank to join (same value on every rank)."""
        while True:
            rows = await self._exchange([_JOINED] + [0] * (_WORDS - 1))
            active = rows[rows[:, 0] == _ACTIVE]
            if not len(active):
                last = self._last()
                self._reset()
                return last
            self._check(rows)
            code, op, numel = (int(v) for v in active[0, 1:4])
            await self._api.allreduce_(_identity(code, ReduceOp(op), numel), ReduceOp(op),
                                       name="join")

    async def _exchange(self, desc: list[int]) -> np.ndarray[Any, Any]:
        """One small allgather: every rank's state and what it reduces this round."""
        rows: np.ndarray[Any, Any] = await self._api.allgather(
            np.array([desc], np.int64), name="join.round")
        for r in np.flatnonzero(rows[:, 0] == _JOINED):
            self._joined_at.setdefault(int(r), self._round)
        self._round += 1
        return rows

    def _check(self, rows: np.ndarray[Any, Any]) -> None:
        """Active ranks must reduce the same dtype, op, size and name."""
        active = np.flatnonzero(rows[:, 0] == _ACTIVE)
        first = rows[active[0], 1:]
        bad = [int(r) for r in active if (rows[r, 1:] != first).any()]
        if bad:
            parts = [f"rank {int(r)}: {_describe(rows[r])}" for r in active]
            raise MismatchError("ranks in a join reduce different tensors: " + "; ".join(parts))

    def _last(self) -> int:
        final = max(self._joined_at.values())
        return max(r for r, at in self._joined_at.items() if at == final)


def _flat(tensor: Any) -> Any:
    return tensor.reshape(-1)


def _describe(row: np.ndarray[Any, Any]) -> str:
    return (f"{DTYPE_NAMES[int(row[1])]}[{int(row[3])}] op={ReduceOp(int(row[2])).name.lower()}"
            f" name#{int(row[4]):08x}")


def _identity(code: int, op: ReduceOp, numel: int) -> Any:
    """What a joined rank contributes: leaves every active rank's result unchanged
    (zeros for sum and average, where averages then divide by the world size)."""
    if code == BFLOAT16:
        import torch

        value = {ReduceOp.MIN: math.inf, ReduceOp.MAX: -math.inf, ReduceOp.PRODUCT: 1.0}
        return torch.full((numel,), value.get(op, 0.0), dtype=torch.bfloat16)
    dtype = NUMPY_OF_CODE[code]
    if op is ReduceOp.PRODUCT:
        return np.ones(numel, dtype)
    if op in (ReduceOp.MIN, ReduceOp.MAX):
        info: Any = np.finfo(dtype) if dtype.kind == "f" else np.iinfo(dtype)
        high = np.inf if dtype.kind == "f" else info.max
        low = -np.inf if dtype.kind == "f" else info.min
        return np.full(numel, high if op is ReduceOp.MIN else low, dtype)
    return np.zeros(numel, dtype)
