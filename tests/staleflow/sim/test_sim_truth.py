"""What the simulated engines really do, apart from the coordinator's estimate
(staleflow/sim/truth.py), and the engine following it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from coordinator import CostModel
from coordinator.profiler import LatencySample
from staleflow.sim.engine import EngineCosts, SimInstance, SimTrajectory
from staleflow.sim.truth import (
    EngineTruth,
    InstanceTruth,
    ScaledCost,
    SlowdownClock,
    Slowdowns,
    StepTable,
    instance_truths,
    read_step_trace,
    true_cost,
)
from trajectory_server.types import RoutedTrajectory

COST = CostModel(k1=1e-6, k2=1e-3, k3=1e-4, k4=2e-3, k5=1.0, kv_budget=100_000.0)
_I, _F = np.zeros(0, np.int32), np.zeros(0, np.float32)


def _traj(inst: SimInstance, tid: int, prompt: int, response: int) -> SimTrajectory:
    routed = RoutedTrajectory(tid, 0, 0, 0, "", np.zeros(prompt, np.int32), _I, _F, _I)
    return SimTrajectory(routed, prompt + response, inst)


def decode_time(truth: InstanceTruth | None, steps: int = 50, start: float = 0.0) -> float:
    costs = EngineCosts(prefill_s_per_token=0.0)
    inst = SimInstance(0, COST, costs, np.random.default_rng(0), truth)
    inst.submit([_traj(inst, 1, 10, steps)], start)
    inst.advance(1e9, lambda *_: None)
    return inst.times.decode


def test_the_default_truth_is_the_estimate() -> None:
    assert EngineTruth().exact
    base = decode_time(None)
    assert decode_time(InstanceTruth(ScaledCost(COST))) == base
    expected = sum(COST.step_latency(1, 10 + k) for k in range(50))
    assert base == pytest.approx(expected)


def test_a_slower_instance_takes_longer_and_records_the_estimate_error() -> None:
    inst = SimInstance(
        0,
        COST,
        EngineCosts(prefill_s_per_token=0.0),
        np.random.default_rng(0),
        InstanceTruth(ScaledCost(COST, 1.5)),
    )
    inst.submit([_traj(inst, 1, 10, 400)], 0.0)
    for k in range(1, 40):
        inst.advance(k * 0.05, lambda *_: None)
    assert inst.times.decode == pytest.approx(1.5 * decode_time(None, 400), rel=1e-6)
    # |estimate - actual| / estimate per period, for an instance 1.5x slower: 0.5
    assert inst.times.estimate_error == pytest.approx(0.5, rel=1e-6)


def test_per_instance_speeds_are_persistent_seeded_and_independent_of_other_features() -> None:
    truth = EngineTruth(speed_sigma=0.2)
    a = [t.speed for t in instance_truths(COST, truth, 64, seed=3)]
    assert a == [t.speed for t in instance_truths(COST, truth, 64, seed=3)]
    assert a != [t.speed for t in instance_truths(COST, truth, 64, seed=4)]
    assert np.std(np.log(a)) == pytest.approx(0.2, abs=0.06)
    with_error = EngineTruth(speed_sigma=0.2, coef_sigma=0.1)
    assert a == [t.speed for t in instance_truths(COST, with_error, 64, seed=3)]
    assert [t.speed for t in instance_truths(COST, EngineTruth(), 4, 3)] == [1.0] * 4


def test_the_estimate_error_is_one_draw_shared_by_the_cluster() -> None:
    truth = EngineTruth(coef_sigma=0.17)
    real = true_cost(COST, truth, seed=0)
    assert real != COST and real.kv_budget == COST.kv_budget and real.k5 == COST.k5
    steps = {t.step.cost for t in instance_truths(COST, truth, 8, seed=0)}  # type: ignore[attr-defined]
    assert steps == {real}
    assert true_cost(COST, EngineTruth(model=COST.__class__(1, 1, 1, 1, 1, 1)), 0).k1 == 1


def test_slowdowns_come_and_go() -> None:
    clock = SlowdownClock(
        Slowdowns(per_hour=60.0, factor=3.0, mean_s=20.0), np.random.default_rng(1)
    )
    factors = [clock.factor(t) for t in np.arange(0.0, 3600.0, 1.0)]
    share = factors.count(3.0) / len(factors)
    assert set(factors) == {1.0, 3.0}
    # one episode a minute lasting 20 s on average: about a quarter of the time
    assert 0.15 < share < 0.4
    off = SlowdownClock(Slowdowns(), np.random.default_rng(1))
    assert off.factor(1e9) == 1.0
    with pytest.raises(ValueError, match="factor"):
        Slowdowns(factor=0.5)


def test_the_engine_applies_a_slowdown() -> None:
    # an episode starts within milliseconds and lasts for ever; the instance starts at 1 s
    episode = Slowdowns(per_hour=1e6, factor=2.0, mean_s=1e9)
    slow = SlowdownClock(episode, np.random.default_rng(0))
    got = decode_time(InstanceTruth(ScaledCost(COST), slow), start=1.0)
    assert got == pytest.approx(2 * decode_time(None))


def test_a_step_trace_is_interpolated() -> None:
    samples = [
        LatencySample(1, 0.0, 0.010),
        LatencySample(1, 1_000.0, 0.012),
        LatencySample(9, 0.0, 0.020),
        LatencySample(9, 1_000.0, 0.030),
    ]
    table = StepTable(samples)
    assert table.latency(1, 500.0) == pytest.approx(0.011)
    assert table.latency(5, 0.0) == pytest.approx(0.015)  # halfway in running count
    assert table.kv_slope(9) == pytest.approx(1e-5)
    assert table.latency(50, 0.0) == pytest.approx(0.020)  # held beyond the range
    assert table.scaled(2.0).latency(1, 0.0) == pytest.approx(0.020)
    inst = SimInstance(
        0,
        COST,
        EngineCosts(prefill_s_per_token=0.0),
        np.random.default_rng(0),
        InstanceTruth(table),
    )
    inst.submit([_traj(inst, 1, 100, 10)], 0.0)
    inst.advance(1e9, lambda *_: None)
    assert inst.times.decode == pytest.approx(sum(0.010 + 2e-6 * (100 + k) for k in range(10)))


def test_read_step_trace(tmp_path: Path) -> None:
    good = tmp_path / "steps.jsonl"
    good.write_text(
        "\n".join(
            json.dumps({"running": n, "kv_cache": kv, "step_latency": 0.01 + kv * 1e-8})
            for n in (1, 8)
            for kv in (0, 5_000)
        )
    )
    assert len(read_step_trace(good)) == 4
    csv = tmp_path / "steps.csv"
    csv.write_text("running,kv_cache,step_latency\n4,100,0.02\n")
    assert read_step_trace(csv) == (LatencySample(4, 100.0, 0.02),)
    bad = tmp_path / "bad.csv"
    bad.write_text("running,kv_cache,step_latency\n4,abc,0.02\n")
    with pytest.raises(ValueError, match="row 1"):
        read_step_trace(bad)
    with pytest.raises(ValueError, match="no such step trace"):
        read_step_trace(tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="step_latency > 0"):
        StepTable([LatencySample(1, 0.0, 0.0)])


def test_truth_is_validated() -> None:
    with pytest.raises(ValueError, match="speed_sigma"):
        EngineTruth(speed_sigma=-0.1)
    with pytest.raises(ValueError, match="not both"):
        EngineTruth(model=COST, step_trace=(LatencySample(1, 0.0, 0.01),))
    assert math.isfinite(ScaledCost(COST, 2.0).kv_slope(3))
