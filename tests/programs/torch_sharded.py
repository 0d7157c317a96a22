"""`DistributedOptimizer(shard_optimizer=True)`: one copy of parameters and state per
node, each rank updating the chunks it reduces.

Every check compares with the same optimizer run in one process over the
global batch (`torch_common`); small buckets that cut parameters make the
pieces cross parameter boundaries, and every rank owns some of them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from _common import expect, report
from torch_common import assert_close, batch, flat, loss_fn, mlp, reference_grads, shard

import asynclock.torch as hvd
from asynclock._core.base.errors import JoinedError
from asynclock.torch import Tuning

MiB = 1 << 20
SMALL = Tuning(bucket_cap_mb=40 / MiB, first_bucket_mb=24 / MiB)  # pieces cut parameters
Factory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, tuple[Factory, float]] = {  # (make, tolerance)
    "sgd": (lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True,
                                      weight_decay=1e-3), 1e-5),
    "adam": (lambda g: torch.optim.Adam(g, lr=0.01, amsgrad=True), 1e-4),
    "adamw": (lambda g: torch.optim.AdamW(g, lr=0.01, weight_decay=0.1), 1e-4),
}


def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
    """Two groups with different learning rates (a scheduler scales both)."""
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.05}]


def local_step(model: torch.nn.Module, step: int) -> None:
    x, y = batch(step, hvd.size())
    r, n = hvd.rank(), hvd.size()
    loss_fn(model, shard(x, r, n), shard(y, r, n)).backward()


def reference(make: Factory, steps: int, model: torch.nn.Module | None = None,
              opt: torch.optim.Optimizer | None = None) -> tuple[torch.nn.Module, Any]:
    """`steps` steps of the same optimizer in this process over the global batch."""
    model = model or mlp(seed=5)
    opt = opt or make(groups(model))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for step in range(steps):
        x, y = batch(step, hvd.size())
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        sched.step()
    return model, opt


def sharded(make: Factory, gated: bool = False,
            model: torch.nn.Module | None = None) -> tuple[torch.nn.Module, Any]:
    model = model or mlp(seed=5)
    opt = hvd.DistributedOptimizer(make(groups(model)), named_parameters=model.named_parameters(),
                                   tuning=SMALL, shard_optimizer=True,
                                   gate_forward=model if gated else None)
    return model, opt


def train(model: torch.nn.Module, opt: Any, steps: int, first: int = 0) -> None:
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sched.last_epoch = first  # resumed: the loaded groups already carry the schedule's lr
    for step in range(first, first + steps):
        opt.zero_grad()
        local_step(model, step)
        opt.step()
        sched.step()
    opt.apply_pending()


def check_matches_global_batch() -> None:
    """Plain and gated, three optimizers: parameters as in one process; each rank holds
    state for its own pieces only, and the parameters are the window's."""
    for name, (make, tol) in OPTIMIZERS.items():
        want = flat(reference(make, 6)[0])
        for gated in (False, True):
            model, opt = sharded(make, gated)
            train(model, opt, 6)
            assert_close(flat(model), want, f"{name} gated={gated}", rtol=tol, atol=tol)
            assert_one_copy_and_a_share_of_state(model, opt)
    report(hvd.rank(), "sharded_matches_global_batch")


def assert_one_copy_and_a_share_of_state(model: torch.nn.Module, opt: Any) -> None:
    shards = opt.sharded
    assert shards is not None, "never switched to shards"
    for i, p in enumerate(model.parameters()):
        assert p.data_ptr() == shards.param(i).data_ptr(), f"parameter {i} is not the window's"
    lo = shards.base_bytes.data_ptr()
    hi = lo + shards.base_bytes.numel()
    for p, state in opt.state.items():  # views of the window: no private copy is kept
        for key, t in state.items():
            assert lo <= t.data_ptr() < hi, f"state {key} of {tuple(p.shape)} is private"
    mine = sum(sub.numel() for inner, _ in shards.inner.values()
               for group in inner.param_groups for sub in group["params"])
    total = sum(p.numel() for p in model.parameters())
    assert abs(mine - total / hvd.size()) <= len(shards.pieces), (mine, total)


