"""Data-parallel input: consistent sharding per epoch.

`ShardSampler` gives every rank its share of one permutation that all ranks
compute alike from `(seed, epoch)`, with no communication; with torch
available it reproduces `torch.utils.data.DistributedSampler` index for
index (padding by wrapping round, or dropping the tail), so switching to
asynclock keeps the data order.

Uneven ends (ranks that run out of batches first) are `coord.join()`
(`engine.join`): joined ranks stand in for every allreduce the others issue.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .._core.runtime.coordinator import Coordinator


class ShardSampler:
    """Indices of this rank's shard for the current epoch (a torch Sampler too).

    Args:
        n: the dataset's length.
        rank: this rank's index in `range(size)`.
        size: how many ranks share the dataset.
        shuffle: permute the indices each epoch (False: in order).
        seed: seed of the permutation; the same on every rank.
        drop_last: with `even`, drop the tail that does not divide evenly instead of
            padding with indices from the start.
        even: True: every rank gets the same count, exactly like
            `DistributedSampler`. False: rank r gets `perm[r::size]`, uneven by at most
            one; pair it with `coord.join()`.
        generator: `"torch"` (`torch.randperm`, `DistributedSampler`'s order),
            `"numpy"` (PCG64), or `"auto"`: torch's where torch is importable.

    Raises:
        ValueError: `rank` is outside `range(size)`, or `generator` is unknown.
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
        """A sampler for this rank of `coord`'s world.

        Args:
            coord: the running coordinator; gives `rank` and `size`.
            n: the dataset's length.
            **kw: the other keyword arguments of `ShardSampler`.

        Returns:
            The sampler.
        """
        return cls(n, rank=coord.rank, size=coord.size, **kw)

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch on every rank: a new permutation, the same everywhere.

        Args:
            epoch: the epoch number; added to `seed`.
        """
        self.epoch = epoch

    @property
    def num_samples(self) -> int:
        """How many indices this rank gets per epoch."""
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
        """The whole epoch's order, identical on every rank.

        Returns:
            Every index of `range(n)`, in this epoch's order.
        """
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
        """This rank's indices for the current epoch.

        Returns:
            This rank's share of the epoch's order (what iterating the sampler yields).
        """
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
        """This rank's indices in batches.

        Args:
            batch_size: indices per batch.
            drop_last: drop a last batch shorter than `batch_size`.

        Yields:
            Lists of indices, in order; without `drop_last` the last may be short.
        """
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
