"""Save checkpoints in a loop until the victim rank SIGKILLs itself.

The kill comes at a random time (`--kill time:SEED`) or at a chosen point
of the save protocol on the victim (`--kill publish:K`: before its K-th
atomic rename; `fsync_dir:K`: after a rename, before the directory fsync;
`write:K`: in the middle of the serializer's K-th write; `rmtree:K`: while
deleting an old set). Before saving, every run resumes from the newest
complete checkpoint and verifies it, so each trial also checks the last.

Usage: ckpt_kill.py --victim R --kill SPEC --serializer pickle|torch
                    [--sharded] WORKDIR
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import report
from ckpt_common import check_state, make_state
from sync_common import run_or_abort

import asynclock
from asynclock._tools import checkpoint

SAVES = 300  # the kill always comes long before this


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at_call(name: str, k: int) -> None:
    """Wrap checkpoint.<name> (or the serializer's write) to die at its k-th call."""
    calls = [0]

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            if calls[0] == k:
                if name == "write":  # half the bytes reach the temp file, then death
                    data = memoryview(args[1])
                    real(args[0], data[: len(data) // 2])
                die()
            return real(*args, **kwargs)
        return wrapper

    if name == "write":
        cls = checkpoint._HashingWriter
        cls.write = counted(cls.write)  # type: ignore[method-assign]
    elif name == "rmtree":
        checkpoint.shutil = _ShutilKill(counted(shutil.rmtree))  # type: ignore[assignment]
    else:
        setattr(checkpoint, name, counted(getattr(checkpoint, name)))


class _ShutilKill:
    """shutil as the checkpoint module sees it, with a deadly rmtree."""

    def __init__(self, rmtree: Callable[..., Any]) -> None:
        self.rmtree = rmtree


def arm(spec: str) -> None:
    what, _, arg = spec.partition(":")
    if what == "time":
        delay = random.Random(int(arg)).uniform(0.0, 0.4)
        threading.Timer(delay, die).start()
    else:
        kill_at_call(what, int(arg))


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--victim", type=int, required=True)
    p.add_argument("--kill", required=True)
    p.add_argument("--serializer", default="pickle")
    p.add_argument("--sharded", action="store_true")
    p.add_argument("--trio", action="store_true")
    p.add_argument("workdir", type=Path)
    return p.parse_args()


async def main() -> None:
    args = parse()
    async with asynclock.start() as c:
        ck = checkpoint.Checkpointer(c, args.workdir / "ckpt", keep=2, sharded=args.sharded,
                                     serializer=args.serializer)
        got = await ck.load(weights_only=False)
        start = 0
        if got is not None:
            step, state = got
            owner = c.rank if state["rank"] == c.rank else 0  # sharded: own; else rank 0's
            check_state(state, step, owner)
            start = step + 1
        report(c.rank, "resumed", str(start - 1))
        if c.rank == args.victim:
            arm(args.kill)
        for step in range(start, start + SAVES):
            await ck.save(step, make_state(step, c.rank, args.serializer))
    report(c.rank, "finished")


if __name__ == "__main__":
    run_or_abort(main)