def check_checkpoint() -> None:
    """state_dict() on rank 0 alone equals the single-process optimizer's; loading a
    checkpoint into a running sharded optimizer (and model), then Horovod's broadcasts,
    resumes exactly."""
    make, tol = OPTIMIZERS["adam"]
    ref_model, ref_opt = reference(make, 3)
    model, opt = sharded(make)
    train(model, opt, 3)
    if hvd.rank() == 0:  # the others do not take part: no collective inside
        assert_state_equal(opt.state_dict(), ref_opt.state_dict(), tol)
    hvd.allreduce(torch.zeros(1), name="ckpt.read")  # rank 0 read before anyone moves on
    want = flat(reference(make, 6)[0])
    model.load_state_dict(ref_model.state_dict())
    opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # Horovod's usual calls:
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # ranks write the same bits in place
    train(model, opt, 3, first=3)
    assert_close(flat(model), want, "resumed", rtol=tol, atol=tol)
    report(hvd.rank(), "sharded_checkpoint")


def assert_state_equal(got: dict[str, Any], want: dict[str, Any], tol: float) -> None:
    assert got["param_groups"] == want["param_groups"], (got["param_groups"],
                                                         want["param_groups"])
    assert got["state"].keys() == want["state"].keys()
    for i, state in want["state"].items():
        assert got["state"][i].keys() == state.keys(), (i, got["state"][i].keys())
        for key, value in state.items():
            assert_close(got["state"][i][key], value, f"state {i} {key}", rtol=tol, atol=tol)


def check_accumulation() -> None:
    """backward_passes_per_step=2, and no_sync() before a last pass: the update of the
    gradients summed over both half-batches, averaged over ranks, as in one process."""
    make, tol = OPTIMIZERS["sgd"]
    want_model = mlp(seed=6)
    want_opt = make(groups(want_model))
    for how in ("passes", "no_sync"):
        model = mlp(seed=6)
        kw = {"backward_passes_per_step": 2} if how == "passes" else {}
        opt = hvd.DistributedOptimizer(make(groups(model)), tuning=SMALL, shard_optimizer=True,
                                       named_parameters=model.named_parameters(), **kw)
        for step in range(4):
            opt.zero_grad()
            if how == "no_sync":
                with opt.no_sync():
                    half_batch_loss(model, step, 0, hvd.rank()).backward()
            else:
                half_batch_loss(model, step, 0, hvd.rank()).backward()
            half_batch_loss(model, step, 1, hvd.rank()).backward()
            opt.step()
        if how == "passes":
            for step in range(4):
                want_opt.zero_grad()
                n = hvd.size()
                total = sum(half_batch_loss(want_model, step, h, r) for r in range(n)
                            for h in (0, 1))
                (total / n).backward()
                want_opt.step()
        assert_close(flat(model), flat(want_model), f"accumulated ({how})", rtol=tol, atol=tol)
    report(hvd.rank(), "sharded_accumulation")


def half_batch_loss(model: torch.nn.Module, step: int, half: int, r: int) -> torch.Tensor:
    x, y = batch(step, hvd.size())
    x, y = shard(x, r, hvd.size()), shard(y, r, hvd.size())
    return loss_fn(model, shard(x, half, 2), shard(y, half, 2))


def check_synchronize_and_clip() -> None:
    """Horovod's clipping recipe, sharded: after synchronize() `.grad` is the global-batch
    gradient on every rank; clipped in place, step() inside skip_synchronize() applies it
    (round 1, before the switch, goes the same way), and parameters land where one
    process with the same clipping lands."""
    make, tol = OPTIMIZERS["sgd"]
    model, opt = sharded(make, model=mlp(seed=7))
    want_model = mlp(seed=7)
    want_opt = make(groups(want_model))
    for step in range(4):
        want = reference_grads(model, hvd.size(), partial(rank_loss, step))
        opt.zero_grad()
        local_step(model, step)
        opt.synchronize()
        for (name, p), w in zip(model.named_parameters(), want, strict=True):
            assert_close(p.grad, w, f"synchronized step {step} {name}")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        assert norm > 0.1, f"step {step}: norm {norm} below the clip: nothing tested"
        with opt.skip_synchronize():
            opt.step()
        want_opt.zero_grad()
        loss_fn(want_model, *batch(step, hvd.size())).backward()
        torch.nn.utils.clip_grad_norm_(want_model.parameters(), 0.1)
        want_opt.step()
    assert opt.sharded is not None, "a synchronized round 1 never switched to shards"
    assert_close(flat(model), flat(want_model), "clipped", rtol=tol, atol=tol)
    report(hvd.rank(), "sharded_synchronize_clip")


