"""SyncBatchNorm: every rank's BatchNorm output and gradients equal plain BatchNorm's
on the concatenated global batch (rank r holds 2 + r samples, so counts differ).

Default: the Horovod-style sync API; `--async`: the async API, the model run in a
worker thread (and refused, by name, on the loop's own thread).
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import anyio
import anyio.from_thread
import torch
from _common import report, run

import asynclock
import asynclock.torch as hvd

STEPS = 3
Sum = Callable[[torch.Tensor], torch.Tensor]


def model_pair() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same weights twice: with SyncBatchNorm, and with plain BatchNorm2d."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4),
                              torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
    with torch.no_grad():
        ref[1].weight.uniform_(0.5, 1.5)
        ref[1].bias.uniform_(-0.5, 0.5)
    mine = hvd.SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(mine[1], hvd.SyncBatchNorm), mine
    return mine, ref


def batches(size: int, step: int) -> tuple[torch.Tensor, list[int]]:
    counts = [2 + r for r in range(size)]
    g = torch.Generator().manual_seed(10 + step)
    return torch.randn(sum(counts), 3, 6, 6, generator=g) * 3 + 1, counts


def one_step(mine: torch.nn.Module, ref: torch.nn.Module, rank: int, size: int, step: int,
             sum_over_ranks: Sum) -> None:
    """Forward and backward on both; compare output, input grad, parameter grads."""
    x, counts = batches(size, step)
    lo = sum(counts[:rank])
    local = x[lo: lo + counts[rank]].clone().requires_grad_(True)
    whole = x.clone().requires_grad_(True)
    for m in (mine, ref):
        m.zero_grad()
    out, ref_out = mine(local), ref(whole)
    torch.testing.assert_close(out, ref_out[lo: lo + counts[rank]], atol=1e-5, rtol=1e-4)
    out.sum().backward()  # sum, not mean: the local losses add up to the global one
    ref_out.sum().backward()
    torch.testing.assert_close(local.grad, whole.grad[lo: lo + counts[rank]], atol=1e-5,
                               rtol=1e-4)
    for (name, p), q in zip(mine.named_parameters(), ref.parameters(), strict=True):
        total = sum_over_ranks(p.grad)
        torch.testing.assert_close(total, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def check_running_stats(mine: torch.nn.Module, ref: torch.nn.Module) -> None:
    bn, rbn = mine[1], ref[1]
    torch.testing.assert_close(bn.running_mean, rbn.running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(bn.running_var, rbn.running_var, atol=1e-5, rtol=1e-5)
    assert int(bn.num_batches_tracked) == int(rbn.num_batches_tracked) == STEPS
    mine.eval()
    ref.eval()
    x, _ = batches(2, 99)
    torch.testing.assert_close(mine(x), ref(x), atol=1e-5, rtol=1e-4)


def main_sync() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mine, ref = model_pair()
    for step in range(STEPS):
        one_step(mine, ref, rank, size, step, lambda t: hvd.allreduce(t, op=hvd.Sum))
    check_running_stats(mine, ref)
    report(rank, "sync_api")
    hvd.shutdown()
    report(rank, "done")


async def main_async() -> None:
    async with asynclock.start() as c:
        mine, ref = model_pair()

        def total(t: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = anyio.from_thread.run(c.allreduce, t)
            return out

        for step in range(STEPS):
            await anyio.to_thread.run_sync(one_step, mine, ref, c.rank, c.size, step, total)
        check_running_stats(mine, ref)
        if c.size > 1:
            mine.train()
            try:
                mine(torch.ones(2, 3, 6, 6))
            except RuntimeError as exc:
                assert "would block the loop" in str(exc), exc
            else:
                raise AssertionError("a blocking collective ran on the loop's thread")
        report(c.rank, "async_api")
    report(c.rank, "done")


def main_join() -> None:
    """Uneven epochs with SyncBatchNorm and a DistributedOptimizer: joined ranks stand in
    on the model channel too, so the others' statistics cover the ranks still active."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    mine, ref = model_pair()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(mine.parameters(), lr=0.0),
                                   named_parameters=mine.named_parameters())
    for step in range(1 + rank):
        x, counts = batches(size, step)
        live = [r for r in range(size) if step < 1 + r]
        lo = sum(counts[:rank])
        opt.zero_grad()
        out = mine(x[lo: lo + counts[rank]])
        first, stop = sum(counts[:live[0]]), sum(counts[:live[-1] + 1])
        want = ref(x[first:stop])[lo - first: lo - first + counts[rank]]  # active ranks' batch
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)
        out.sum().backward()
        opt.step()
    assert hvd.join() == size - 1
    report(rank, "with_join")
    hvd.shutdown()
    report(rank, "done")


if "--async" in sys.argv:
    run(main_async)
elif "--join" in sys.argv:
    main_join()
else:
    main_sync()
