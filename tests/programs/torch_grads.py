"""`asynclock.torch.DistributedOptimizer` on real ranks: gradients, agreement, errors.

Every check compares against the single-process gradient of the whole
global batch (each rank can compute it: the data comes from fixed seeds),
with the tolerance stated in torch_common (float32 rounding only).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from _common import report
from torch_common import (
    ATOL,
    RTOL,
    BagOfTokens,
    assert_close,
    assert_same_on_all_ranks,
    batch,
    flat,
    loss_fn,
    mlp,
    reference_grads,
    shard,
    token_loss,
)

import asynclock.torch as hvd
from asynclock._core.base.errors import MismatchError
from asynclock.torch import Tuning
from asynclock.torch._grad.buckets import Caps, build_plan
from asynclock.torch._grad.hooks import TOO_MANY

MiB = 1 << 20
CAPS = {
    "one_tensor_per_bucket": Tuning(bucket_cap_mb=1 / MiB, first_bucket_mb=1 / MiB,
                                    partition=False),
    "tiny_partitions": Tuning(bucket_cap_mb=40 / MiB, first_bucket_mb=24 / MiB, partition=True),
    # partition and window left to the transport: cut within 16 MiB on MPI, whole and
    # unbounded on Horovod's (Horovod fuses and queues buckets itself)
    "tiny_default": Tuning(bucket_cap_mb=40 / MiB, first_bucket_mb=24 / MiB),
    # over gloo, weights (96-256 bytes) alone and the three biases gathered past them
    "tiny_gathered": Tuning(bucket_cap_mb=100 / MiB, first_bucket_mb=24 / MiB),
    "everything_in_one": Tuning(bucket_cap_mb=1024, first_bucket_mb=1024),
    "default": Tuning(),
}


def gather(t: torch.Tensor) -> torch.Tensor:
    return hvd.allgather(t)


def sgd(model: torch.nn.Module, **kw: object) -> object:
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), **kw)


def local(step: int) -> object:
    rank, size = hvd.rank(), hvd.size()

    def loss(model: torch.nn.Module, r: int = rank) -> torch.Tensor:
        x, y = batch(step, size)
        return loss_fn(model, shard(x, r, size), shard(y, r, size))

    return loss


def check_grads(model: torch.nn.Module, opt: object, step: int, what: str,
                set_to_none: bool = True) -> None:
    """One step: reduced gradients equal the global-batch gradients, then apply."""
    loss = local(step)
    want = reference_grads(model, hvd.size(), loss)
    opt.zero_grad(set_to_none=set_to_none)
    loss(model).backward()
    opt.synchronize()
    for (name, p), w in zip(model.named_parameters(), want, strict=True):
        assert_close(p.grad, w, f"{what} step {step} {name}")
    with opt.skip_synchronize():
        opt.step()


def check_caps() -> None:
    n_params = len(list(mlp().parameters()))
    for label, tuning in CAPS.items():
        model = mlp(seed=1)
        opt = sgd(model, tuning=tuning)
        for step in range(3):  # round 1 on the guessed plan, then rank 0's agreed plan
            check_grads(model, opt, step, label)
        # zeroed in place, `.grad` keeps its tensor (in gloo's rounds: autograd's own)
        for step in range(3, 5):
            check_grads(model, opt, step, label, set_to_none=False)
        buckets = len(opt.reducer.plan.buckets)
        cut = any(len(ks) > 1 for ks in opt.reducer.plan.param_buckets.values())
        on_horovod = hasattr(opt.reducer.grad_lane.transport, "iallreduce_grouped")
        # gloo's rounds reduce whole tensors in place: left to it, the plan cuts none
        over_gloo = type(opt.reducer.transport).__name__ == "GlooRounds"
        unbounded = opt.reducer.scheduler.window_bytes > 1 << 40  # the credit window
        expect = {"one_tensor_per_bucket": buckets == n_params, "everything_in_one": buckets == 1,
                  "tiny_partitions": buckets > n_params and cut,
                  "tiny_default": (cut is not (on_horovod or over_gloo)
                                   and unbounded is on_horovod),
                  "tiny_gathered": (not over_gloo or [len(b.params) for b in
                                                      opt.reducer.plan.buckets] == [1, 1, 1, 3]),
                  "default": buckets >= 1}[label]
        assert expect, f"{label}: {buckets} buckets for {n_params} tensors"
        if over_gloo:  # reduced in place in autograd's tensors, not copied into buckets
            kept = opt.reducer._previous.buffers.params
            assert kept, f"{label}: every gradient went through the buckets' buffer"
        assert_same_on_all_ranks(model, gather, label)
        report(hvd.rank(), f"caps_{label}", f"{buckets} buckets")


def check_groups() -> None:
    """Horovod's `groups`: an int (even chunks) or explicit lists; one bucket each."""
    for label in ("int", "lists"):
        model = mlp(seed=13)
        params = list(model.parameters())
        groups = 2 if label == "int" else [params[:2], params[4:]]
        opt = sgd(model, groups=groups)
        for step in range(3):
            check_grads(model, opt, step, f"groups {label}")
        sets = [set(b.params) for b in opt.reducer.plan.buckets]
        want = [{0, 1, 2}, {3, 4, 5}] if label == "int" else [{0, 1}, {4, 5}]
        assert all(w in sets for w in want), f"groups {label}: buckets {sets}"
        assert_same_on_all_ranks(model, gather, f"groups {label}")
        report(hvd.rank(), f"groups_{label}")


