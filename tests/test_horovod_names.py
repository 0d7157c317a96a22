"""Names of the Horovod transport's data stages, in-process against a fake Horovod.

Horovod answers a name it has seen from its response cache, refuses a name already
in flight, and matches ranks' tensors by name. So the names must be the same on every
rank, come back step after step, and never be held twice at once on a rank
(`transports.horovod`, module text). The fake keeps Horovod's refusal of a name in
flight; a real job checks the rest (tests/test_horovod_parity.py).
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import numpy as np
import pytest
import torch

from asynclock._core.base.errors import BackendError
from asynclock._core.base.ops import ReduceOp
from asynclock._core.transports import horovod as transport
from asynclock._core.transports.horovod import HorovodChannel


class FakeHorovod:
    """Enough of horovod.torch for the channel: ops finish when the test says so."""

    Sum, Min, Max, Product = "sum", "min", "max", "product"

    def __init__(self) -> None:
        self.handles = itertools.count(1)
        self.names: dict[int, str] = {}  # handle -> name, of ops Horovod holds
        self.finished: set[int] = set()
        self.enqueued: list[str] = []
        self.refuse = False
        self.global_process_set = 0
        self.mpi_ops = types.SimpleNamespace(
            _grouped_allreduce_async=lambda ins, outs, name, *rest: self._enqueue(name))

    def _enqueue(self, name: str) -> int:
        if self.refuse:
            raise RuntimeError("Horovod has not been initialized; use hvd.init().")
        if name in {n for h, n in self.names.items() if h not in self.finished}:
            raise ValueError(f"Requested to reduce {name!r}, a name already in flight")
        handle = next(self.handles)
        self.names[handle] = name
        self.enqueued.append(name)
        return handle

    def allreduce_async_(self, tensor: Any, name: str, op: Any) -> int:
        return self._enqueue(name)

    def broadcast_async_(self, tensor: Any, root: int, name: str) -> int:
        return self._enqueue(name)

    def allgather_async(self, tensor: Any, name: str) -> int:
        return self._enqueue(name)

    def finish(self, name: str) -> None:
        self.finished |= {h for h, n in self.names.items() if n == name}

    def poll(self, handle: int) -> bool:
        if handle not in self.names:
            raise ValueError(f"Handle {handle} was not created or has been cleared.")
        return handle in self.finished

    def synchronize(self, handle: int) -> Any:
        assert handle in self.finished, "synchronize of an unfinished op would block"
        del self.names[handle]
        return torch.zeros(1)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeHorovod:
    hvd = FakeHorovod()
    monkeypatch.setattr(transport, "_module", hvd)
    return hvd


def channel(rank: int = 0) -> HorovodChannel:
    return HorovodChannel("grad", "asynclock0", rank, 2, None, None)


def allreduce(ch: HorovodChannel, n: int, op: ReduceOp = ReduceOp.SUM) -> Any:
    return ch.iallreduce(None, np.ones(n, np.float32), op)


def test_every_rank_names_the_same_stages_alike(fake: FakeHorovod) -> None:
    """Two ranks' channels issue the same stages: the same names, whatever finished."""
    for rank in (0, 1):
        ch = channel(rank)
        for step in range(3):
            for n in (100, 200, 100):
                allreduce(ch, n)
            ch.ibcast(np.ones(300, np.float32), 0)
            fake.finished |= set(list(fake.names)[: step])  # finishing order is local
        fake.names.clear()
    half = len(fake.enqueued) // 2
    assert fake.enqueued[:half] == fake.enqueued[half:]


