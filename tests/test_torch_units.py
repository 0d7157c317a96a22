"""In-process tests of the pure parts: bucket plans, priority order, options, storage."""

from __future__ import annotations

import pytest
import torch

from asynclock._core.base.ops import ReduceOp
from asynclock.torch._grad.buckets import Caps, ParamSpec, bucket_ready_times, build_plan
from asynclock.torch._grad.priority import busy_seconds, link_speed, priority_launch
from asynclock.torch._grad.reducer import ReduceOptions
from asynclock.torch._grad.registry import ParamRegistry
from asynclock.torch._grad.storage import GradStorage

F32 = 4


def specs(*numels: int, group: str = "float32") -> list[ParamSpec]:
    return [ParamSpec(n, group, F32) for n in numels]


def covered(plan, n_params: int) -> dict[int, list[tuple[int, int]]]:  # type: ignore[no-untyped-def]
    out: dict[int, list[tuple[int, int]]] = {i: [] for i in range(n_params)}
    for b in plan.buckets:
        assert b.numel == sum(s.numel for s in b.segments)
        for s in b.segments:
            out[s.param].append((s.start, s.stop))
    return out


def test_every_element_in_exactly_one_bucket_contiguously() -> None:
    sp = specs(10, 300, 7, 64, 1)
    plan = build_plan([4, 3, 2, 1, 0], sp, Caps(bucket_bytes=200, first_bucket_bytes=40))
    for i, ranges in covered(plan, len(sp)).items():
        assert sorted(ranges)[0][0] == 0 and sorted(ranges)[-1][1] == sp[i].numel
        assert all(a[1] == b[0] for a, b in zip(sorted(ranges), sorted(ranges)[1:], strict=False))
    offsets = [(b.offset, b.numel) for b in plan.buckets]
    assert all(o + n == o2 for (o, n), (o2, _) in zip(offsets, offsets[1:], strict=False))
    for b in plan.buckets:
        for s in b.segments:  # each parameter's range is contiguous in the buffer
            assert s.offset == plan.param_offset[s.param] + s.start


def test_caps_first_bucket_and_partitions() -> None:
    plan = build_plan([0, 1], specs(100, 100), Caps(bucket_bytes=160, first_bucket_bytes=40))
    sizes = [b.nbytes for b in plan.buckets]
    assert sizes[0] == 40 and max(sizes) <= 160 and sum(sizes) == 800
    assert plan.param_buckets[0] == (0, 1, 2, 3) and plan.buckets[3].params == (0, 1)


def test_no_partition_keeps_tensors_whole() -> None:
    plan = build_plan([2, 1, 0], specs(5, 500, 5), Caps(1, 1, partition=False))
    assert [b.params for b in plan.buckets] == [(2,), (1,), (0,)]
    one = build_plan([2, 1, 0], specs(5, 500, 5), Caps(1 << 30, 1 << 30))
    assert len(one.buckets) == 1 and one.buckets[0].numel == 510


def test_gathering_keeps_large_tensors_alone_and_small_ones_together() -> None:
    # backward order: a small tensor, a large one, two small, a large, a small
    sp = specs(10, 400, 20, 30, 300, 5) + [ParamSpec(8, "float16", 2)]
    order = [0, 1, 2, 6, 3, 4, 5]
    plan = build_plan(order, sp, Caps(bucket_bytes=1000, first_bucket_bytes=200,
                                      partition=False, gather=True))
    assert [b.params for b in plan.buckets] == [(1,), (4,), (0, 2, 3, 5), (6,)]
    for group in ("float32", "float16"):  # one contiguous range per bucket, in bucket order
        spans = [(b.offset, b.numel) for b in plan.buckets if b.group == group]
        assert spans[0][0] == 0
        assert all(o + n == o2 for (o, n), (o2, _) in zip(spans, spans[1:], strict=False))
    for b in plan.buckets:
        assert b.numel == sum(s.numel for s in b.segments)
        here = b.offset
        for s in b.segments:
            assert s.offset == here == plan.param_offset[s.param]
            here += s.numel
    assert plan.group_numel == {"float32": 765, "float16": 8}
    for cut in (True, None):  # gathering lays tensors out whole
        with pytest.raises(ValueError, match="uncut plan"):
            Caps(partition=cut, gather=True)
    # without gathering each large tensor closes the open bucket
    plain = build_plan(order, sp, Caps(1000, 200, partition=False))
    assert [b.params for b in plain.buckets] == [(0,), (1,), (2, 3), (4,), (6,), (5,)]


