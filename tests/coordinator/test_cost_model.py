"""The cost model of Eq. 2-4 and Appendix B."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator import PRESETS, QWEN3_30B_A3B_H20, CostModel
from tests.coordinator.builders import COST


def test_table4_preset() -> None:
    m = PRESETS["qwen3-30b-a3b-h20"]
    assert (m.k1, m.k2, m.k3, m.k4) == (7.28e-8, 1.72e-3, 1.25e-4, 1.07e-2)
    assert m.k5 == 1.0  # KV counted in tokens
    # 100 trajectories of 2K tokens: a step of tens of ms, ~1-2K tok/s, as on an H20.
    assert 0.02 < m.step_latency(100, 200_000) < 0.05
    assert 1_000 < m.throughput(100, 200_000) < 5_000


def test_throughput_is_eq2() -> None:
    n, kv = 40, 50_000
    expected = n / (COST.k1 * kv + max(COST.k2, COST.k3 * n) + COST.k4)
    assert COST.throughput(n, kv) == pytest.approx(expected)
    assert COST.throughput(0, 0) == 0.0


def test_knee_switches_matmul_term() -> None:
    knee = COST.k2 / COST.k3
    below, above = int(knee) - 1, int(knee) + 5
    assert COST.step_latency(below, 0) == pytest.approx(COST.k2 + COST.k4)
    assert COST.step_latency(above, 0) == pytest.approx(COST.k3 * above + COST.k4)


def test_marginal_gain_zero_when_full_or_queued() -> None:
    assert COST.marginal_gain(10, COST.kv_budget - 50, 0, 100) == 0.0  # does not fit
    assert COST.marginal_gain(10, 1_000, 1, 100) == 0.0  # engine queue not empty
    assert COST.marginal_gain(10, 1_000, 0, 100) > 0.0


def test_ideal_gain_is_gain_on_idle_instance_and_an_upper_bound() -> None:
    for length in (10, 1_000, 50_000):
        assert COST.ideal_gain(length) == pytest.approx(COST.marginal_gain(0, 0, 0, length))
        for n, kv in ((1, 100), (5, 20_000), (50, 90_000 - length)):
            if kv + length <= COST.kv_budget:
                assert COST.marginal_gain(n, kv, 0, length) <= COST.ideal_gain(length)


def test_vectorised_matches_scalar() -> None:
    rng = np.random.default_rng(0)
    n = rng.integers(0, 80, 64).astype(np.float64)
    kv = rng.uniform(0, COST.kv_budget, 64)
    queued = rng.random(64) < 0.2
    got = COST.marginal_gains(n, kv, queued, 3_000)
    for i in range(64):
        want = COST.marginal_gain(n[i], kv[i], int(queued[i]), 3_000)
        if want == 0.0 and (queued[i] or kv[i] + 3_000 > COST.kv_budget):
            assert got[i] == -np.inf
        else:
            assert got[i] == pytest.approx(want)
    tput = COST.throughputs(n, kv)
    assert tput == pytest.approx([COST.throughput(a, b) for a, b in zip(n, kv, strict=True)])


def test_rejects_nonsense_coefficients() -> None:
    with pytest.raises(ValueError, match="k5"):
        CostModel(1e-8, 1e-3, 1e-4, 1e-2, k5=0.0, kv_budget=1.0)
    with pytest.raises(ValueError, match="kv_budget"):
        CostModel(1e-8, 1e-3, 1e-4, 1e-2, k5=1.0, kv_budget=0.0)
    with pytest.raises(ValueError, match="k1"):
        CostModel(-1e-8, 1e-3, 1e-4, 1e-2, k5=1.0, kv_budget=1.0)
    assert QWEN3_30B_A3B_H20.kv_budget > 100_000
