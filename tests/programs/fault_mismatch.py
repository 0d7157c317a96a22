"""Randomized mismatch trials: each rank perturbs a shared call at random.

Every trial draws one call (kind, dtype, shape, op, root, name) from a seed
shared by all ranks; in most trials each rank may then change some fields
with a seed of its own. Whatever happens must happen on every rank: all
raise the same error text, or all succeed with the same result (checked
against the exact value when no rank changed anything). Outcomes are
compared across ranks with allgather_object at the end; a hang fails the
test through its timeout.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from _common import report, run
from fault_common import arg

import asynclock
from asynclock import AsynclockError

KINDS = ("allreduce", "broadcast", "allgather", "reduce_scatter", "barrier",
         "allgather_object", "broadcast_object")
DTYPES = ("float32", "float64", "int32", "int64", "float16")
OPS = ("sum", "min", "max", "average")


@dataclass(frozen=True)
class Spec:
    kind: str
    dtype: str
    shape: tuple[int, ...]
    op: str
    root: int
    name: str


def draw(rng: random.Random, size: int) -> Spec:
    dim0 = rng.choice([1, 3, 6, 40, 3000])  # 40+ float64 rows: past the 128 B inline limit
    shape = (dim0,) + tuple(rng.choice([1, 2, 5]) for _ in range(rng.randrange(3)))
    return Spec(rng.choice(KINDS), rng.choice(DTYPES), shape, rng.choice(OPS),
                rng.randrange(size), rng.choice(["", "w", "grad.layer1", "a_rather_long_name_x"]))


def perturb(spec: Spec, rng: random.Random, size: int) -> Spec:
    """Change each field with probability 0.25 (often to the same value)."""
    other = draw(rng, size)
    changes = {f: getattr(other, f) for f in ("kind", "dtype", "shape", "op", "root", "name")
               if rng.random() < 0.25}
    return replace(spec, **changes)


def specs(trial: int, size: int, seed: int) -> list[Spec]:
    """Every rank's call in this trial (every rank can compute all of them)."""
    shared = random.Random(seed * 100_003 + trial)
    base = draw(shared, size)
    if shared.random() < 0.3:
        return [base] * size
    return [perturb(base, random.Random((seed * 100_003 + trial) * 31 + r + 1), size)
            for r in range(size)]


def data(spec: Spec, rank: int) -> np.ndarray:
    return np.full(spec.shape, rank + 1, dtype=spec.dtype)


async def call(c: asynclock.Coordinator, s: Spec) -> Any:
    x = data(s, c.rank)
    kw = {"name": s.name or None}
    if s.kind == "allreduce":
        return await c.allreduce(x, s.op, **kw)
    if s.kind == "broadcast":
        return await c.broadcast(x, s.root, **kw)
    if s.kind == "allgather":
        return await c.allgather(x, **kw)
    if s.kind == "reduce_scatter":
        return await c.reduce_scatter(x, s.op, **kw)
    if s.kind == "barrier":
        return await c.barrier(**kw)
    if s.kind == "allgather_object":
        return await c.allgather_object({"rank": c.rank, "pad": "x" * s.shape[0]}, **kw)
    return await c.broadcast_object({"root": c.rank, "pad": "y" * s.shape[0]}, s.root, **kw)


def expected(s: Spec, rank: int, size: int) -> Any:
    """The exact result when every rank made the same call."""
    rows = [data(s, r) for r in range(size)]
    if s.kind == "allreduce":
        acc = np.stack([r.astype(np.float64) for r in rows])
        red = {"sum": acc.sum(0), "min": acc.min(0), "max": acc.max(0),
               "average": acc.sum(0) / size}[s.op]
        return np.trunc(red) if s.op == "average" and "int" in s.dtype else red
    if s.kind == "broadcast":
        return rows[s.root]
    if s.kind == "allgather":
        return np.concatenate(rows)
    if s.kind == "allgather_object":
        return [{"rank": r, "pad": "x" * s.shape[0]} for r in range(size)]
    if s.kind == "broadcast_object":
        return {"root": s.root, "pad": "y" * s.shape[0]}
    return None  # barrier; reduce_scatter is checked by the cross-rank comparison only


def digest(value: Any, s: Spec) -> str:
    """Same on every rank for every kind whose result is the same everywhere."""
    if s.kind == "reduce_scatter":
        return "ok"
    raw = value.tobytes() if isinstance(value, np.ndarray) else repr(value).encode()
    return hashlib.sha1(raw).hexdigest()


def check_value(value: Any, s: Spec, rank: int, size: int) -> None:
    want = expected(s, rank, size)
    if isinstance(want, np.ndarray):
        assert np.array_equal(value.astype(np.float64), want.astype(np.float64)), (s, value)
    elif s.kind != "reduce_scatter":
        assert value == want, (s, value, want)


async def trial(c: asynclock.Coordinator, t: int, seed: int) -> tuple[str, str]:
    all_specs = specs(t, c.size, seed)
    mine = all_specs[c.rank]
    try:
        value = await call(c, mine)
    except AsynclockError as exc:
        assert len(set(all_specs)) > 1, f"trial {t}: identical calls raised {exc!r}"
        return type(exc).__name__, str(exc)
    if len(set(all_specs)) == 1:
        check_value(value, mine, c.rank, c.size)
    return "ok", digest(value, mine)


async def main() -> None:
    trials, seed = int(arg("--trials", "100")), int(arg("--seed", "1"))
    async with asynclock.start() as c:
        outcomes = [await trial(c, t, seed) for t in range(trials)]
        everyone = await c.allgather_object(outcomes, name="outcomes")
        for t in range(trials):
            seen = {everyone[r][t] for r in range(c.size)}
            assert len(seen) == 1, f"trial {t} {specs(t, c.size, seed)}: ranks differ: {seen}"
        errors = sum(o[0] != "ok" for o in outcomes)
        assert 0 < errors < trials, f"{errors} of {trials} trials raised: not a useful mix"
        await c.drain(timeout=30)
        stats = c.statistics()
        assert stats.in_flight == 0 and stats.issued == stats.completed, stats
        report(c.rank, "done", f"{trials} trials, {errors} raised everywhere, "
                               f"{trials - errors} succeeded everywhere")


run(main)