def test_cap_below_itemsize_still_terminates() -> None:
    plan = build_plan([0], specs(3), Caps(1, 1))
    assert [b.numel for b in plan.buckets] == [1, 1, 1]


def test_fixed_groups_and_dtype_groups() -> None:
    sp = specs(4, 4, 4) + [ParamSpec(4, "float16", 2)]
    plan = build_plan([3, 2, 1, 0], sp, Caps(1 << 20, 1 << 20), groups=[(0, 2)])
    by_group = {b.group: b for b in plan.buckets if b.group == "float16"}
    assert by_group["float16"].params == (3,)
    assert any(b.params == (2, 0) or b.params == (0, 2) for b in plan.buckets)
    assert plan.group_numel == {"float32": 12, "float16": 4}


def test_a_bucket_label_names_what_it_holds_not_the_plan() -> None:
    """Horovod's response cache keys on names: a re-plan that keeps a bucket keeps its
    label (the profiling round's names are hit after it), one that changes it does not
    (Horovod would find another shape under a cached name)."""
    sp = specs(10, 300, 7, 64, 1)
    caps = Caps(bucket_bytes=200, first_bucket_bytes=40)
    first = build_plan([4, 3, 2, 1, 0], sp, caps)
    again = build_plan([4, 3, 2, 1, 0], sp, caps, launch=list(reversed(range(len(first.buckets)))))
    assert [b.label for b in first.buckets] == [b.label for b in again.buckets]
    assert len({b.label for b in first.buckets}) == len(first.buckets)
    moved = build_plan([4, 3, 1, 2, 0], sp, caps)  # parameters 1 and 2 swap places
    kept = {b.label for b in first.buckets} & {b.label for b in moved.buckets}
    assert kept == {b.label for b in first.buckets if set(b.params) <= {4, 3}}, kept
    wide = build_plan([4, 3, 2, 1, 0], [ParamSpec(n, "float64", 8) for n in (10, 300, 7, 64, 1)],
                      Caps(bucket_bytes=400, first_bucket_bytes=80))
    assert not {b.label for b in wide.buckets} & {b.label for b in first.buckets}


def test_launch_order_must_be_a_permutation() -> None:
    with pytest.raises(ValueError, match="permutation"):
        build_plan([0, 1], specs(4, 4), Caps(1, 1, partition=False), launch=[0, 0])
    with pytest.raises(ValueError, match="permutation"):
        build_plan([0, 0], specs(4, 4), Caps())


def test_priority_keeps_ready_order_when_link_is_idle() -> None:
    ready, nbytes = [0.0, 1.0, 2.0, 3.0], [100] * 4
    assert priority_launch(ready, nbytes, seconds_per_byte=1e-6) == (0, 1, 2, 3)


def test_priority_lets_front_buckets_jump_a_busy_link() -> None:
    # buckets 0-2 (parts of a big last layer) are ready at once and take 1 s
    # each; buckets 3 and 4 (nearer the input) arrive while the link is busy
    # and each goes next, ahead of the remaining parts.
    ready = [0.0, 0.0, 0.0, 0.5, 1.5]
    order = priority_launch(ready, [100] * 5, seconds_per_byte=0.01, latency_s=0.0)
    assert order == (2, 3, 4, 1, 0)
    assert sorted(order) == [0, 1, 2, 3, 4]


def test_link_speed_counts_overlap_once() -> None:
    assert busy_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert link_speed([(0, 2), (1, 3)], 300, optimism=1.0) == pytest.approx(0.01)
    assert link_speed([], 10) == 0.0


def test_bucket_ready_time_is_last_parameter() -> None:
    plan = build_plan([1, 0], specs(4, 4), Caps(1 << 20, 1 << 20))
    assert bucket_ready_times(plan, [0.3, 0.1]) == [0.3]


