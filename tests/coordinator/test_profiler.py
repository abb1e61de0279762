"""The fit of k1..k4 from measured decode steps (Appendix B)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import QWEN3_30B_A3B_H20, LatencySample, fit_cost_model, profile, profile_grid


def _synthetic(noise: float, seed: int = 0) -> list[LatencySample]:
    true = QWEN3_30B_A3B_H20
    rng = np.random.default_rng(seed)
    grid = profile_grid(160, true.kv_budget, running_points=20, kv_points=8)

    def measure(n: int, kv: float) -> float:
        return true.step_latency(n, kv) * (1.0 + noise * rng.standard_normal())

    return profile(measure, grid)


def test_recovers_table4_coefficients_from_noisy_samples() -> None:
    fit = fit_cost_model(_synthetic(noise=0.03), kv_budget=QWEN3_30B_A3B_H20.kv_budget)
    true = QWEN3_30B_A3B_H20
    assert fit.model.k1 == pytest.approx(true.k1, rel=0.05)
    assert fit.model.k3 == pytest.approx(true.k3, rel=0.05)
    assert fit.model.k4 == pytest.approx(true.k4, rel=0.15)
    assert fit.model.k2 == pytest.approx(true.k2, rel=0.25)
    assert fit.knee == pytest.approx(true.k2 / true.k3, rel=0.3)
    # The reported error is the noise level, not more (3% normal noise -> ~2.4% mean |e|).
    assert 0.01 < fit.mean_relative_error < 0.04
    assert fit.samples == len(_synthetic(0.03))


def test_exact_samples_fit_exactly() -> None:
    fit = fit_cost_model(_synthetic(noise=0.0), kv_budget=1e6)
    assert fit.mean_relative_error < 1e-6
    assert fit.model.k2 == pytest.approx(QWEN3_30B_A3B_H20.k2, rel=1e-4)
    assert fit.model.kv_budget == 1e6


def test_all_compute_bound_samples_still_fit() -> None:
    true = QWEN3_30B_A3B_H20
    samples = [
        LatencySample(n, kv, true.step_latency(n, kv))
        for n in (40, 60, 90, 130)
        for kv in (1e4, 1e5, 2e5)
    ]
    fit = fit_cost_model(samples, kv_budget=true.kv_budget)
    assert fit.mean_relative_error < 1e-6
    assert fit.model.k2 <= fit.model.k3 * 40 + 1e-12


def test_bad_samples_say_what_to_do() -> None:
    with pytest.raises(ValueError, match="at least 4"):
        fit_cost_model([LatencySample(1, 0, 0.01)], kv_budget=1.0)
    same_kv = [LatencySample(n, 5.0, 0.01 + n * 1e-4) for n in range(1, 10)]
    with pytest.raises(ValueError, match="several KV sizes"):
        fit_cost_model(same_kv, kv_budget=1.0)
    with pytest.raises(ValueError, match="step_latency > 0"):
        fit_cost_model([LatencySample(1, k, 0.0) for k in range(5)], kv_budget=1.0)
