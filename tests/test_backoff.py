"""The one wait/backoff component: fed times by hand, never sleeping."""

from __future__ import annotations

import anyio
import pytest

from asynclock._core.base.backoff import Backoff, Deadline, poll_until, wait_until
from asynclock._core.device.waiting import WaitPolicy
from asynclock._core.engine.matching import FILLER_FIRST_S, FILLER_MAX_S
from asynclock._core.engine.policy import ProgressPolicy


def _engine_backoff(since: float = 0.0) -> Backoff:
    p = ProgressPolicy()
    return Backoff(p.min_sleep_s, p.max_sleep_s, share=p.sleep_fraction, busy_s=p.busy_s,
                   since=since)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_tight_then_growing_then_capped() -> None:
    b = _engine_backoff()
    assert b.next_sleep(0.0) == 0.0 and b.next_sleep(1.9e-3) == 0.0  # tight (busy_s 2 ms)
    assert b.busy(1.9e-3) and not b.busy(2e-3)
    assert b.next_sleep(2e-3) == 1e-3  # the floor
    assert b.next_sleep(0.1) == pytest.approx(5e-3)  # 5% of the wait
    assert b.next_sleep(10.0) == 20e-3  # the cap
    assert b.next_sleep(1.0e-3, tight=False) == 1e-3  # patient: no tight phase


def test_same_numbers_as_the_formula_it_replaces() -> None:
    p = ProgressPolicy()
    b = _engine_backoff()
    for i in range(200):
        waited = p.busy_s + i * 1.7e-3
        old = min(p.max_sleep_s, max(p.min_sleep_s, p.sleep_fraction * waited))
        assert b.next_sleep(waited) == old


def test_reset_restarts_the_tight_phase() -> None:
    b = _engine_backoff()
    assert b.next_sleep(1.0) == 20e-3
    b.reset(1.0)
    assert b.waited(1.001) == pytest.approx(1e-3)
    assert b.next_sleep(1.001) == 0.0
    assert b.next_sleep(1.003) == 1e-3


def test_max_s_replaces_the_cap_for_one_sleep() -> None:
    b = _engine_backoff()
    assert b.next_sleep(10.0, max_s=0.1) == 0.1  # 5% of 10 s is 0.5 s: capped at 0.1
    assert b.next_sleep(1.0, max_s=0.1) == pytest.approx(0.05)
    assert b.next_sleep(10.0) == 20e-3  # the usual cap again


def test_doubling_floor_is_the_matchers_old_filler_delay() -> None:
    b = Backoff(FILLER_FIRST_S, FILLER_MAX_S, growth=2.0, since=0.0)
    for idle in range(1, 40):  # the n-th slot in a row that changed nothing
        assert b.next_sleep(0.0) == min(0.05, 0.0005 * 2 ** min(idle, 7))
    b.reset(0.0)
    assert b.next_sleep(0.0) == 1e-3


def test_every_is_a_fixed_interval() -> None:
    b = Backoff.every(1e-3, clock=lambda: 0.0)
    assert {b.next_sleep(t) for t in (0.0, 1.0, 100.0)} == {1e-3}
    assert Backoff.every(0.0).next_sleep() == 0.0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        Backoff(2e-3, 1e-3)
    with pytest.raises(ValueError):
        Backoff(1e-3, 2e-3, growth=0.5)


def test_cuda_wait_policy_uses_it() -> None:
    p = WaitPolicy()
    b = p.backoff(start=5.0)
    assert b.next_sleep(5.0 + 0.5e-3) == 0.0
    assert b.next_sleep(5.0 + 20e-3) == pytest.approx(1e-3)
    assert b.next_sleep(5.0 + 10.0) == p.max_sleep_s


def test_deadline() -> None:
    clock = FakeClock()
    d = Deadline(2.0, clock=clock)
    assert not d.passed() and d.left() == 2.0
    clock.now = 2.0
    assert d.passed() and d.left() == 0.0
    never = Deadline(None, clock=clock)
    assert not never.passed(1e9) and never.left() is None


def test_poll_until_sleeps_as_told_and_gives_up_at_the_deadline() -> None:
    clock = FakeClock()
    tries = iter([False] * 5 + [True])
    b = Backoff(1e-3, 4e-3, growth=2.0, clock=clock)
    assert poll_until(lambda: next(tries), b, sleep=clock.sleep)
    assert clock.slept == [1e-3, 2e-3, 4e-3, 4e-3, 4e-3]

    clock = FakeClock()
    b = Backoff.every(0.5, clock=clock)
    assert not poll_until(lambda: False, b, timeout=2.0, sleep=clock.sleep)
    assert clock.slept == [0.5] * 4 and clock.now == 2.0


def test_poll_until_ready_at_once_never_sleeps() -> None:
    clock = FakeClock()
    assert poll_until(lambda: True, Backoff.every(1.0, clock=clock), timeout=0.0,
                      sleep=clock.sleep)
    assert clock.slept == []


def test_poll_until_tight_phase_retests_without_sleeping() -> None:
    clock = FakeClock()
    calls = 0

    def ready() -> bool:
        nonlocal calls
        calls += 1
        clock.now += 1e-4  # each test takes 0.1 ms
        return calls == 50

    b = Backoff(1e-3, 1e-3, busy_s=1.0, clock=clock)
    assert poll_until(ready, b, sleep=clock.sleep)
    assert clock.slept == []


def test_wait_until_checkpoints() -> None:
    seen = []

    async def main() -> None:
        done = anyio.Event()

        async def setter() -> None:
            seen.append("set")
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(setter)
            await wait_until(done.is_set, Backoff.every(0.0))
            seen.append("waited")

    anyio.run(main)
    assert seen == ["set", "waited"]


def test_the_poller_sleeps_at_most_a_cycle_while_a_synchronous_caller_is_blocked() -> None:
    """A blocked `hvd.*` caller is served tightly, then within Horovod's cycle time."""
    from asynclock._core.engine.progress import Engine

    engine = Engine(ProgressPolicy())
    since = engine._backoff.since
    later = since + 10.0  # 5% of 10 s waited: the poller's own cap (20 ms) applies
    assert engine.next_pause(later) == pytest.approx(ProgressPolicy().max_sleep_s)
    engine.blocked_callers = 1
    engine.eager_until = later + 1e-3
    assert engine.next_pause(later) == 0.0  # just blocked: tight
    assert engine.next_pause(later + 2e-3) == pytest.approx(1e-3)
    engine.blocked_callers = 0
    assert engine.next_pause(later + 2e-3) == pytest.approx(ProgressPolicy().max_sleep_s)


def test_a_blocked_caller_is_counted_only_while_it_waits() -> None:
    from asynclock._core.runtime.coordinator import Coordinator
    from asynclock._core.transports.local import LocalBackend

    coord = Coordinator(LocalBackend())
    seen: list[int] = []

    async def inside() -> None:
        seen.append(coord._engine.blocked_callers)

    async def fails() -> None:
        raise ValueError("bad input")

    try:
        coord.lowlevel.run_sync(inside)
        with pytest.raises(ValueError):
            coord.lowlevel.run_sync(fails)
        coord.lowlevel.run_sync(inside)
    finally:
        coord.shutdown()
    assert seen == [1, 1]
