"""Elastic training under `horovodrun --gloo --min-np N --max-np M`: a rank is SIGKILLed
mid-epoch, the survivors go on from the last commit, a host the discovery script adds
joins at the next commit, and rank 0 checks the end against a one-process reference.

    elastic_train.py WORKDIR [--api hvd|async|horovod] [--kill-at STEP] [--kill-rank R]
                     [--wait-for-cut] [--add-host NAME]

WORKDIR holds `hosts` (what the discovery script prints) and markers, so a rank that
joins later neither dies again nor adds a host again. Each step every rank trains on
its batch of the `ElasticSampler`'s shard; the committed state keeps, per step, every
rank's sample indices (hence the world size), so after the job rank 0 checks that the
epoch's samples were each used exactly once and replays the steps in one process:
the final parameters must match (float64, rtol 1e-9: the allreduce sums 3 ranks in
another order). Lines: `RANK r OK started pid=P`, `RANK r OK world size=N step=S
at=T` on a world's first step, `RANK r OK died at=T` just before the SIGKILL,
`RANK r OK done pid=P ...`, and rank 0's `RANK 0 OK checked ...`.

`--api horovod` runs the drop-in's code on real Horovod (`horovod.torch`), for
bench/elastic.py's recovery times; its sampler repeats samples to even out the shards,
so there is no check.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import report

import asynclock

# the drop-in, or Horovod itself with --api horovod
hvd: Any = importlib.import_module("horovod.torch" if "horovod" in sys.argv else
                                   "asynclock.torch")

N_SAMPLES, FEATURES, BATCH, COMMIT_EVERY = 480, 8, 4, 3
# Seconds between steps; longer in the 2-rank world, which must last until the added
# host joins (the driver polls the discovery script every second, the newcomer starts
# Python and torch meanwhile the survivors wait in the rendezvous).
PAUSE_S = {3: 0.08, 2: 0.15}
LR, MOMENTUM = 0.05, 0.9
RESETS: list[float] = []  # a reset callback notes each reset


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("workdir", type=Path)
    p.add_argument("--api", choices=("hvd", "async", "horovod"), default="hvd")
    p.add_argument("--kill-at", type=int, default=8,
                   help="a rank dies in this step, one past an uncommitted step (0: never)")
    p.add_argument("--kill-rank", type=int, default=2, help="the rank that dies")
    p.add_argument("--cut-for", type=float, default=0.0,
                   help="the rank freezes instead (a host cut off) and dies S seconds later, "
                        "as when the launcher's session to a cut host ends")
    p.add_argument("--wait-for-cut", action="store_true",
                   help="in that step every rank waits for WORKDIR/cut_host; the rank on that "
                        "host says `cut_me` and waits for WORKDIR/cut instead of dying, then "
                        "goes on: the test cuts the host's link meanwhile (netrig)")
    p.add_argument("--add-host", default="", help="after the loss, rank 0 adds this host")
    return p.parse_args()


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_SAMPLES, FEATURES, generator=g, dtype=torch.float64)
    y = (x @ torch.linspace(-1, 1, FEATURES, dtype=torch.float64)).unsqueeze(1)
    return x, y + 0.1 * torch.randn(N_SAMPLES, 1, generator=g, dtype=torch.float64)


def make_model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 4), torch.nn.Tanh(),
                               torch.nn.Linear(4, 1)).double()


def loss_of(model: torch.nn.Module, data: Any, batch: list[int]) -> torch.Tensor:
    x, y = data
    if not batch:  # a rank whose share of the epoch's tail is empty adds nothing
        return sum(p.sum() for p in model.parameters()) * 0.0  # type: ignore[return-value]
    idx = torch.tensor(batch)
    return ((model(x[idx]) - y[idx]) ** 2).sum() / BATCH


def next_batch(state: Any, rank: int) -> list[int]:
    """This rank's batch of the step: the sampler's shard, from where the epoch is."""
    done = state.step - state.epoch_start_step  # steps of this world so far
    return list(state.sampler)[done * BATCH:(done + 1) * BATCH]


def epoch_over(state: Any) -> bool:
    return state.sampler.processed_num >= N_SAMPLES


def wait_for_file(path: Path, limit_s: float = 120) -> str:
    deadline = time.monotonic() + limit_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.read_text().strip() if path.exists() else ""


def maybe_die(args: argparse.Namespace, rank: int, size: int, step: int) -> None:
    marker = args.workdir / "killed"
    if size != 3 or step != args.kill_at or marker.exists():
        return
    if args.wait_for_cut:  # the test names the host to cut once it knows where ranks run
        if socket.gethostname() == wait_for_file(args.workdir / "cut_host"):
            marker.write_text("")
            report(rank, "cut_me", f"at={time.time():.6f}")
            wait_for_file(args.workdir / "cut")
        return
    if rank == args.kill_rank:
        marker.write_text("")
        report(rank, "died", f"at={time.time():.6f}")
        if args.cut_for:
            subprocess.Popen(["sh", "-c", f"sleep {args.cut_for}; kill -9 {os.getpid()}"],
                             start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_add_host(args: argparse.Namespace, rank: int, size: int) -> None:
    marker = args.workdir / "added"
    if args.add_host and rank == 0 and size == 2 and not marker.exists():
        marker.write_text("")
        with (args.workdir / "hosts").open("a") as hosts:
            hosts.write(f"{args.add_host}:1\n")


def world_started(state: Any) -> None:
    """A new world: its steps take the sampler's fresh shard from the committed place."""
    state.epoch_start_step = state.step
    state.first_in_world = True