def check_step_skipped_after_synchronize() -> None:
    """GradScaler's pattern when it finds inf or NaN: synchronize(), then no step().
    The skipped round ends without an update when the next step begins (no rank waits
    for its release), and Adam's parameters and state land where one process that
    skips the same steps lands."""
    make, tol = OPTIMIZERS["adam"]
    model, opt = sharded(make, model=mlp(seed=9))
    want_model = mlp(seed=9)
    want_opt = make(groups(want_model))
    skipped = {2, 3}  # past the switch into the window; twice in a row
    for step in range(6):
        opt.zero_grad()
        local_step(model, step)
        opt.synchronize()
        if step not in skipped:
            with opt.skip_synchronize():
                opt.step()
            want_opt.zero_grad()
            loss_fn(want_model, *batch(step, hvd.size())).backward()
            want_opt.step()
    opt.apply_pending()
    assert opt.sharded is not None, "round 1 never switched to shards"
    assert_close(flat(model), flat(want_model), "steps skipped", rtol=tol, atol=tol)
    report(hvd.rank(), "sharded_step_skipped")


def rank_loss(step: int, model: torch.nn.Module, r: int) -> torch.Tensor:
    x, y = batch(step, hvd.size())
    return loss_fn(model, shard(x, r, hvd.size()), shard(y, r, hvd.size()))


def check_refusals() -> None:
    """What sharding cannot do raises the same clear error on every rank."""
    model = mlp(seed=1)
    expect(ValueError, "elementwise", lambda: hvd.DistributedOptimizer(
        torch.optim.LBFGS(model.parameters()), shard_optimizer=True))
    meta = torch.nn.Linear(2, 2, device="meta")  # stands in for a GPU model here
    expect(ValueError, "CPU parameters only", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(meta.parameters(), lr=0.1), shard_optimizer=True))
    expect(ValueError, "compression", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer=True,
        compression=hvd.Compression.fp16))
    expect(ValueError, "shared-memory window", lambda: hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), shard_optimizer=True,
        tuning=Tuning(shm=False)))
    _, opt = sharded(OPTIMIZERS["sgd"][0], model=model)
    train(model, opt, 2)  # past the switch into the window
    local_step(model, 2)
    with opt.skip_synchronize():  # would apply unreduced gradients to the node's one copy
        expect(RuntimeError, "without synchronize() first", opt.step)
    expect(RuntimeError, "step(closure)", lambda: opt.step(lambda: None))
    opt.step()
    report(hvd.rank(), "sharded_refusals")


def check_join_refused() -> None:
    """A joined rank cannot update its pieces: the others' next step raises the same
    JoinedError naming shard_optimizer (decided by the round's agreed check), and
    join then completes everywhere."""
    model, opt = sharded(OPTIMIZERS["sgd"][0], model=mlp(seed=2))
    train(model, opt, 2)
    if hvd.rank() == 0:
        hvd.join()
    else:
        opt.zero_grad()
        local_step(model, 2)
        expect(JoinedError, "shard_optimizer", opt.step)
        hvd.join()
    report(hvd.rank(), "sharded_join_refused")


def check_usable_after_shutdown(model: torch.nn.Module, opt: Any) -> None:
    """Shutdown frees the window: parameters and state must have moved out first."""
    before, state_before = flat(model).clone(), opt.state_dict()
    hvd.shutdown()
    assert opt.sharded is None
    assert torch.equal(flat(model), before), "parameters changed at shutdown"
    assert_state_equal(opt.state_dict(), state_before, 0.0)
    for p in model.parameters():
        p.data.add_(1.0)  # private memory again: writable with no window behind it


def main() -> None:
    torch.set_num_threads(1)
    hvd.init()
    check_matches_global_batch()
    check_checkpoint()
    check_accumulation()
    check_synchronize_and_clip()
    check_step_skipped_after_synchronize()
    check_refusals()
    check_join_refused()
    model, opt = sharded(OPTIMIZERS["adam"][0])
    train(model, opt, 3)
    rank = hvd.rank()
    check_usable_after_shutdown(model, opt)
    report(rank, "sharded_usable_after_shutdown")
    report(rank, "done")


if __name__ == "__main__":
    main()
