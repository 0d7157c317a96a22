"""Data-parallel training of a small CNN on scikit-learn's digits, with asynclock.

    mpiexec -n 2 python examples/train_digits.py        # ~97% test accuracy
    mpiexec -n 2 python examples/train_digits.py --shard-optimizer   # one node: Adam's
        # state and the parameters once per node, each rank updating its own chunks

Each rank trains on its own shard of the training set. Gradients travel in
buckets while backward is still running; with `gate_forward=True` the next
forward starts on layers whose buckets already arrived. A side task on the
same event loop prepares the next batches (shuffling, light augmentation)
while backward and communication run, which is the point of the async API.
Rank 0 shows a tqdm progress bar; every rank prints its result and rank 0
prints the summary.
"""

from __future__ import annotations

import argparse
import time

import anyio
import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import asynclock
from asynclock.torch import broadcast_parameters_async, training_policy

Batch = tuple[torch.Tensor, torch.Tensor]


def build_model() -> torch.nn.Sequential:
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1), torch.nn.ReLU(),
        torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(32 * 4 * 4, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 10))


def dataset(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """1437 training and 360 test images (8x8, 10 classes), the same split everywhere."""
    digits = load_digits()
    x = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(digits.target)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=0.2, random_state=seed,
                                          stratify=digits.target)
    return xtr, ytr, xte, yte


async def produce(send: anyio.abc.ObjectSendStream[Batch], x: torch.Tensor, y: torch.Tensor,
                  epochs: int, steps: int, batch: int, seed: int) -> None:
    """Side task: shuffled, lightly augmented batches, prepared ahead of time."""
    rng = np.random.default_rng(seed)
    async with send:
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(len(x)))
            for s in range(steps):
                idx = order[s * batch: (s + 1) * batch]
                noise = torch.from_numpy(rng.normal(0, 0.05, (len(idx), 1, 8, 8))).float()
                await send.send((x[idx] + noise, y[idx]))


def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[int, int]:
    with torch.no_grad():
        return int((model(x).argmax(1) == y).sum()), len(y)


async def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    async with asynclock.start(policy=training_policy()) as coord:
        rank, size = coord.rank, coord.size
        xtr, ytr, xte, yte = dataset(args.seed)
        x, y = xtr[rank::size], ytr[rank::size]  # this rank's shard
        steps = len(xtr) // size // args.batch  # the same number of steps on every rank
        torch.manual_seed(args.seed + rank)  # different init per rank: the broadcast fixes it
        model = build_model()
        await broadcast_parameters_async(coord, model.state_dict(), root_rank=0)
        opt = torch.optim.Adam(model.parameters(), lr=args.lr * size)
        step = coord.train_step(opt, model=model, gate_forward=True,
                                shard_optimizer=args.shard_optimizer)
        send, receive = anyio.create_memory_object_stream[Batch](max_buffer_size=4)
        bar = tqdm(total=args.epochs * steps, disable=rank != 0, unit="step", ncols=80,
                   mininterval=1.0)
        start = time.perf_counter()
        async with anyio.create_task_group() as tg, receive:
            tg.start_soon(produce, send, x, y, args.epochs, steps, args.batch, args.seed + rank)
            async for xb, yb in receive:
                async with step:
                    loss = await step.forward(lambda a, b: F.cross_entropy(model(a), b), xb, yb)
                    await step.backward(loss)
                bar.update()
                bar.set_postfix(loss=f"{loss.item():.3f}")
        bar.close()
        await step.flush()
        elapsed = time.perf_counter() - start
        await report(coord, model, (x, y), (xte[rank::size], yte[rank::size]), elapsed, args)


async def report(coord: asynclock.Coordinator, model: torch.nn.Module, shard: Batch,
                 test: Batch, elapsed: float, args: argparse.Namespace) -> None:
    """Each rank prints its own numbers; rank 0 adds the global test accuracy."""
    right, total = accuracy(model, *test)
    counts = await coord.allreduce(torch.tensor([right, total], dtype=torch.int64))
    acc = counts[0].item() / counts[1].item()
    print(f"rank {coord.rank}: trained on {len(shard[0])} images in {elapsed:.1f}s, "
          f"its test shard {right}/{total} = {right / total:.3f}", flush=True)
    await coord.barrier()
    if coord.rank == 0:
        print(f"summary: {coord.size} ranks, {args.epochs} epochs, "
              f"test accuracy {acc:.3f} on {counts[1].item()} held-out images "
              f"({'reached' if acc >= args.target else 'MISSED'} target {args.target})",
              flush=True)
    if acc < args.target:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=0.93)
    parser.add_argument("--shard-optimizer", action="store_true",
                        help="parameters and optimizer state once per node (one node, MPI)")
    anyio.run(train, parser.parse_args())


if __name__ == "__main__":
    main()
