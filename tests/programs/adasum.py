"""hvd.allreduce(op=hvd.Adasum): the same results as a float64 reference tree, on every rank.

`--horovod` runs the same checks on Horovod 0.28.1 (they pin its semantics); at a
size that is not a power of two, asynclock refuses on every rank.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from _common import report

if "--horovod" in sys.argv:
    import horovod.torch as hvd
else:
    import asynclock.torch as hvd


def reference(rows: list[np.ndarray]) -> np.ndarray:
    """Pairs (0,1), (2,3)..., then the pairs' results; a zero vector passes its partner."""
    def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        dot, a2, b2 = a @ b, a @ a, b @ b
        ca = 1 - dot / (2 * a2) if a2 > 0 else 1.0
        cb = 1 - dot / (2 * b2) if b2 > 0 else 1.0
        return ca * a + cb * b

    while len(rows) > 1:
        rows = [combine(rows[i], rows[i + 1]) for i in range(0, len(rows), 2)]
    return rows[0]


def expect(t: torch.Tensor, got: torch.Tensor, what: str) -> None:
    rows = hvd.allgather(t.reshape(1, -1))
    want = reference([rows[r].double().numpy() for r in range(hvd.size())])
    np.testing.assert_allclose(got.reshape(-1).double().numpy(), want, rtol=1e-5, atol=1e-6,
                               err_msg=what)
    same = hvd.allgather(got.reshape(1, -1))
    assert all(torch.equal(same[0], same[r]) for r in range(hvd.size())), f"{what}: ranks differ"


def check_values(rank: int) -> None:
    g = torch.Generator().manual_seed(7 + rank)
    for dtype in (torch.float32, torch.float64):
        t = torch.randn(3, 5, generator=g, dtype=dtype)
        got = hvd.allreduce(t, op=hvd.Adasum, name=f"ada.{dtype}")
        assert got.shape == t.shape and got.dtype == dtype, (got.shape, got.dtype)
        expect(t, got, f"allreduce {dtype}")
    zero = torch.zeros(6) if rank == 0 else torch.randn(6, generator=g)
    expect(zero, hvd.allreduce(zero, op=hvd.Adasum, name="ada.zero"), "a zero vector")
    a, b = torch.randn(4, generator=g), torch.randn(2, 3, generator=g)
    got_a = hvd.synchronize(hvd.allreduce_async(a, op=hvd.Adasum, name="ada.async"))
    expect(a, got_a, "allreduce_async")
    ga, gb = hvd.grouped_allreduce([a, b], op=hvd.Adasum, name="ada.group")
    expect(a, ga, "grouped[0]")
    expect(b, gb, "grouped[1]")
    report(rank, "adasum")


def check_refused(rank: int, size: int) -> None:
    """Not a power of two (ours refuses on every rank, before any message), or ints."""
    from asynclock._core.base.errors import InvalidInputError

    try:
        hvd.allreduce(torch.ones(3), op=hvd.Adasum)
    except InvalidInputError as exc:
        assert f"power-of-two number of ranks, not {size}" in str(exc), exc
    else:
        raise AssertionError("Adasum ran at a size that is not a power of two")
    report(rank, "refused")


def check_names(rank: int) -> None:
    """`hvd.Adasum` is a ReduceOp member as the other ops are; the names "Adasum" and
    "adasum" name the same op wherever an op is taken."""
    from asynclock._core.base.ops import ReduceOp

    assert hvd.Adasum is ReduceOp.ADASUM, hvd.Adasum
    g = torch.Generator().manual_seed(11 + rank)
    a, b = torch.randn(5, generator=g), torch.randn(3, generator=g)
    expect(a, hvd.allreduce(a, op="Adasum", name="ada.name"), "op='Adasum'")
    expect(a, hvd.synchronize(hvd.allreduce_async(a, op="adasum", name="ada.name_async")),
           "op='adasum', async")
    ga, gb = hvd.grouped_allreduce([a, b], op="Adasum", name="ada.name_group")
    expect(a, ga, "grouped op='Adasum'[0]")
    expect(b, gb, "grouped op='Adasum'[1]")
    report(rank, "names")


def check_ints(rank: int) -> None:
    from asynclock._core.base.errors import InvalidInputError

    try:
        hvd.allreduce(torch.ones(3, dtype=torch.int64), op=hvd.Adasum)
    except InvalidInputError as exc:
        assert "floating-point" in str(exc), exc
    else:
        raise AssertionError("Adasum of ints went through")
    report(rank, "ints")


def check_optimizer(rank: int, size: int) -> None:
    """DistributedOptimizer(op=Adasum) with momentum, 3 steps: every rank ends on the same
    parameters; their values are printed so a test compares them with Horovod's run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), op=hvd.Adasum)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    rows = hvd.allgather(flat[None], name="ada.params")
    assert all(torch.allclose(rows[0], rows[r], atol=1e-6) for r in range(size)), rows
    report(rank, "optimizer", " ".join(f"{v:.6f}" for v in flat.tolist()))


def main() -> None:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if "--optimizer" in sys.argv:
        check_optimizer(rank, size)
    elif size & (size - 1):
        check_refused(rank, size)
    else:
        check_values(rank)
        if "--horovod" not in sys.argv:
            check_names(rank)
            check_ints(rank)
    report(rank, "done")
    hvd.shutdown()


main()
