"""Horovod API details on real ranks: differentiable collectives, scale factors on
integers, optimizer state created before its broadcast, `_parameter_names`.

The expected gradients are the ones Horovod 0.28.1 defines (its tests check them):
allreduce's is the same allreduce, allgather's the average then this rank's rows,
broadcast's the average on root and zeros elsewhere, alltoall's the reverse
alltoall, reducescatter's the allgather of the gradient times the size (Sum).
"""

from __future__ import annotations

import torch
from _common import expect, report

import asynclock.torch as hvd


def check_grads(rank: int, size: int) -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(3, 2).requires_grad_()
    hvd.allreduce(x, op=hvd.Sum).backward(torch.ones(3, 2))
    assert torch.equal(x.grad, torch.full((3, 2), float(size))), x.grad
    report(rank, "allreduce_grad")

    a, b = (torch.ones(2, requires_grad=True) for _ in range(2))
    outs = hvd.grouped_allreduce([a, b], op=hvd.Average)
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    assert torch.equal(a.grad, torch.ones(2)) and torch.equal(b.grad, torch.full((2,), 2.0))
    report(rank, "grouped_allreduce_grad")

    rows = rank + 1  # dim 0 differs per rank
    x = torch.ones(rows, 3, requires_grad=True)
    gathered = hvd.allgather(x)
    weights = torch.arange(gathered.shape[0], dtype=torch.float32).unsqueeze(1)
    (gathered * weights).sum().backward()
    start = sum(r + 1 for r in range(rank))
    want = torch.arange(start, start + rows, dtype=torch.float32).unsqueeze(1).expand(rows, 3)
    assert torch.equal(x.grad, want), (x.grad, want)
    report(rank, "allgather_grad")

    x = torch.ones(4, requires_grad=True)
    hvd.broadcast(x, root_rank=0).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 1.0 if rank == 0 else 0.0)), x.grad
    report(rank, "broadcast_grad")

    x = torch.ones(2 * size, 2, requires_grad=True)
    out, received = hvd.alltoall(x, splits=torch.tensor([2] * size))
    assert not received.requires_grad
    (out * 3).sum().backward()
    assert torch.equal(x.grad, torch.full((2 * size, 2), 3.0)), x.grad
    report(rank, "alltoall_grad")

    x = torch.ones(2 * size, requires_grad=True)
    hvd.reducescatter(x, op=hvd.Sum).sum().backward()
    assert torch.equal(x.grad, torch.full((2 * size,), float(size))), x.grad
    report(rank, "reducescatter_grad")

    with torch.no_grad():  # no autograd wanted: a plain result
        assert hvd.allreduce(torch.ones(2, requires_grad=True)).grad_fn is None
    report(rank, "no_grad_plain")


def check_integer_scaling(rank: int, size: int) -> None:
    t = torch.tensor([7, -7, 10], dtype=torch.int32)
    pre = hvd.allreduce(t, op=hvd.Sum, prescale_factor=0.5)
    assert pre.dtype == torch.int32 and torch.equal(pre, torch.tensor([3, -3, 5]) * size), pre
    post = hvd.allreduce(t, op=hvd.Sum, postscale_factor=0.5)
    want = (t.double() * size * 0.5).to(torch.int32)
    assert post.dtype == torch.int32 and torch.equal(post, want), post
    scattered = hvd.reducescatter(torch.full((2 * size,), 3, dtype=torch.int64), op=hvd.Sum,
                                  prescale_factor=0.5)
    assert scattered.dtype == torch.int64 and torch.equal(scattered, torch.full((2,), size))
    try:
        hvd.reducescatter(torch.ones(2 * size), op=hvd.Adasum)
        raise AssertionError("reducescatter accepted Adasum")
    except RuntimeError:
        pass
    # an average with a postscale is the sum scaled once by postscale / size (Horovod's
    # one scale), truncated toward zero: not averaged and truncated first
    ranked = torch.tensor([3, 5, 7, -7]) + rank
    total = sum(torch.tensor([3, 5, 7, -7]) + r for r in range(size))
    for factor in (2.0, 3.0):
        want = (total.double() * factor / size).to(torch.int64)
        got = [hvd.allreduce(ranked, op=hvd.Average, postscale_factor=factor),
               hvd.grouped_allreduce([ranked], op=hvd.Average, postscale_factor=factor)[0],
               hvd.allreduce_(ranked.clone(), op=hvd.Average, postscale_factor=factor)]
        for out in got:
            assert out.dtype == torch.int64 and torch.equal(out, want), (factor, out, want)
    rows = torch.arange(4 * size, dtype=torch.int64).reshape(2 * size, 2) + rank
    scattered = hvd.reducescatter(rows, op=hvd.Average, postscale_factor=3.0)
    summed = sum(torch.arange(4 * size, dtype=torch.int64).reshape(2 * size, 2) + r
                 for r in range(size))
    want = (summed.double() * 3.0 / size).to(torch.int64)[2 * rank:2 * rank + 2]
    assert torch.equal(scattered, want), (scattered, want)
    report(rank, "integer_scaling")


