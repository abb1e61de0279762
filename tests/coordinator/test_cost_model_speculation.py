"""The cost model with speculative decoding (coordinator/cost_model.py): one step's seconds
and the tokens it keeps, the plain model's floats without a profile, and the acceptance
learned from the engines' counters."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.cost_model import (
    MEASURED_ACCEPTANCE,
    SpeculationProfile,
    expected_accepted,
    fit_acceptance,
    learned_speculation,
)
from staleflow.engines.drafts import SpeculationSettings
from tests.coordinator.builders import COST

SPEC = COST.with_speculation(SpeculationProfile(0.8))


def _plain_step(n: float, kv: float) -> float:
    """Eq. 11 as the coordinator's rules wrote it inline before the profile existed."""
    return COST.k1 * kv + max(COST.k2, COST.k3 * n) + COST.k4


def test_without_a_profile_every_formula_is_the_plain_ones_bit_for_bit() -> None:
    rng = np.random.default_rng(0)
    n = rng.integers(0, 120, 200).astype(np.float64)
    kv = rng.uniform(0.0, COST.kv_budget, 200)
    length = 2_345.0
    k1, k2, k3, k4, k5 = COST.k1, COST.k2, COST.k3, COST.k4, COST.k5
    for a, b in zip(n.tolist(), kv.tolist(), strict=True):
        assert COST.step(a, b) == (_plain_step(a, b), 1.0)
        assert COST.token_latency(a, b) == _plain_step(a, b)
        assert COST.kv_slope(a) == k1 and COST.verified(a) == a
        assert COST.throughput(a, b) == a / _plain_step(a, b)
        if b + k5 * length <= COST.kv_budget:
            latency1 = k1 * b + max(k2, k3 * (a + 1.0)) + k4 + k1 * k5 * length
            want = (a + 1.0) / latency1 - a / _plain_step(a, b)
            assert COST.marginal_gain(a, b, 0, length) == want
    assert COST.ideal_gain(length) == 1.0 / (k1 * k5 * length + max(k2, k3) + k4)
    vector = k1 * kv + np.maximum(k2, k3 * n) + k4
    assert np.array_equal(COST.token_latencies(n, kv), vector)
    assert np.array_equal(COST.throughputs(n, kv), n / vector)
    queued = rng.random(200) < 0.2
    latency1 = k1 * kv + np.maximum(k2, k3 * (n + 1.0)) + k4
    gains = (n + 1.0) / (latency1 + k1 * k5 * length) - n / vector
    gains = np.where(queued | (kv + k5 * length > COST.kv_budget), -np.inf, gains)
    assert np.array_equal(COST.marginal_gains(n, kv, queued, length), gains)
    assert COST.with_speculation(None) is COST


@pytest.mark.parametrize(("max_draft", "batch"), [(8, 32), (4, 16), (1, 1), (16, 100)])
def test_the_draft_length_is_the_engines_adaptive_rule(max_draft: int, batch: int) -> None:
    profile = SpeculationProfile(0.5, max_draft=max_draft, batch_draft_tokens=batch)
    engine = SpeculationSettings(max_draft=max_draft, batch_draft_tokens=batch)
    running = list(range(0, 130))
    assert [profile.draft_length(r) for r in running] == [engine.draft_length(r) for r in running]
    vector = profile.draft_lengths(np.array(running, dtype=np.float64))
    assert vector.tolist() == [float(engine.draft_length(r)) for r in running]


def test_a_speculative_step_verifies_the_draft_and_keeps_the_accepted_tokens() -> None:
    kv = 30_000.0
    # one running: a 9-token forward (memory-bound: k2), 1 + E[a|8] tokens kept
    latency, kept = SPEC.step(1, kv)
    assert latency == _plain_step(9, kv)
    assert kept == 1.0 + expected_accepted(0.8, 8)
    assert SPEC.token_latency(1, kv) == pytest.approx(latency / kept)
    assert SPEC.token_latency(1, kv) < COST.token_latency(1, kv) / 3.0
    assert SPEC.kv_slope(1) == pytest.approx(COST.k1 / kept)
    # 16 running verify 2 each: 48 tokens of forward (compute-bound), 1 + a + a^2 kept
    assert SPEC.step(16, kv) == pytest.approx((_plain_step(48, kv), 1.8 + 0.64))
    assert SPEC.verified(16) == 48
    # a full batch (33 or more) drafts nothing: the plain step, exactly
    assert SPEC.step(64, kv) == COST.step(64, kv)
    assert SPEC.token_latency(64, kv) == COST.token_latency(64, kv)
    # drafts that are never accepted only cost: more tokens of forward, one kept
    none = COST.with_speculation(SpeculationProfile(0.0))
    assert none.token_latency(20, kv) > COST.token_latency(20, kv)


def test_vector_forms_match_the_scalar_ones_with_speculation() -> None:
    rng = np.random.default_rng(1)
    n = rng.integers(0, 60, 64).astype(np.float64)
    kv = rng.uniform(0.0, SPEC.kv_budget - 5_000, 64)
    queued = rng.random(64) < 0.2
    scalar = [SPEC.token_latency(a, b) for a, b in zip(n, kv, strict=True)]
    assert SPEC.token_latencies(n, kv) == pytest.approx(scalar)
    assert SPEC.kv_slopes(n) == pytest.approx([SPEC.kv_slope(a) for a in n])
    tput = SPEC.throughputs(n, kv)
    assert tput == pytest.approx([SPEC.throughput(a, b) for a, b in zip(n, kv, strict=True)])
    gains = SPEC.marginal_gains(n, kv, queued, 3_000.0)
    for i in range(64):
        if queued[i]:
            assert gains[i] == -np.inf
        else:
            assert gains[i] == pytest.approx(SPEC.marginal_gain(n[i], kv[i], 0, 3_000.0))
    # Eq. 4 is still Eq. 3 on an idle instance
    for length in (10.0, 1_000.0, 50_000.0):
        assert SPEC.ideal_gain(length) == pytest.approx(SPEC.marginal_gain(0, 0, 0, length))


def test_the_acceptance_is_learned_from_the_counters_after_enough_verifications() -> None:
    prior = SpeculationProfile(MEASURED_ACCEPTANCE["group"], max_draft=4, batch_draft_tokens=16)
    assert learned_speculation(prior, 10, 80, 40) is prior  # too few to trust
    assert learned_speculation(prior, 0, 0, 0) is prior
    # counters of drafts of 8 accepted at alpha = 0.6, on average
    verified = 1_000
    accepted = round(verified * expected_accepted(0.6, 8))
    learned = learned_speculation(prior, verified, 8 * verified, accepted)
    assert learned.acceptance == pytest.approx(0.6, abs=1e-3)
    assert (learned.max_draft, learned.batch_draft_tokens) == (4, 16)  # the engines' rule
    # nothing accepted, or everything: held inside [0, 1)
    assert learned_speculation(prior, 500, 1_000, 0).acceptance < 1e-3
    assert 0.99 <= learned_speculation(prior, 500, 1_000, 1_000).acceptance < 1.0
    # a mean draft length need not be whole
    assert fit_acceptance([(2.5, expected_accepted(0.7, 2.5))]) == pytest.approx(0.7, abs=1e-6)


def test_bad_profiles_are_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="fit_acceptance"):
        SpeculationProfile(1.0)
    with pytest.raises(ValueError, match=r"rollout\.speculation"):
        SpeculationProfile(0.5, max_draft=0)