def check_identical_after_20_steps() -> None:
    model, ref = mlp(seed=2), mlp(seed=2)
    opt = sgd(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(20):
        opt.zero_grad()
        local(step)(model).backward()
        opt.step()
        ref_opt.zero_grad()
        (sum(local(step)(ref, r) for r in range(hvd.size())) / hvd.size()).backward()
        ref_opt.step()
    assert_same_on_all_ranks(model, gather, "after 20 steps")
    assert torch.allclose(flat(model), flat(ref), rtol=1e-4, atol=1e-5), (
        f"drifted from single-process training: {(flat(model) - flat(ref)).abs().max()}")
    report(hvd.rank(), "identical_20_steps")
    transport = {"ShmTransport": "shm", "GlooRounds": "gloo"}.get(
        type(opt.reducer.transport).__name__, "allreduce")
    report(hvd.rank(), f"transport_{transport}")


LATE_S = 0.3  # how late the last rank comes to a round (`check_late_peer`)


def check_late_peer() -> None:
    """The last rank comes late to a round, whose check the others then wait for: every
    rank's gradients still match."""
    model = mlp(seed=5)
    opt = sgd(model)
    for step in range(2):  # round 1, then the agreed plan
        check_grads(model, opt, step, "late peer")
    if hvd.rank() == hvd.size() - 1:
        time.sleep(LATE_S)
    check_grads(model, opt, 2, "late peer")
    assert_same_on_all_ranks(model, gather, "late peer")
    report(hvd.rank(), "late_peer")


def check_step_closure() -> None:
    """`step(closure)`: the base optimizer steps on the rank average of the gradients
    the closure's backward made (as without a closure), so 5 steps land where one
    process over the global batch lands, the same on every rank."""
    model, ref = mlp(seed=4), mlp(seed=4)
    opt = sgd(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        def closure(step: int = step) -> torch.Tensor:
            opt.zero_grad()
            loss = local(step)(model)
            loss.backward()
            return loss
        opt.step(closure)
        ref_opt.zero_grad()
        (sum(local(step)(ref, r) for r in range(hvd.size())) / hvd.size()).backward()
        ref_opt.step()
    assert_same_on_all_ranks(model, gather, "after step(closure)")
    assert torch.allclose(flat(model), flat(ref), rtol=1e-4, atol=1e-5), (
        f"step(closure) drifted from single-process training: "
        f"{(flat(model) - flat(ref)).abs().max()}")
    report(hvd.rank(), "step_closure")


def check_handed_on_some_ranks_only() -> None:
    """Rank 0 zeroes in place, so from step 1 its gradients accumulate in the bucket
    buffers; the other ranks zero to None and hand autograd's tensors over (Horovod
    groups, shared memory). Every rank must still issue the same collectives and
    get the global-batch gradients. Horovod's transport sends its buckets as groups."""
    model = mlp(seed=6)
    opt = sgd(model)
    engine = opt.reducer.coord.lowlevel.engine
    waits = engine.statistics().thread_waits
    for step in range(3):
        check_grads(model, opt, 30 + step, "handed on some ranks", hvd.rank() != 0)
    waits = engine.statistics().thread_waits - waits
    assert_same_on_all_ranks(model, gather, "handed on some ranks")
    grouped = opt.reducer.scheduler.statistics().grouped_buckets
    report(hvd.rank(), "handed_some_ranks")
    report(hvd.rank(), f"grouped_{'yes' if grouped else 'no'}")
    # Horovod groups, small as they are here, are waited for in the wait thread
    if grouped and waits >= grouped:
        report(hvd.rank(), "grouped_in_thread", f"{waits} thread waits, {grouped} groups")


class Partial(torch.nn.Module):
    """Frozen layer, a branch only rank 0 uses, and a layer nobody uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(6, 8)
        self.frozen = torch.nn.Linear(8, 8).requires_grad_(False)
        self.rank0_only = torch.nn.Linear(8, 8)
        self.never = torch.nn.Linear(8, 3)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = torch.tanh(self.frozen(torch.tanh(self.a(x))))
        if branch:
            h = h + torch.tanh(self.rank0_only(h))
        return self.head(h)


def check_unused_and_frozen() -> None:
    model = Partial()
    frozen_before = flat(model.frozen).clone()
    opt = sgd(model)
    size = hvd.size()
    for step in range(3):
        x, y = batch(step, size)

        def loss(m: torch.nn.Module, r: int = hvd.rank(), x: torch.Tensor = x,
                 y: torch.Tensor = y) -> torch.Tensor:
            out = m(shard(x, r, size), r == 0)
            return torch.nn.functional.cross_entropy(out, shard(y, r, size))

        want = reference_grads(model, size, loss)
        opt.zero_grad()
        loss(model).backward()
        opt.synchronize()
        for (name, p), w in zip(model.named_parameters(), want, strict=True):
            if name.startswith("never"):  # unused everywhere: zeros, as in Horovod
                assert p.grad is not None and not p.grad.any(), f"{name}: {p.grad}"
            else:
                assert_close(p.grad, w, f"unused/frozen step {step} {name}")
        with opt.skip_synchronize():
            opt.step()
    assert torch.equal(flat(model.frozen), frozen_before), "a frozen parameter moved"
    assert model.frozen.weight.grad is None, "a frozen parameter got a gradient"
    assert_same_on_all_ranks(model, gather, "unused/frozen")
    report(hvd.rank(), "unused_frozen")


def check_accumulation() -> None:
    """3 local passes, one reduction: backward_passes_per_step and no_sync()."""
    size, passes = hvd.size(), 3
    for how in ("passes", "no_sync"):
        model = mlp(seed=4)
        opt = sgd(model, backward_passes_per_step=passes if how == "passes" else 1)
        for step in range(2):
            micro = [local(10 * step + m) for m in range(passes)]
            want = reference_grads(model, size,
                                   lambda mdl, r, fs=micro: sum(f(mdl, r) for f in fs))
            opt.zero_grad()
            for m, f in enumerate(micro):
                if how == "no_sync" and m < passes - 1:
                    with opt.no_sync():
                        f(model).backward()
                else:
                    f(model).backward()
            opt.synchronize()
            for (name, p), w in zip(model.named_parameters(), want, strict=True):
                assert_close(p.grad, w, f"accumulate {how} step {step} {name}", RTOL, 3 * ATOL)
            with opt.skip_synchronize():
                opt.step()
        assert_same_on_all_ranks(model, gather, f"accumulate {how}")
        report(hvd.rank(), f"accumulate_{how}")


def check_compression() -> None:
    """Relative to each tensor's largest gradient: fp16 2e-3, bf16 1.6e-2."""
    for name, comp, tol in (("fp16", hvd.Compression.fp16, 2e-3),
                            ("bf16", hvd.Compression.bf16, 1.6e-2)):
        model = mlp(seed=6)
        opt = sgd(model, compression=comp)
        for step in range(3):
            want = reference_grads(model, hvd.size(), local(step))
            opt.zero_grad()
            local(step)(model).backward()
            opt.synchronize()
            for (pname, p), w in zip(model.named_parameters(), want, strict=True):
                assert p.grad is not None and w is not None and p.grad.dtype == torch.float32
                err = (p.grad - w).abs().max().item()
                assert err <= tol * w.abs().max().item() + 1e-6, f"{name} {pname}: error {err}"
            with opt.skip_synchronize():
                opt.step()
        assert_same_on_all_ranks(model, gather, name)
        report(hvd.rank(), f"compression_{name}")


def check_predivide_and_sum() -> None:
    """gradient_predivide_factor splits the averaging; op=Sum skips it."""
    for label, kw, factor in (("predivide", {"gradient_predivide_factor": 2.0}, 1.0),
                              ("sum", {"op": hvd.Sum}, float(hvd.size()))):
        model = mlp(seed=12)
        opt = sgd(model, **kw)
        for step in range(2):
            want = reference_grads(model, hvd.size(), local(step))
            opt.zero_grad()
            local(step)(model).backward()
            opt.synchronize()
            for (name, p), w in zip(model.named_parameters(), want, strict=True):
                assert w is not None
                assert_close(p.grad, w * factor, f"{label} step {step} {name}")
            with opt.skip_synchronize():
                opt.step()
        report(hvd.rank(), label)


class TwoBranch(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(6, 8)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if hvd.rank() % 2:  # a different call order, hence a different hook order
            hb, ha = torch.tanh(self.b(x)), torch.tanh(self.a(x))
        else:
            ha, hb = torch.tanh(self.a(x)), torch.tanh(self.b(x))
        return self.head(ha * hb)


def check_hook_order_differs() -> None:
    model = TwoBranch()
    seen: list[str] = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _p, n=name: seen.append(n))
    opt = sgd(model, tuning=Tuning(bucket_cap_mb=1 / MiB, first_bucket_mb=1 / MiB,
                                   partition=False))
    for step in range(4):
        check_grads(model, opt, step, "hook order")
    orders = hvd.allgather_object(seen[:6])
    assert orders[0] != orders[1], f"hook orders did not differ: {orders}"
    assert_same_on_all_ranks(model, gather, "hook order")
    report(hvd.rank(), "hook_order_differs")


def force_reversed_launch_order(opt: object) -> None:
    """After the agreed re-plan, every rank installs the same layout launched back
    to front (a deliberately bad but agreed order), on this job's transport."""
    reducer = opt.reducer
    assert not reducer.replan_due
    order, n = list(reducer.plan.order), len(reducer.plan.buckets)
    layout = [b.segments for b in reducer.plan.buckets]
    for cut, gather in ((True, False), (False, False), (False, True)):  # as the reducer chose
        caps = replace(reducer.options.caps, partition=cut, gather=gather)
        if [b.segments for b in build_plan(order, reducer.specs, caps).buckets] == layout:
            break
    else:
        raise AssertionError("no caps rebuild the reducer's bucket layout")
    plan = build_plan(order, reducer.specs, caps, launch=range(n - 1, -1, -1))
    path = type(reducer.transport).__name__  # the same round path as before
    reducer._adopt(plan, path == "ShmTransport", path == "GlooRounds")


def check_gated_bit_identical() -> None:
    """Plain, per-bucket, layer-gated and reversed-order updates give the same bits (Adam),
    with an LR scheduler stepped right after each step(): a deferred update applies the
    rate its own step() saw (it used to take the next one's)."""
    tuning = Tuning(bucket_cap_mb=160 / MiB, first_bucket_mb=48 / MiB)
    models = [mlp(seed=8, hidden=12) for _ in range(4)]
    opts = [hvd.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01),
                                     named_parameters=m.named_parameters(), tuning=tuning, **kw)
            for m, kw in zip(models, [{}, {"per_bucket_step": True},
                                      {"gate_forward": models[2]}, {}], strict=True)]
    scheds = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]
    deferred = 0
    for step in range(6):
        for m, opt, sched in zip(models, opts, scheds, strict=True):
            opt.zero_grad()
            local(step)(m).backward()
            opt.step()
            sched.step()
        if step == 0:
            force_reversed_launch_order(opts[3])
        deferred += opts[2].reducer.updates.pending is not None
    opts[2].apply_pending()
    assert deferred == 5, f"gated optimizer deferred {deferred} of 5 rounds"
    for label, m in (("per_bucket", models[1]), ("gated", models[2]), ("reversed", models[3])):
        assert torch.equal(flat(models[0]), flat(m)), f"{label} differs from plain"
    opts[2].set_forward_gate(False)
    opts[2].zero_grad()
    local(9)(models[2]).backward()
    opts[2].step()
    assert opts[2].reducer.updates.pending is None, "gate switched off but update deferred"
    assert_same_on_all_ranks(models[2], gather, "gated")
    report(hvd.rank(), "gated_bit_identical", f"launch order {opts[2].reducer.plan.launch}")
    report(hvd.rank(), "gated_lr_of_its_step")