def test_a_step_comes_back_to_its_names(fake: FakeHorovod) -> None:
    """Unnamed stages of one signature take a slot whose last use is 64 stages back, so a
    step of P stages returns to the same names every 64 / P steps; broadcasts (never
    cached by Horovod) stay unique."""
    ch = channel()
    steps = []
    for _ in range(100):
        before = len(fake.enqueued)
        allreduce(ch, 100)
        allreduce(ch, 200, ReduceOp.MAX)
        ch.ibcast(np.ones(10, np.float32), 1)
        steps.append(fake.enqueued[before:])
        for h in list(fake.names):
            fake.finished.add(h)
            fake.synchronize(h)
    allreduces = {name for step in steps for name in step[:2]}
    assert len(allreduces) == 2 * 22, sorted(allreduces)  # ceil(64 / 3) + 1 slots each
    assert steps[0][:2] == steps[22][:2] == steps[44][:2]
    assert steps[0][0] == "asynclock0.grad.allreduce.sum.float32.100.s0", steps[0]
    assert steps[0][1] == "asynclock0.grad.allreduce.max.float32.200.s0", steps[0]
    assert len({step[2] for step in steps}) == 100
    assert steps[5][2] == "asynclock0.grad.broadcast.17", steps[5]


def test_a_burst_of_equal_stages_takes_as_many_names(fake: FakeHorovod) -> None:
    """Equal stages all in flight at once each get a name of their own: none waits."""
    ch = channel()
    reqs = [allreduce(ch, 100) for _ in range(40)]
    assert all(r.handle is not None for r in reqs)
    assert len(set(fake.enqueued)) == 40


def test_a_labelled_stage_keeps_its_name_and_waits_for_its_last_use(
        fake: FakeHorovod) -> None:
    """A gradient bucket's stage is named after the bucket; the next round's stage of the
    same bucket, issued while the last is still in flight, is enqueued once it finished
    (Horovod would refuse it), by `Test` or by `Wait`."""
    ch = channel()
    with ch.named_stages("grad.g1.b3"):
        first = allreduce(ch, 100)
    with ch.named_stages("grad.g1.b3"):
        second = allreduce(ch, 100)
    with ch.named_stages("grad.g1.b3"):
        third = allreduce(ch, 100)
    name = "asynclock0.grad.grad.g1.b3.allreduce.sum"
    assert fake.enqueued == [name] and second.handle is None and third.handle is None
    assert not second.Test() and not third.Test() and fake.enqueued == [name]
    fake.finish(name)
    assert not third.Test(), "enqueued before the one ahead of it"
    assert not second.Test() and fake.enqueued == [name, name]  # enqueued, in flight
    assert first.Test() and first.done
    fake.finish(name)
    assert second.Test() and not third.Test() and fake.enqueued == [name] * 3
    fake.finish(name)
    third.Wait()
    assert third.done


def test_a_stage_waiting_for_its_name_reports_a_refused_enqueue(fake: FakeHorovod) -> None:
    ch = channel()
    with ch.named_stages("grad.g0.b0"):
        allreduce(ch, 8)
        waiting = allreduce(ch, 8)
    fake.refuse = True
    fake.finish("asynclock0.grad.grad.g0.b0.allreduce.sum")
    with pytest.raises(BackendError, match="not been initialized"):
        waiting.Test()
    assert waiting.released()
    with pytest.raises(BackendError, match="not been initialized"):
        allreduce(ch, 8)


def test_names_carry_what_a_cache_hit_would_reuse(fake: FakeHorovod) -> None:
    """Horovod's cache compares shape, dtype and device only; a hit reuses the cached
    response's kind, reduce op and scale factors, so those are in every name."""
    ch = channel()
    with ch.named_stages("grad.g0.b0"):
        ch.iallreduce_grouped([torch.ones(4)], [torch.ones(4)], 0.5)
    with ch.named_stages("grad.g0.b1"):
        allreduce(ch, 4, ReduceOp.MIN)
    ch.iallgatherv(np.ones(4, np.float32), np.ones(8, np.float32), [4, 4])
    assert fake.enqueued == ["asynclock0.grad.grad.g0.b0.grouped.x0.5",
                             "asynclock0.grad.grad.g0.b1.allreduce.min",
                             "asynclock0.grad.allgather.float32.c4a60b45.s0"]