def test_options_scales_and_validation() -> None:
    assert ReduceOptions().scales(4) == (0.25, 1.0)
    assert ReduceOptions(predivide=2.0).scales(4) == (0.5, 0.5)
    assert ReduceOptions(op=ReduceOp.SUM).scales(4) == (1.0, 1.0)
    with pytest.raises(ValueError, match="predivide"):
        ReduceOptions(op=ReduceOp.SUM, predivide=2.0)
    with pytest.raises(NotImplementedError):
        ReduceOptions(op=ReduceOp.MAX)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        ReduceOptions(passes=0)
    assert ReduceOptions(stall_s=1).fingerprint() == ReduceOptions(stall_s=9).fingerprint()


def test_gradient_buckets_refuse_adasum_naming_its_optimizer() -> None:
    """Adasum combines optimizer steps (`DistributedOptimizer(op=Adasum)`), not buckets:
    a train step asked for it says so instead of reaching a transport without it."""
    from asynclock.torch._grad.options import build_options

    model = torch.nn.Linear(2, 2)
    reg = ParamRegistry(torch.optim.SGD(model.parameters(), lr=0.1).param_groups)
    for op in (ReduceOp.ADASUM, "Adasum"):
        with pytest.raises(ValueError, match=r"DistributedOptimizer\(optimizer, op=hvd.Adasum\)"):
            build_options(reg, op=op)


def test_registry_validates_named_parameters_like_horovod() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[1].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reg = ParamRegistry(opt.param_groups, model.named_parameters())
    assert reg.names == ["0.weight", "0.bias", "1.weight"] and len(reg.frozen) == 1
    with pytest.raises(ValueError, match="duplicates"):
        ParamRegistry(opt.param_groups, [("a", p) for p in model.parameters()])
    with pytest.raises(ValueError, match="not named"):
        ParamRegistry(opt.param_groups, list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="tuples"):
        ParamRegistry(opt.param_groups, [p for p in model.parameters()])