def check_too_many_passes() -> None:
    model = mlp(seed=9)
    opt = sgd(model)
    local(0)(model).backward()
    try:
        local(1)(model).backward()
    except AssertionError as exc:
        assert str(exc) == TOO_MANY, str(exc)
    else:
        raise AssertionError("a second backward before step() was accepted")
    opt.synchronize()  # the first pass's round still completes on every rank
    check_grads(model, opt, 2, "after too-many")
    report(hvd.rank(), "too_many_passes")


def check_mismatches() -> None:
    """Different models, different options, different buckets: same error everywhere."""
    for label, model, kw in (
        ("params", mlp(seed=10, hidden=8 + (hvd.rank() == 1)), {}),
        ("options", mlp(seed=10), {"backward_passes_per_step": 1 + (hvd.rank() == 1)}),
    ):
        try:
            sgd(model, **kw)
        except MismatchError as exc:
            texts = hvd.allgather_object(str(exc))
            assert all(t == texts[0] for t in texts), texts
            report(hvd.rank(), f"mismatch_{label}")
        else:
            raise AssertionError(f"{label} mismatch not detected")
    check_bucket_mismatch()


def check_bucket_mismatch() -> None:
    """Bypass the agreement on purpose: each bucket op is header-checked, on the
    allreduce transport, and each round checked, on the round paths this job uses
    (shared memory, gloo)."""
    paths = ["allreduce", *(["shm"] if shm_eligible() else []),
             *(["gloo"] if os.environ.get("ASYNCLOCK_BULK") == "gloo" else [])]
    for path in paths:
        torch.manual_seed(11)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False),
                                    torch.nn.Linear(4, 4, bias=False))
        opt = sgd(model, tuning=Tuning(bucket_cap_mb=1 / MiB, first_bucket_mb=1 / MiB,
                                       partition=False, replan=False))
        reducer = opt.reducer
        caps = Caps(80, 48) if hvd.rank() == 1 else reducer.options.caps
        # rank 1: 2 buckets of 12 and 20 elements instead of 16 and 16
        reducer._adopt(build_plan([1, 0], reducer.specs, caps), path == "shm", path == "gloo")
        model(torch.ones(2, 4)).sum().backward()
        for _attempt in range(2):  # the second step() re-raises: the channel is unusable
            try:
                opt.step()
            except MismatchError as exc:
                texts = hvd.allgather_object(str(exc))
                assert all(t == texts[0] for t in texts), texts
            else:
                raise AssertionError("mismatched buckets were reduced")
        assert type(reducer.transport).__name__ == {
            "shm": "ShmTransport", "gloo": "GlooRounds"}.get(path, "NoneType"), path
        report(hvd.rank(), f"mismatch_buckets_{path}")
    report(hvd.rank(), "mismatch_buckets")


