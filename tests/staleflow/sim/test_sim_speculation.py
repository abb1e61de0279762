"""Speculation in the simulator (staleflow/sim/speculation.py): the acceptance model and
its fit, the step model per batch size, and whole runs with it on, the coordinator told
(its cost model's speculation, coordinator/cost_model.py) or not."""

from __future__ import annotations

from dataclasses import replace

import pytest

from coordinator.cost_model import QWEN3_30B_A3B_H20
from staleflow.sim import ClusterConfig, SimCluster, system, tiny
from staleflow.sim.speculation import (
    MEASURED_GROUP,
    SpeculationProfile,
    SpeculativeStep,
    expected_accepted,
    fit_acceptance,
)
from staleflow.sim.summary import summarise
from staleflow.sim.truth import ScaledCost
from tests.staleflow.sim.test_sim_staleness_bound import assert_within_eta, run


def test_accepted_tokens_follow_the_first_rejection_rule() -> None:
    # draft of 3 at alpha: a + a^2 + a^3 (the i-th token counts only if all before it did)
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(0.9, 0) == 0.0
    assert expected_accepted(0.0, 8) == 0.0
    assert expected_accepted(1.0, 8) == 8.0


def test_the_fit_recovers_the_acceptance_of_exact_measurements() -> None:
    samples = [(k, expected_accepted(0.73, k)) for k in (1, 2, 4, 8)]
    assert fit_acceptance(samples) == pytest.approx(0.73, abs=1e-6)
    # the measured profile: between the single-length fits of its two draft lengths
    assert fit_acceptance([(8, 3.24)]) < MEASURED_GROUP.acceptance < fit_acceptance([(2, 1.67)])


@pytest.mark.parametrize(
    ("samples", "why"),
    [([], "at least one"), ([(0, 0.5)], "draft > 0"), ([(4, 5.0)], "accepted <= draft")],
)
def test_bad_measurements_are_refused_with_the_reason(
    samples: list[tuple[int, float]], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        fit_acceptance(samples)
    with pytest.raises(ValueError, match="fit_acceptance"):
        SpeculationProfile(1.0)


def test_the_step_verifies_the_adaptive_draft_and_a_full_batch_is_the_plain_step() -> None:
    base = ScaledCost(QWEN3_30B_A3B_H20)
    profile = SpeculationProfile(0.8, max_draft=8, batch_draft_tokens=32)
    step = SpeculativeStep(base, profile)
    kv = 50_000.0
    # one running trajectory: a 9-token forward (still memory-bound), 1 + E[a|8] tokens
    per_step = 1.0 + expected_accepted(0.8, 8)
    assert step.latency(1, kv) == pytest.approx(base.latency(9, kv) / per_step)
    assert step.latency(1, kv) < base.latency(1, kv) / 2.5
    assert step.kv_slope(1) == pytest.approx(base.kv_slope(9) / per_step)
    # 33 or more running: no draft, the plain step
    assert step.latency(64, kv) == base.latency(64, kv)
    assert step.kv_slope(64) == base.kv_slope(64)


def test_the_coordinators_model_is_the_simulated_step() -> None:
    """Told the profile, the coordinator's cost model predicts what a simulated engine
    that follows the cost model does, per token, at every batch size."""
    base = ScaledCost(QWEN3_30B_A3B_H20)
    step = SpeculativeStep(base, MEASURED_GROUP)
    told = QWEN3_30B_A3B_H20.with_speculation(MEASURED_GROUP)
    for n in (1, 2, 3, 4, 5, 8, 11, 16, 32, 33, 64):
        for kv in (0.0, 40_000.0):
            assert told.token_latency(n, kv) == pytest.approx(step.latency(n, kv), rel=1e-12)
        assert told.kv_slope(n) == pytest.approx(step.kv_slope(n), rel=1e-12)


def _with(config: ClusterConfig, profile: SpeculationProfile | None, tell: bool) -> ClusterConfig:
    engine = replace(config.engine, speculation=profile, tell_coordinator=tell)
    return replace(config, engine=engine)


def test_a_run_with_speculation_is_faster_keeps_the_bound_and_its_estimates() -> None:
    config = system("staleflow", tiny(3, steps=8, seed=0))
    off = SimCluster(config)
    on = SimCluster(_with(config, MEASURED_GROUP, tell=True))
    untold = SimCluster(_with(config, MEASURED_GROUP, tell=False))
    run(off)
    consumed = run(on)
    run(untold)
    assert_within_eta(consumed, config.eta, config.batch_size, config.group_size)
    # every rule of the coordinator decides with the engines' speculation
    assert on.coordinator.strategies.cost.speculation == MEASURED_GROUP
    assert untold.coordinator.strategies.cost.speculation is None
    s_off, s_on, s_untold = summarise(off), summarise(on), summarise(untold)
    # the same work, trained sooner: tiny's rollout binds, so faster decoding shows
    assert s_on.tokens_per_s > 1.2 * s_off.tokens_per_s
    # told, the coordinator's estimates are as good as without speculation (0.066 and
    # 0.069 on 2026-11-29); untold, its plain model is off by the speed-up (0.65), which
    # only its per-instance speed factors (coordinator/estimation.py) can absorb
    assert s_on.estimate_error < s_off.estimate_error + 0.03
    assert s_untold.estimate_error > s_on.estimate_error + 0.3
    # and deciding with the right model does not cost throughput (+7% here)
    assert s_on.tokens_per_s >= s_untold.tokens_per_s
