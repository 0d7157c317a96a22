"""A torch.compile'd model under DistributedOptimizer: plain, layer-gated, SyncBatchNorm.

Gradients leave a compiled model through the same AccumulateGrad nodes, so the
hooks see them as in eager mode; the gate's pre-hooks and SyncBatchNorm wait
on buckets and collectives and must run eagerly (`asynclock.torch._grad.compile_exempt`)
instead of being traced. Each check compares with the eager single-process
result of the whole global batch.
"""

from __future__ import annotations

import copy

import torch
from _common import report
from torch_common import assert_close, batch, flat, hooked, loss_fn, mlp, shard

import asynclock.torch as hvd
from asynclock.torch import Tuning

MiB = 1 << 20


def train(model: torch.nn.Module, steps: int, **kw: object) -> torch.nn.Module:
    """`steps` SGD steps of the compiled `model` on this rank's shard; returns it."""
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), **kw)
    compiled = torch.compile(model)
    for step in range(steps):
        x, y = batch(step, hvd.size())
        opt.zero_grad()
        loss_fn(compiled, shard(x, hvd.rank(), hvd.size()), shard(y, hvd.rank(), hvd.size())
                ).backward()
        opt.step()
    if kw.get("gate_forward") is not None:
        opt.apply_pending()
    return model


def reference(model: torch.nn.Module, steps: int) -> torch.nn.Module:
    """The same steps in one eager process over the global batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(step, hvd.size())
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
    return model


def check_plain_and_gated() -> None:
    """The plain run compiles the model class first: the gated optimizer's hooks come
    later, which compiled code skips unless it is dropped (`forget_compiled_code`)."""
    want = flat(reference(mlp(seed=3), 4))
    plain = flat(train(mlp(seed=3), 4))
    gated_model = mlp(seed=3)
    gated = flat(train(gated_model, 4, gate_forward=gated_model))
    assert_close(plain, want, "compiled, plain")
    assert_close(gated, want, "compiled, gated")  # graph breaks at hooks: last-bit rounding
    report(hvd.rank(), "compiled_plain_gated")


class OutsideUse(torch.nn.Module):
    """`stale`'s parameters are read without calling that module: its pre-hook never
    runs. With "body", head's gradients arrive first and their buckets are already
    on their way on every rank when the error stops backward."""

    def __init__(self, stale: str) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.body, self.head = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.stale = stale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear = torch.nn.functional.linear
        if self.stale == "head":
            return linear(self.body(x), self.head.weight, self.head.bias)
        return self.head(linear(x, self.body.weight, self.body.bias))


class Tied(torch.nn.Module):
    """Input and output layers share one weight, which both modules own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(6)
        self.inp, self.out = torch.nn.Linear(3, 6, bias=False), torch.nn.Linear(6, 3, bias=False)
        self.out.weight = self.inp.weight  # [6, 3] used transposed by `out`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tanh(self.inp(x)), self.out.weight.t())


def check_tied_weights_gated() -> None:
    """A weight two modules own is updated by the first of them to run: gated equals plain."""
    def run(gate: bool) -> torch.Tensor:
        model = Tied()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       gate_forward=model if gate else None)
        for step in range(4):
            g = torch.Generator().manual_seed(50 + step)
            x, y = torch.randn(4 * hvd.size(), 3, generator=g), torch.randn(4 * hvd.size(), 3,
                                                                             generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(shard(x, hvd.rank(), hvd.size())),
                                         shard(y, hvd.rank(), hvd.size())).backward()
            opt.step()
        if gate:
            opt.apply_pending()
        return flat(model)

    plain, gated = run(False), run(True)
    assert torch.equal(plain, gated), f"tied, gated differs: {(plain - gated).abs().max()}"
    report(hvd.rank(), "tied_weights_gated")


def stale_read_fails(model: OutsideUse, stale: str) -> None:
    one_each = Tuning(bucket_cap_mb=1 / MiB, first_bucket_mb=1 / MiB, partition=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), gate_forward=model,
                                   tuning=one_each)  # one module's buckets carry nothing else
    x, y = batch(0, hvd.size())
    for step in range(3):  # round 1 is applied at once (a re-plan follows); then deferred
        opt.zero_grad()
        try:
            loss_fn(model, x, y).backward()
        except RuntimeError as exc:
            assert f"the gradient of {stale}." in str(exc), exc
            assert "read the old value" in str(exc), exc
            assert step == 2, f"stale at step {step}"
            return
        opt.step()  # from round 2: the update waits for a pre-hook that will not run
    raise AssertionError(f"a stale forward trained on ({stale})")


def check_stale_read_is_an_error() -> None:
    """A gated parameter read before its deferred update fails loudly on every rank, at
    the first gradient computed from the old value, instead of training on silently;
    a parameter outside the gated model is refused when the optimizer is made."""
    for stale in ("head", "body"):
        stale_read_fails(OutsideUse(stale), stale)
    other = mlp(seed=9)
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1),
                                 named_parameters=other.named_parameters(),
                                 gate_forward=other[0])
    except ValueError as exc:
        assert "are not in the gated model" in str(exc) and "'2.weight'" in str(exc), exc
    else:
        raise AssertionError("a gate without the optimizer's parameters was accepted")
    assert not hooked(other), f"the refused optimizer left hooks on {hooked(other)}"
    report(hvd.rank(), "stale_read_error")


def check_sync_batch_norm() -> None:
    """SyncBatchNorm in a compiled model normalises over the global batch."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), hvd.SyncBatchNorm(5))
    eager_model = copy.deepcopy(torch.nn.Sequential(model[0], torch.nn.BatchNorm1d(5)))
    x, _ = batch(0, hvd.size())
    got = torch.compile(model)(shard(x, hvd.rank(), hvd.size()))
    want = shard(eager_model(x), hvd.rank(), hvd.size())
    assert_close(got, want, "compiled SyncBatchNorm")
    report(hvd.rank(), "compiled_sync_batch_norm")


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    check_plain_and_gated()
    check_sync_batch_norm()
    check_tied_weights_gated()
    check_stale_read_is_an_error()
    report(hvd.rank(), "done")
    hvd.shutdown()


if __name__ == "__main__":
    main()