def token_step(step: int) -> object:
    """This rank's token loss at `step`, taking any rank's (`reference_grads` form)."""
    def loss(model: torch.nn.Module, r: int = hvd.rank()) -> torch.Tensor:
        return token_loss(step, r)(model)

    return loss


def check_sparse_gradients() -> None:
    """`nn.Embedding(sparse=True)`: the sparse gradient travels dense (Horovod's
    sparse_as_dense=True, for either setting) and equals the dense global-batch
    gradient; SparseAdam, which takes sparse gradients only, is refused at once."""
    for as_dense in (False, True):
        model = BagOfTokens(seed=21)
        opt = sgd(model, sparse_as_dense=as_dense)
        for step in range(3):
            loss = token_step(step)
            want = [w.to_dense() for w in reference_grads(model, hvd.size(), loss)]
            opt.zero_grad()
            loss(model).backward()
            opt.synchronize()
            assert model.emb.weight.grad.layout == torch.strided, model.emb.weight.grad.layout
            for (name, p), w in zip(model.named_parameters(), want, strict=True):
                assert_close(p.grad, w, f"sparse_as_dense={as_dense} step {step} {name}")
            with opt.skip_synchronize():
                opt.step()
        assert_same_on_all_ranks(model, gather, f"sparse_as_dense={as_dense}")
    model = BagOfTokens(seed=22)  # two passes per step: sparse rows add into the dense sum
    opt = sgd(model, backward_passes_per_step=2)
    want = [a.to_dense() + b.to_dense() for a, b in zip(
        reference_grads(model, hvd.size(), token_step(5)),
        reference_grads(model, hvd.size(), token_step(6)), strict=True)]
    opt.zero_grad()
    token_step(5)(model).backward()
    token_step(6)(model).backward()
    opt.synchronize()
    for (name, p), w in zip(model.named_parameters(), want, strict=True):
        assert_close(p.grad, w, f"sparse, 2 passes {name}")
    with opt.skip_synchronize():
        opt.step()
    model = BagOfTokens(seed=21)
    try:
        hvd.DistributedOptimizer(torch.optim.SparseAdam(model.emb.parameters()),
                                 named_parameters=model.emb.named_parameters())
    except ValueError as exc:
        assert "SparseAdam takes sparse gradients only" in str(exc), exc
    else:
        raise AssertionError("SparseAdam was accepted")
    report(hvd.rank(), "sparse_gradients")