def test_storage_direct_views_and_staged_casts() -> None:
    """Direct: `.grad` becomes a view of the bucket; staged: cast in and out."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reg = ParamRegistry(opt.param_groups)
    model(torch.ones(4, 3)).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    direct = GradStorage(build_plan([1, 0], reg.specs(None), Caps()), reg)
    for i in (0, 1):
        direct.pack(i, 0.5)
    assert model.weight.grad.data_ptr() == direct.view(0).data_ptr()
    direct.unpack(0, 2.0)  # what an allreduce of one rank leaves, then postscale
    assert torch.equal(model.weight.grad, want[0]) and torch.equal(model.bias.grad, want[1])
    staged = GradStorage(build_plan([1, 0], reg.specs(torch.bfloat16), Caps()), reg)
    for i in (0, 1):
        staged.pack(i, 1.0)
    assert staged.comm[0].dtype == torch.bfloat16
    model.weight.grad.zero_()
    staged.unpack(0, 1.0)
    assert torch.allclose(model.weight.grad, want[0], rtol=1e-2)


class _FailedRun:
    """The parts of a StepRun the shared-memory transport reads."""

    def __init__(self, plan, released: list, finished: list) -> None:  # type: ignore[no-untyped-def]
        import threading

        self.number, self.generation, self.plan = 1, 0, plan
        self.size = len(plan.buckets)
        self.done = [threading.Event() for _ in plan.buckets]
        self.release = released.append
        self.finished = finished

    def finish(self, k: int, error: BaseException | None) -> None:
        self.finished.append((k, error))
        self.done[k].set()


def test_shm_bucket_packed_after_a_failed_round_issues_nothing() -> None:
    """Regression (CI, shm mismatch test): a bucket packed after its round failed
    started a fresh round, whose stage op only this rank issued."""
    from asynclock._core.base.errors import MismatchError
    from asynclock._core.engine.operation import Lane
    from asynclock._core.engine.progress import Engine
    from asynclock._core.transports.local import LocalBackend
    from asynclock.torch._grad.rounds import Round
    from asynclock.torch._grad.shm import ShmTransport

    plan = build_plan([1, 0], specs(16, 16), Caps(bucket_bytes=64, first_bucket_bytes=64))
    engine, lane = Engine(), Lane(LocalBackend().channel("grad"))
    engine.lanes.append(lane)
    transport = ShmTransport(engine, lane, None, plan, {}, 1.0, lambda fn: fn())
    try:
        released: list = []
        finished: list = []
        run = _FailedRun(plan, released, finished)
        rnd = transport._rounds[run.number] = Round(run)
        err = MismatchError("mismatched buckets")
        transport._fail(rnd, err)
        assert sorted(finished) == [(0, err), (1, err)] and released == [err]
        seq = lane.seq
        transport.packed(run, plan.launch[1])  # packed late, after the failure
        assert lane.seq == seq and not engine.inflight, "a lone stage op was issued"
    finally:
        transport.close()


def _one_rank_scheduler(nbuckets: int):  # type: ignore[no-untyped-def]
    """A scheduler on a one-rank local channel, and a run of `nbuckets` 8-float buckets."""
    from asynclock._core.engine.operation import Lane
    from asynclock._core.engine.progress import Engine
    from asynclock._core.transports.local import LocalBackend
    from asynclock.torch._grad.scheduler import Scheduler
    from asynclock.torch._grad.step_run import StepRun

    params = [torch.nn.Parameter(torch.ones(8)) for _ in range(nbuckets)]
    reg = ParamRegistry(torch.optim.SGD(params, lr=0.1).param_groups)
    sum(p.sum() for p in params).backward()
    plan = build_plan(list(range(nbuckets)), reg.specs(None), Caps(32, 32))
    storage = GradStorage(plan, reg)
    for i in range(nbuckets):
        storage.pack(i, 1.0)
    engine, lane = Engine(), Lane(LocalBackend().channel("grad"))
    engine.lanes.append(lane)
    run = StepRun(1, 0, plan, storage, 1, nbuckets)
    return Scheduler(engine, lane, 1 << 20), run, lane


def test_a_checked_round_issues_one_check_then_bare_data_stages() -> None:
    """One header round per gradient round, not one per bucket: the lane's
    sequence counts the check plus one per bucket, and no bucket has a header."""
    from asynclock._core.engine.operation import State
    from asynclock.torch._grad.scheduler import CheckedBucketOp

    scheduler, run, lane = _one_rank_scheduler(3)
    started: list[str] = []
    engine_submit = scheduler.engine.submit

    def submit(op):  # type: ignore[no-untyped-def]
        started.append(type(op).__name__)
        if isinstance(op, CheckedBucketOp):
            op.start = lambda: (CheckedBucketOp.start(op), started.append(op.state.name))
        return engine_submit(op)

    scheduler.engine.submit = submit  # type: ignore[method-assign]
    for k in run.plan.launch:
        scheduler.ready(run, k)
    stats = scheduler.statistics()
    assert (stats.checks, stats.launched, stats.header_buckets) == (1, 3, 0), stats
    assert started == ["RoundCheck"] + ["CheckedBucketOp", State.READY.name] * 3, started
    assert lane.seq == 4 and run.all_done() and run.errors == [None] * 3


def test_the_check_waits_for_the_round_before_to_launch_everything() -> None:
    """Its place on the lane is after every op of the round before, on every rank,
    however early this rank packs the next round's first bucket."""
    from asynclock.torch._grad.step_run import StepRun

    scheduler, first, lane = _one_rank_scheduler(2)
    second = StepRun(2, 0, first.plan, first.storage, 1, 2)
    scheduler.ready(first, first.plan.launch[1])  # not next in launch order: nothing goes
    scheduler.ready(second, second.plan.launch[0])
    assert scheduler.statistics().checks == 1 and lane.seq == 1  # the first round's check
    scheduler.ready(first, first.plan.launch[0])
    stats = scheduler.statistics()
    assert (stats.checks, stats.launched, lane.seq) == (2, 3, 5), (stats, lane.seq)


def test_a_failed_check_fails_every_bucket_and_launches_none() -> None:
    """The verdict is collective: every rank fails the whole round at once, and a
    bucket packed after that issues nothing."""
    from asynclock._core.base.errors import MismatchError
    from asynclock.torch._grad.scheduler import Check

    scheduler, run, lane = _one_rank_scheduler(3)
    err = MismatchError("plans differ")
    scheduler._check[run.number] = Check.PENDING  # as if the check were in flight
    scheduler.ready(run, run.plan.launch[0])
    assert scheduler.checking(run) and scheduler.statistics().launched == 0
    scheduler._checked(run, 0, err)
    assert not scheduler.checking(run)
    assert run.errors == [err] * 3 and run.all_done() and lane.seq == 0
    scheduler.ready(run, run.plan.launch[1])
    assert scheduler.statistics().launched == 0 and lane.seq == 0
