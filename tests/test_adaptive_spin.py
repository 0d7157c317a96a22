"""The engine's spin adapts per channel to how long its small ops take.

Across hosts a 64 KiB allreduce takes ~250 us over TCP, past the 200 us
default spin; the hand-off to the poller then cost ~450 us more (netrig,
Open MPI: raw 116 us, asynclock 567 us). A channel whose small ops finish
within `max_spin_s` now spins twice their median; one whose ops wait for
late peers keeps the default, and patient or threaded ops teach nothing.
"""

from __future__ import annotations

import pytest

from asynclock._core.engine.operation import Lane, State
from asynclock._core.engine.progress import Engine, ProgressPolicy
from asynclock._core.transports.local import LocalBackend

US = 1e-6


def _lane() -> Lane:
    return Lane(LocalBackend().channel("t"))


@pytest.mark.parametrize(("typical_us", "spin_us"), [
    (20, 200),     # fast channel: the default spin is the floor
    (300, 600),    # across hosts: twice the median, so the spin usually succeeds
    (800, 1000),   # capped at max_spin_s
    (5000, 200),   # ops wait for late peers: spinning longer would only burn the core
])
def test_spin_is_twice_the_typical_op_within_bounds(typical_us: int, spin_us: int) -> None:
    engine, lane = Engine(ProgressPolicy()), _lane()
    assert engine.spin_for(lane) == pytest.approx(200 * US)
    for _ in range(8):
        engine.note_latency(lane, typical_us * US)
    assert engine.spin_for(lane) == pytest.approx(spin_us * US)


def test_the_median_ignores_an_outlier() -> None:
    engine, lane = Engine(ProgressPolicy()), _lane()
    for seconds in (300 * US, 300 * US, 50e-3, 300 * US):
        engine.note_latency(lane, seconds)
    assert engine.spin_for(lane) == pytest.approx(600 * US)


def test_the_spin_is_re_derived_at_every_fourth_timed_op() -> None:
    """Sorting the window on every op once it is full would be a cost on every
    sampled small call; the median moves slowly, so every fourth op is enough."""
    lane = _lane()
    medians = [lane.note_latency(100 * US) is not None for _ in range(20)]
    assert medians == [n % 4 == 0 for n in range(1, 21)]


class _Op:
    """Finishes on its `after`-th poll."""

    def __init__(self, lane: Lane, after: int, patient: bool = False) -> None:
        self.lane, self.after, self.patient = lane, after, patient
        self.threaded, self.done, self.polls, self.issued_at = False, False, 0, 0.0
        self.state = State.HEADER  # its header round is in flight

    def start(self) -> None:
        return None

    def poll(self) -> bool:
        self.polls += 1
        self.done = self.polls >= self.after
        return self.done


def test_ops_finished_in_the_spin_teach_their_lane_patient_ones_do_not() -> None:
    engine, lane = Engine(ProgressPolicy(spin_s=0.5)), _lane()
    for _ in range(3):
        engine.submit(_Op(lane, 3))  # type: ignore[arg-type]
    engine.submit(_Op(lane, 1, patient=True))  # type: ignore[arg-type]
    assert len(lane.recent) == 3 and all(0 <= s < 0.5 for s in lane.recent)


# Calls of tens of microseconds, compared with what the engine recorded: run alone.
@pytest.mark.alone
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_staged_allreduces_teach_the_spin_their_whole_time(loop: str) -> None:
    from mpijob import assert_all_ok, run_job

    job = run_job("adaptive_spin.py", 2, *(["--trio"] if loop == "trio" else []), timeout=120)
    assert_all_ok(job, 2)