def check_handles_and_parameters(rank: int, size: int) -> None:
    """Horovod's answers: polling a synchronized handle raises ValueError, synchronizing
    it again returns None; in-place collectives write a parameter that requires grad
    (outside autograd), the next call works."""
    handle = hvd.allreduce_async(torch.ones(3), op=hvd.Sum)
    assert torch.equal(hvd.synchronize(handle), torch.full((3,), float(size)))
    expect(ValueError, "was not created or has been cleared", lambda: hvd.poll(handle))
    assert hvd.synchronize(handle) is None
    p = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    hvd.allreduce_(p, op=hvd.Sum)
    assert torch.equal(p.detach(), torch.full((3,), float(sum(range(1, size + 1))))), p
    hvd.grouped_allreduce_([p], op=hvd.Average)
    hvd.synchronize(hvd.allreduce_async_(p, op=hvd.Sum))
    assert p.requires_grad and p.grad_fn is None, p
    assert torch.equal(hvd.allreduce(torch.ones(1), op=hvd.Sum), torch.full((1,), float(size)))
    report(rank, "handles_and_parameters")


class Frozen(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.index = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32),
                                        requires_grad=False)
        self.weight = torch.nn.Parameter(torch.rand(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.weight, 0, self.index.long()) * x


def check_optimizer_state(rank: int) -> None:
    """A fresh optimizer with a parameter that never gets a gradient: the state is
    created by a local zero-gradient step, then root's is broadcast."""
    torch.manual_seed(rank)  # different weights per rank until the broadcast
    model = Frozen()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert model.index.grad is None
    assert model.weight.grad is not None and not model.weight.grad.any()
    buf = opt.state[model.weight]["momentum_buffer"]
    assert torch.equal(buf, torch.zeros(4)), buf
    same = hvd.allgather(model.weight.detach().unsqueeze(0))
    assert torch.equal(same[0], same[-1])
    model(torch.ones(2)).sum().backward()  # the optimizer still trains afterwards
    opt.step()
    report(rank, "optimizer_state_created")

    names = opt._parameter_names
    assert sorted(names.values()) == ["weight"], names
    report(rank, "parameter_names")


def check_duplicate_names(rank: int, size: int, rounds: int = 100) -> None:
    """Horovod's duplicate-name tests back to back: one rank issues a named call the
    others issue only after a barrier, and a second call with the name still in
    flight raises ValueError there; every call still completes with exact results,
    and the unnamed calls in between pair as before."""
    big = 17 * 17 * 17  # past the inline payload: the matched calls have data stages
    starts = {
        "ar": lambda i: hvd.allreduce_async(torch.full((big,), float(rank + i)), name="ar",
                                            op=hvd.Sum),
        "ag": lambda i: hvd.allgather_async(torch.full((big,), float(rank + i)), name="ag"),
        "bc": lambda i: hvd.broadcast_async(torch.full((big,), float(rank + i)), 0, name="bc"),
    }
    expect = {"ar": lambda i: torch.full((big,), float(sum(range(size)) + size * i)),
              "ag": lambda i: torch.cat([torch.full((big,), float(r + i)) for r in range(size)]),
              "bc": lambda i: torch.full((big,), float(i))}
    for i in range(rounds):
        for key, start in starts.items():
            handles = []
            for turn in (0, 1):
                if (rank == 0) == (turn == 0):
                    handles.append(start(i))
                    try:
                        start(i)
                        raise AssertionError(f"{key}: a second call named {key!r} was issued")
                    except ValueError:
                        pass
                hvd.barrier()
            total = hvd.allreduce(torch.tensor([float(rank)]), op=hvd.Sum)
            assert total.item() == sum(range(size)), (i, key, total)
            for h in handles:
                got = hvd.synchronize(h)
                assert torch.equal(got, expect[key](i)), (i, key, got[:4])
    report(rank, "duplicate_names")


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    check_grads(rank, size)
    check_integer_scaling(rank, size)
    check_handles_and_parameters(rank, size)
    check_optimizer_state(rank)
    check_duplicate_names(rank, size)
    hvd.shutdown()
    report(rank, "done")


if __name__ == "__main__":
    main()
