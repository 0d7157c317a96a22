"""Where sharded state lives: pieces of buckets, and the node window's layout.

A piece is one parameter's share of one rank's chunk of one bucket: the unit a
rank updates (`shard`). Every rank computes the same list from the agreed plan,
so the window's layout (parameters, whole-shape state, one scalar slot per
piece and key) is the same everywhere without being sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import Plan
from .shm_chunks import chunk

SCALAR_KEYS = frozenset({"step", "mu_product"})
ALIGN, SCALAR_BYTES = 64, 8


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements [start, stop) of parameter `param`, at [lo, hi) of its group buffer;
    `rank` (node rank) reduces and updates it as part of bucket `bucket`."""

    param: int
    start: int
    stop: int
    lo: int
    hi: int
    rank: int
    bucket: int


def pieces(plan: Plan, n: int) -> list[Piece]:
    """Every rank's pieces, in a fixed order (the same list on every rank)."""
    out = []
    for b in plan.buckets:
        for q in range(n):
            lo, hi = chunk(b, q, n)
            for s in b.segments:
                a, z = max(s.offset, lo), min(s.offset + s.numel, hi)
                if a < z:
                    start = s.start + a - s.offset
                    out.append(Piece(s.param, start, start + z - a, a, z, q, b.index))
    return out


@dataclass(frozen=True, slots=True)
class StateKeys:
    """One parameter's optimizer state, split by where it lives."""

    full: dict[str, torch.dtype]  # the parameter's shape: one slot in the window
    scalar: dict[str, torch.dtype]  # per piece, in the window
    plain: dict[str, Any]  # not a tensor (e.g. a None buffer): copied into each piece


def split_state(p: torch.Tensor, state: dict[str, Any]) -> StateKeys:
    keys = StateKeys({}, {}, {})
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            keys.plain[key] = value
        elif key in SCALAR_KEYS and value.numel() == 1:
            keys.scalar[key] = value.dtype
        elif value.shape == p.shape:
            keys.full[key] = value.dtype
        else:
            raise ValueError(f"shard_optimizer: cannot shard optimizer state {key!r} of shape "
                             f"{tuple(value.shape)} for a parameter of shape {tuple(p.shape)}")
    return keys


class Layout:
    """Byte offsets in the node's window: parameters, full state, scalar slots."""

    def __init__(self, params: Sequence[torch.Tensor], keys: list[StateKeys],
                 all_pieces: list[Piece]) -> None:
        self.total = 0
        self.param_at = [self._take(p.numel() * p.element_size()) for p in params]
        self.full_at = {(i, key): self._take(params[i].numel() * size_of(dtype))
                        for i, k in enumerate(keys) for key, dtype in k.full.items()}
        self.scalar_at = {(j, key): self._take(SCALAR_BYTES)
                          for j, piece in enumerate(all_pieces)
                          for key in keys[piece.param].scalar}

    def _take(self, nbytes: int) -> int:
        at = self.total
        self.total += -(-max(nbytes, 1) // ALIGN) * ALIGN
        return at


def size_of(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
