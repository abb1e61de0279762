"""The online per-instance speed estimate (coordinator/estimation.py): it recovers a
known speed from snapshots, skips what is not decoding, and tracks change."""

from __future__ import annotations

import math

import pytest

from coordinator import InstanceSnapshot, Interrupt, Route, Snapshot, TrajRecord
from coordinator.estimation import SpeedEstimator
from tests.coordinator.builders import COST


class Engine:
    """One instance decoding ``n`` trajectories whose steps take ``speed`` times the model's;
    lengths and KV advance exactly as a real engine's would."""

    def __init__(self, inst: int, speed: float, n: int = 20, length: int = 2_000) -> None:
        self.inst, self.speed = inst, speed
        self.lengths = [length] * n
        self.ids = list(range(inst * 1000, inst * 1000 + n))
        self.wait = 0

    def snapshot(self) -> InstanceSnapshot:
        run = tuple(TrajRecord(i, 0, 0, n, 50) for i, n in zip(self.ids, self.lengths, strict=True))
        wait = tuple(TrajRecord(10**6 + k, 0, 0, 50, 50) for k in range(self.wait))
        return InstanceSnapshot(self.inst, sum(self.lengths), run, wait, (), 0)

    def run_for(self, seconds: float) -> None:
        """Decode whole steps for ``seconds``; the fractional last step is dropped."""
        t = 0.0
        while True:
            step = self.speed * COST.step_latency(len(self.lengths), sum(self.lengths))
            if t + step > seconds:
                return
            t += step
            self.lengths = [n + 1 for n in self.lengths]


def observe_for(est: SpeedEstimator, engines: list[Engine], periods: int, t0: float = 0.0) -> float:
    t = t0
    for _ in range(periods):
        est.observe(Snapshot(tuple(e.snapshot() for e in engines), t))
        for e in engines:
            e.run_for(1.0)
        t += 1.0
    est.observe(Snapshot(tuple(e.snapshot() for e in engines), t))
    return t


def test_recovers_each_instances_speed() -> None:
    est = SpeedEstimator(COST)
    engines = [Engine(0, 1.0), Engine(1, 1.6), Engine(2, 0.7)]
    observe_for(est, engines, 30)
    for e in engines:
        # a dropped partial step per second biases the estimate by < one step (~3%)
        assert est.factor(e.inst) == pytest.approx(e.speed, rel=0.06)
    assert est.factors([2, 0]).tolist() == [est.factor(2), est.factor(0)]


def test_an_instance_never_observed_takes_the_median() -> None:
    est = SpeedEstimator(COST)
    assert est.factor(7) == 1.0  # nothing observed yet
    observe_for(est, [Engine(0, 1.0), Engine(1, 2.0), Engine(2, 1.2)], 20)
    assert est.factor(7) == pytest.approx(est.factor(2))


def test_intervals_with_commands_or_queues_are_skipped() -> None:
    est = SpeedEstimator(COST)
    e = Engine(0, 1.5)
    est.observe(Snapshot((e.snapshot(),), 0.0))
    e.run_for(1.0)
    est.note([Route(0, (1,)), Interrupt(0, (2,))])  # the interval holds prefill / a stall
    est.observe(Snapshot((e.snapshot(),), 1.0))
    assert est.observations == 0
    e.wait = 3  # preempted trajectories: re-prefill inside the interval
    e.run_for(1.0)
    est.observe(Snapshot((e.snapshot(),), 2.0))
    assert est.observations == 0
    e.wait = 0
    est.observe(Snapshot((e.snapshot(),), 3.0))  # queue at the interval's start: skipped
    e.run_for(1.0)
    est.observe(Snapshot((e.snapshot(),), 4.0))
    assert est.observations == 1
    assert est.factor(0) == pytest.approx(1.5, rel=0.06)


def test_an_anchor_that_leaves_is_replaced_without_a_measurement() -> None:
    est = SpeedEstimator(COST)
    e = Engine(0, 1.0)
    est.observe(Snapshot((e.snapshot(),), 0.0))
    e.run_for(1.0)
    e.ids[0], e.lengths[0] = 999_999, 100  # the head trajectory finished; a new one started
    est.observe(Snapshot((e.snapshot(),), 1.0))
    assert est.observations == 0  # its anchor is gone: nothing to time
    e.run_for(1.0)  # the new head is the anchor of the next interval
    est.observe(Snapshot((e.snapshot(),), 2.0))
    assert est.observations == 1


def test_an_anchor_that_moved_down_the_run_list_is_still_timed() -> None:
    est = SpeedEstimator(COST)
    e = Engine(0, 1.3)
    est.observe(Snapshot((e.snapshot(),), 0.0))
    e.run_for(1.0)
    e.ids.reverse()  # an engine that reports its batch in another order
    e.lengths.reverse()
    est.observe(Snapshot((e.snapshot(),), 1.0))
    assert est.observations == 1
    assert est.factor(0) == pytest.approx(1.3, rel=0.06)


def test_too_few_steps_are_not_timed() -> None:
    est = SpeedEstimator(COST, min_steps=8)
    e = Engine(0, 1.0)
    est.observe(Snapshot((e.snapshot(),), 0.0))
    e.run_for(0.1)  # ~4 steps
    est.observe(Snapshot((e.snapshot(),), 0.1))
    assert est.observations == 0


def test_tracks_a_slowdown_within_a_few_half_lives() -> None:
    est = SpeedEstimator(COST, halflife_s=10.0)
    e = Engine(0, 1.0)
    t = observe_for(est, [e], 30)
    assert est.factor(0) == pytest.approx(1.0, rel=0.06)
    e.speed = 2.0
    observe_for(est, [e], 40, t)
    assert est.factor(0) == pytest.approx(2.0, rel=0.08)


def test_factors_are_clipped_and_validated() -> None:
    est = SpeedEstimator(COST, bounds=(0.5, 2.0))
    est.set_factor(3, 100.0)
    assert est.factor(3) == pytest.approx(2.0)
    est.set_factor(3, 0.01)
    assert est.factor(3) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="factor"):
        est.set_factor(3, 0.0)
    with pytest.raises(ValueError, match="halflife_s"):
        SpeedEstimator(COST, halflife_s=0.0)
    with pytest.raises(ValueError, match="bounds"):
        SpeedEstimator(COST, bounds=(1.5, 2.0))
    assert math.isfinite(est.factor(99))
