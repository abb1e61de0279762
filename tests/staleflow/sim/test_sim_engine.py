"""The simulated instance follows the cost model step by step, preempts when the KV cache
is full, and charges prefill and Pull time."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import CostModel
from staleflow.sim.engine import EngineCosts, SimInstance, SimTrajectory, _steps_within
from trajectory_server.types import RoutedTrajectory

COST = CostModel(k1=1e-6, k2=1e-3, k3=1e-4, k4=2e-3, k5=1.0, kv_budget=1_000.0)
_EMPTY_I, _EMPTY_F = np.zeros(0, np.int32), np.zeros(0, np.float32)


def _traj(inst: SimInstance, tid: int, prompt: int, response: int) -> SimTrajectory:
    routed = RoutedTrajectory(
        tid, 0, 0, 0, "", np.zeros(prompt, np.int32), _EMPTY_I, _EMPTY_F, _EMPTY_I
    )
    return SimTrajectory(routed, prompt + response, inst)


def _instance(**costs: float) -> SimInstance:
    return SimInstance(0, COST, EngineCosts(**costs), np.random.default_rng(0))


def test_decode_time_is_the_sum_of_step_latencies() -> None:
    inst = _instance(prefill_s_per_token=1e-4)
    a, b = _traj(inst, 1, 10, 30), _traj(inst, 2, 20, 50)
    inst.submit([a, b], 0.0)
    done: list[tuple[float, int]] = []
    inst.advance(1e9, lambda t, _i, tr: done.append((t, tr.traj_id)))
    expected, kv, n, lengths = 30 * 1e-4, 30.0, 2, {1: 40, 2: 70}
    got_len = {1: 40, 2: 70}
    gen = {1: 10, 2: 20}
    finish = {}
    while gen:
        expected += COST.step_latency(n, kv)
        for tid in list(gen):
            gen[tid] += 1
            kv += 1
            if gen[tid] == lengths[tid]:
                finish[tid] = expected
                kv -= gen.pop(tid)
        n = len(gen)
    assert [tid for _, tid in done] == [1, 2]
    for t, tid in done:
        assert t == pytest.approx(finish[tid], rel=1e-9)
    assert inst.times.tokens == 30 + 50
    assert got_len == {1: 40, 2: 70}
    assert inst.completed == [1, 2] and not inst.running


def test_full_cache_preempts_into_the_waiting_queue() -> None:
    inst = _instance()
    trajs = [_traj(inst, i, 100, 600) for i in range(4)]
    inst.submit(trajs, 0.0)
    assert len(inst.running) == 4
    seen_waiting = False
    horizon = 0.0
    while inst.running or inst.waiting:
        horizon += 0.05
        inst.advance(horizon, lambda *_: None)
        seen_waiting |= bool(inst.waiting)
        assert inst.kv <= COST.kv_budget + COST.k5 * len(inst.running)
    assert seen_waiting and inst.times.preemptions > 0
    assert sorted(inst.completed) == [0, 1, 2, 3]
    assert inst.times.tokens >= 4 * 600  # re-generation is not needed: recompute = prefill
    assert inst.times.prefill > 0


def test_interrupt_returns_the_whole_response_so_far() -> None:
    inst = _instance()
    t = _traj(inst, 5, 10, 100)
    inst.submit([t], 0.0)
    inst.advance(0.05, lambda *_: None)
    generated = t.length - 10
    assert 0 < generated < 100
    partial = inst.remove([5], 0.05)[5]
    assert len(partial.tokens) == len(partial.versions) == generated
    assert not inst.running and inst.kv == 0


def test_pull_costs_time_and_needs_an_empty_instance() -> None:
    inst = _instance(pull_s=2.0)
    inst.pull(3, 1.0)
    assert inst.version == 3 and inst.clock == 3.0 and inst.times.pull == 2.0
    inst.submit([_traj(inst, 1, 10, 10)], 3.0)
    with pytest.raises(RuntimeError, match="Interrupt them first"):
        inst.pull(4, 3.0)


@pytest.mark.parametrize("first", [1e-3, 5e-2])
@pytest.mark.parametrize("growth", [0.0, 1e-6, 1e-3])
@pytest.mark.parametrize("budget", [0.0, 0.01, 1.0, 37.5])
def test_steps_within_matches_brute_force(first: float, growth: float, budget: float) -> None:
    k, total = 0, 0.0
    while total + first + growth * k <= budget:
        total += first + growth * k
        k += 1
    # exact up to float rounding at the boundary; at least one step always runs
    assert abs(_steps_within(budget, first, growth) - max(1, k)) <= 1


def test_prefill_grows_with_the_square_of_the_prefix() -> None:
    costs = EngineCosts(prefill_s_per_token=1e-4, prefill_s_per_token_sq=1e-8)
    assert costs.prefill_seconds(1_000) == pytest.approx(1e-4 * 1_000 + 1e-8 * 1_000**2)
    inst = SimInstance(0, COST, costs, np.random.default_rng(0))
    inst.submit([_traj(inst, 1, 300, 5)], 0.0)
    inst.advance(1e9, lambda *_: None)
    assert inst.times.prefill == pytest.approx(costs.prefill_seconds(300))
    with pytest.raises(ValueError, match="prefill_s_per_token_sq"):
        EngineCosts(prefill_s_per_token_sq=-1.0)


def test_training_attention_grows_with_the_square_of_each_sequence() -> None:
    from staleflow.sim.presets import qwen3_trainer
    from staleflow.sim.trainer import SimTrainer, TrainerCosts

    costs = TrainerCosts(seconds_per_token=1e-5, step_overhead_s=2.0, seconds_per_token_sq=1e-9)
    # two sequences of 1,000 and 3,000 tokens
    assert costs.step_seconds(4_000, 1_000**2 + 3_000**2) == pytest.approx(
        1e-5 * 4_000 + 1e-9 * 10_000_000 + 2.0
    )
    trainer = SimTrainer(costs)
    end = trainer.start_step(5.0, 4_000, 10_000_000)
    assert end == pytest.approx(5.0 + costs.step_seconds(4_000, 10_000_000))
    assert trainer.step_starts == [5.0]
    # the preset: causal attention is 4 x 393,216 FLOPs per token pair; at 7K tokens it
    # adds ~40% to the linear layers' cost, at 20K more than they cost
    t = qwen3_trainer(64)
    ratio = t.seconds_per_token_sq * 7_000 / t.seconds_per_token
    assert 0.35 < ratio < 0.5
    assert t.seconds_per_token_sq * 20_000 > t.seconds_per_token
    twice = t.sped_up(2.0)
    assert twice.seconds_per_token_sq == pytest.approx(t.seconds_per_token_sq / 2)
    with pytest.raises(ValueError, match="seconds_per_token_sq"):
        TrainerCosts(seconds_per_token_sq=-1.0)
