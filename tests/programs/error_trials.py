"""Randomized error trials: one bad call on some ranks, then 20 that must work.

Each trial draws, from a seed every rank shares, one error and the ranks
that make it, then 20 ordinary collectives. The error must stay local to the
call that went wrong: the 20 collectives give exact results on every rank,
and nothing is left in flight at the end. What each rank saw of the error
(its type and text) is compared across ranks at the end.

    error_trials.py [--trials N] [--seed S] [--trio]
"""

from __future__ import annotations

import random
from typing import Any

import anyio
import numpy as np
from _common import report, run
from fault_common import arg

import asynclock
from asynclock import AsynclockError

Coord = asynclock.Coordinator
STRAYS: dict[int, asynclock.Handle] = {}  # a trial's early named call, by trial
ERRORS = ("shape", "dtype", "op", "kind", "name", "invalid", "stray_named", "cancelled",
          "duplicate", "crossed_names")


def erring_ranks(rng: random.Random, size: int) -> set[int]:
    """A random non-empty proper subset of the ranks."""
    k = rng.randint(1, size - 1)
    return set(rng.sample(range(size), k))


def data(rank: int, n: int, dtype: str = "float32") -> np.ndarray:
    return (np.arange(n) % 7 + rank + 1).astype(dtype)


async def inject(c: Coord, kind: str, bad: bool, t: int) -> str:
    """Make the trial's error (on the ranks where `bad`); what this rank saw."""
    x = data(c.rank, 8)
    try:
        if kind == "shape":
            await c.allreduce(data(c.rank, 9 if bad else 8))
        elif kind == "dtype":
            await c.allreduce(data(c.rank, 8, "float64" if bad else "float32"))
        elif kind == "op":
            await c.allreduce(x, "max" if bad else "sum")
        elif kind == "kind":
            await (c.allgather(x) if bad else c.allreduce(x))
        elif kind == "name":
            await c.allreduce(x, name=f"t{t}.{'b' if bad else 'a'}")
        elif kind == "invalid":
            await c.allreduce(np.ones((4, 4), np.float32)[:, 0] if bad else np.ones(4, np.float32))
        elif kind == "stray_named":
            return await stray_named(c, bad, t)
        elif kind == "cancelled":
            return await cancelled(c, bad)
        elif kind == "duplicate":
            return await duplicate(c, bad, t)
        else:
            return await crossed_names(c, bad, t)
    except AsynclockError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok"


async def stray_named(c: Coord, bad: bool, t: int) -> str:
    """Bad ranks start a named call early; it completes when the others issue it
    after the checks (`finish_stray`)."""
    if bad:
        STRAYS[t] = c.allreduce_async(data(c.rank, 8), name=f"stray{t}")
    return "ok"


async def finish_stray(c: Coord, bad: bool, t: int) -> None:
    h = STRAYS.pop(t) if bad else c.allreduce_async(data(c.rank, 8), name=f"stray{t}")
    expect(await h, sum(data(r, 8) for r in range(c.size)), "stray")


async def cancelled(c: Coord, bad: bool) -> str:
    """Bad ranks cancel the task awaiting the call; the call still runs."""
    x = data(c.rank, 40)
    h = c.allreduce_async(x)
    if bad:
        with anyio.move_on_after(0):
            await h
    expect(await h, sum(data(r, 40) for r in range(c.size)), "cancelled")
    return "ok"


async def duplicate(c: Coord, bad: bool, t: int) -> str:
    """Bad ranks issue a name that is in flight: ValueError there, nothing sent."""
    h = c.allreduce_async(data(c.rank, 8), name=f"dup{t}")
    seen = "ok"
    if bad:
        try:
            c.allreduce_async(data(c.rank, 8), name=f"dup{t}")
            seen = "no ValueError"
        except ValueError:
            seen = "ValueError"
    expect(await h, sum(data(r, 8) for r in range(c.size)), "duplicate")
    return seen if bad else "ok"