def shm_eligible() -> bool:
    from asynclock._core.runtime import coordinator as runtime
    from asynclock.torch._grad.shm import eligible

    coord = runtime.coordinator()
    switched_on = os.environ.get("ASYNCLOCK_NODE_WINDOW", "1") != "0"
    return eligible(coord, coord.lowlevel.grad_lane) and switched_on


CHECKS: dict[str, Callable[[], None]] = {
    "caps": check_caps, "groups": check_groups,
    "identical": check_identical_after_20_steps, "closure": check_step_closure,
    "late_peer": check_late_peer,
    "unused": check_unused_and_frozen,
    "handed": check_handed_on_some_ranks_only, "accumulation": check_accumulation,
    "compression": check_compression, "predivide": check_predivide_and_sum,
    "gated": check_gated_bit_identical, "too_many": check_too_many_passes,
    "sparse": check_sparse_gradients}
CHECKS_OF_TWO = {"hook_order": check_hook_order_differs, "mismatches": check_mismatches}


def main() -> None:
    """Every check in turn, or those named after --only (comma-separated)."""
    only = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None
    torch.set_num_threads(1)
    hvd.init()
    checks = {**CHECKS, **(CHECKS_OF_TWO if hvd.size() > 1 else {})}
    for name, check in checks.items():
        if only is None or name in only:
            check()
    report_node_window()
    report(hvd.rank(), "done")
    hvd.shutdown()


def report_node_window() -> None:
    """Say whether buckets went through the node window (across hosts, with several
    ranks on each, buckets from ASYNCLOCK_WINDOW_MIN_BYTES on take it)."""
    from asynclock._core.runtime import coordinator as runtime

    calls = getattr(runtime.coordinator().backend, "window_calls", lambda: 0)()
    if calls:
        report(hvd.rank(), "node_window", f"{calls} allreduces")


if __name__ == "__main__":
    main()