def after_step(state: Any, rank: int, size: int, batches: list[list[int]]) -> None:
    state.history.append(batches)
    state.step += 1
    state.sampler.record_batch(state.step, BATCH)
    if state.first_in_world:
        state.first_in_world = False
        report(rank, "world", f"size={size} step={state.step} at={time.time():.6f}")


# -- the drop-in API ---------------------------------------------------------------------
def run_hvd(args: argparse.Namespace) -> Any:
    hvd.init()
    report(hvd.rank(), "started", f"pid={os.getpid()} host={socket.gethostname()} "
           f"at={time.time():.6f}")
    data, model = dataset(), make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(range(N_SAMPLES), shuffle=True, seed=3)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, step=0,
                                   history=[], epoch_start_step=0, first_in_world=True)
    state.register_reset_callbacks([lambda: RESETS.append(time.time())])

    @hvd.elastic.run
    def train(state: Any) -> None:
        world_started(state)
        while not epoch_over(state):
            rank, size = hvd.rank(), hvd.size()
            batch = next_batch(state, rank)
            optimizer.zero_grad()
            loss = loss_of(model, data, batch)
            maybe_die(args, rank, size, state.step + 1)
            loss.backward()
            optimizer.step()
            after_step(state, rank, size, hvd.allgather_object(batch))
            time.sleep(PAUSE_S.get(size, 0.08))
            if state.step % COMMIT_EVERY == 0:
                maybe_add_host(args, rank, size)
                state.commit()

    train(state)
    return state, model


# -- the async API -----------------------------------------------------------------------
async def run_async(args: argparse.Namespace) -> Any:
    import anyio

    data, model = dataset(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    ticks: list[float] = []
    rank_size: list[tuple[int, int]] = []

    async def side_task() -> None:  # lives through resets on the same loop
        while True:
            ticks.append(time.monotonic())
            await anyio.sleep(0.05)

    async def train(coord: asynclock.Coordinator, state: Any) -> None:
        rank_size.append((coord.rank, coord.size))
        world_started(state)
        step = coord.train_step(optimizer)
        while not epoch_over(state):
            rank, size = coord.rank, coord.size
            batch = next_batch(state, rank)
            async with step:
                loss = loss_of(model, data, batch)
                maybe_die(args, rank, size, state.step + 1)
                await step.backward(loss)
            after_step(state, rank, size, await coord.allgather_object(batch))
            await anyio.sleep(PAUSE_S.get(size, 0.08))
            if state.step % COMMIT_EVERY == 0:
                maybe_add_host(args, rank, size)
                await state.commit_async()

    async with anyio.create_task_group() as tg:
        tg.start_soon(side_task)
        coord = await anyio.to_thread.run_sync(asynclock.init)
        report(coord.rank, "started", f"pid={os.getpid()} at={time.time():.6f}")
        sampler = hvd.elastic.ElasticSampler(range(N_SAMPLES), shuffle=True, seed=3)
        state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler,
                                       step=0, history=[], epoch_start_step=0,
                                       first_in_world=True)
        state.register_reset_callbacks([lambda: RESETS.append(time.time())])
        await asynclock.run_elastic(train, state)
        gaps = [b - a for a, b in zip(ticks, ticks[1:], strict=False)]
        report(rank_size[-1][0], "side_task", f"ticks={len(ticks)} max_gap={max(gaps):.3f}")
        tg.cancel_scope.cancel()
    return state, model, rank_size[-1][0]


# -- the check ---------------------------------------------------------------------------
def reference(history: list[list[list[int]]]) -> torch.nn.Module:
    """The same steps in one process: each step's gradient is the mean over that step's
    ranks of each rank's gradient on its batch."""
    data, model = dataset(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for batches in history:
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for batch in batches:
            model.zero_grad()
            loss_of(model, data, batch).backward()
            for g, p in zip(grads, model.parameters(), strict=True):
                g += p.grad / len(batches)
        for g, p in zip(grads, model.parameters(), strict=True):
            p.grad = g
        optimizer.step()
    return model


def check(rank: int, state: Any, model: torch.nn.Module) -> None:
    used = [i for batches in state.history for batch in batches for i in batch]
    assert sorted(used) == list(range(N_SAMPLES)), (
        f"samples lost or seen twice: {len(used)} used, {len(set(used))} distinct")
    ref = reference(state.history)
    with torch.no_grad():
        worst = max(float(((a - b).abs() / (b.abs() + 1e-12)).max())
                    for a, b in zip(model.parameters(), ref.parameters(), strict=True))
    assert all(torch.allclose(a, b, rtol=1e-9, atol=1e-12)
               for a, b in zip(model.parameters(), ref.parameters(), strict=True)), worst
    sizes = [len(b) for b in state.history]
    report(rank, "checked", f"steps={len(sizes)} sizes={''.join(map(str, sizes))} "
           f"worst_rel_diff={worst:.2e}")


def main() -> None:
    report(-1, "process", f"pid={os.getpid()} at={time.time():.6f}")
    args = parse()
    if args.api in ("hvd", "horovod"):
        state, model = run_hvd(args)
        rank, size = hvd.rank(), hvd.size()
    else:
        import anyio

        state, model, rank = anyio.run(run_async, args)
        size = len(state.history[-1])
    if rank == 0 and args.api != "horovod":
        check(rank, state, model)
    report(rank, "done", f"pid={os.getpid()} size={size} steps={state.step} resets={len(RESETS)}")
    if args.api != "async":
        hvd.shutdown()


main()