async def crossed_names(c: Coord, bad: bool, t: int) -> str:
    """Two named calls in different orders on different ranks: matched by name."""
    names = [f"x{t}", f"y{t}"]
    order = names[::-1] if bad else names
    handles = {n: c.allreduce_async(data(c.rank, 8 + i), name=n)
               for i, n in sorted(enumerate(names), key=lambda p: order.index(p[1]))}
    for i, n in enumerate(names):
        expect(await handles[n], sum(data(r, 8 + i) for r in range(c.size)), n)
    return "ok"


def expect(got: Any, want: Any, what: str) -> None:
    a = np.asarray(got, np.float64)
    assert np.array_equal(a, np.asarray(want, np.float64)), (what, got, want)


async def checks(c: Coord, rng: random.Random, t: int) -> None:
    """20 ordinary collectives (same draws on every rank), exact results."""
    size = c.size
    for i in range(20):
        n = rng.choice((3, 40, 1000))
        name = f"c{t}.{i}" if rng.random() < 0.3 else None
        what = rng.choice(("sum", "average", "min", "max", "allgather", "broadcast",
                           "barrier"))
        x = data(c.rank, n)
        rows = [data(r, n) for r in range(size)]
        if what == "allgather":
            expect(await c.allgather(x, name=name), np.concatenate(rows), what)
        elif what == "broadcast":
            root = rng.randrange(size)
            expect(await c.broadcast(x, root, name=name), rows[root], what)
        elif what == "barrier":
            await c.barrier(name=name)
        else:
            stack = np.stack(rows).astype(np.float64)
            want = {"sum": stack.sum(0), "average": stack.sum(0) / size,
                    "min": stack.min(0), "max": stack.max(0)}[what]
            expect(await c.allreduce(x, what, name=name), want.astype(np.float32), what)


async def trial(c: Coord, t: int, seed: int) -> tuple[str, str]:
    rng = random.Random(seed * 1_000_003 + t)
    kind = ERRORS[t % len(ERRORS)] if t < len(ERRORS) else rng.choice(ERRORS)
    bad = c.rank in erring_ranks(rng, c.size)
    seen = await inject(c, kind, bad, t)
    await checks(c, rng, t)
    if kind == "stray_named":
        await finish_stray(c, bad, t)
    stats = c.statistics()
    lane = c.lowlevel.user_lane
    left = [(op.describe(), op.state.name, op.slot) for op in c._engine.inflight]
    assert stats.in_flight == 0 and lane.matcher is None, (t, kind, left, lane.matcher)
    return kind, seen


def judge(kind: str, seen: list[str], size: int) -> None:
    """What every rank saw of one trial's error is what the design promises."""
    if kind in ("shape", "dtype", "op", "kind"):
        assert all(s.startswith("MismatchError") for s in seen) and len(set(seen)) == 1, seen
    elif kind == "name":
        assert all(s.startswith("UnmatchedError") for s in seen) and len(set(seen)) == 1, seen
    elif kind == "invalid":
        local = ("InvalidInputError", "InputRejected")  # InputRejected is an InvalidInputError
        assert all(s.startswith((*local, "RemoteInputError")) for s in seen), seen
        assert any(s.startswith(local) for s in seen), seen
    elif kind == "duplicate":
        assert set(seen) <= {"ok", "ValueError"} and "ValueError" in seen, seen
    else:
        assert set(seen) == {"ok"}, seen


async def main() -> None:
    trials, seed = int(arg("--trials", "200")), int(arg("--seed", "1"))
    async with asynclock.start() as c:
        outcomes = [await trial(c, t, seed) for t in range(trials)]
        everyone = await c.allgather_object(outcomes, name="outcomes")
        counts: dict[str, int] = {}
        for t in range(trials):
            kind = outcomes[t][0]
            judge(kind, [everyone[r][t][1] for r in range(c.size)], c.size)
            counts[kind] = counts.get(kind, 0) + 1
        await c.drain(timeout=30)
        stats = c.statistics()
        assert stats.in_flight == 0 and stats.issued == stats.completed, stats
        report(c.rank, "done", f"{c.backend.name}: {trials} trials " + " ".join(
            f"{k}={v}" for k, v in sorted(counts.items())))


run(main)
