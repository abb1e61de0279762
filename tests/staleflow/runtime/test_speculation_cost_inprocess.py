"""A run with speculation tells the coordinator (docs/speculation.md, "In the simulator"
and "The coordinator's cost model"): the driver's prior from ``rollout.speculation``, then
the acceptance the engines' counters measure, step by step. In one process, no Ray."""

from __future__ import annotations

import pytest

from coordinator.cost_model import MEASURED_ACCEPTANCE, SpeculationProfile, expected_accepted
from staleflow.config import load_config
from staleflow.engines.drafts import SpeculationStats
from staleflow.runtime.driver.run_plan import control_config
from tests.staleflow.runtime.test_runtime_inprocess import run, wire


def test_the_prior_follows_rollout_speculation() -> None:
    off = load_config(None, [])
    assert control_config(off).speculation is None
    group = load_config(
        None,
        [
            "rollout.speculation.method=group",
            "rollout.speculation.max_draft=4",
            "rollout.speculation.batch_draft_tokens=16",
        ],
    )
    assert control_config(group).speculation == SpeculationProfile(
        MEASURED_ACCEPTANCE["group"], max_draft=4, batch_draft_tokens=16
    )
    own = load_config(
        None, ["rollout.speculation.method=own", "rollout.speculation.acceptance=0.4"]
    )
    assert own.rollout.speculation.profile() == SpeculationProfile(0.4)


def test_the_coordinator_learns_the_acceptance_the_engines_count() -> None:
    prior = SpeculationProfile(0.5)
    w = wire(1, speculation=prior)
    cost = w.control.coordinator.strategies.cost
    assert cost.speculation == prior  # told from the start
    # every engine has verified 100 drafts of 8 tokens at alpha = 0.8, on average
    accepted = round(100 * expected_accepted(0.8, 8))
    for engine in w.engines.values():
        engine.speculation_stats = lambda: SpeculationStats(100, 800, accepted)  # type: ignore[attr-defined]
    run(w, steps=2)
    learned = w.control.coordinator.strategies.cost.speculation
    assert learned is not None and learned.acceptance == pytest.approx(0.8, abs=2e-3)
    assert w.control.records()[-1].extra["speculation/verifications"] == 100.0 * len(w.engines)


def test_without_speculation_the_cost_model_stays_plain() -> None:
    w = wire(1)
    run(w, steps=1)
    assert w.control.coordinator.strategies.cost.speculation is None
