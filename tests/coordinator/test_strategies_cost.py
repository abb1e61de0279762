"""The strategies' cost model replaced as a run learns it (coordinator/strategies.py
``with_cost``, ``Coordinator.speculate``): every rule gets it, what they learned stays."""

from __future__ import annotations

import pytest

from coordinator import CoordinatorConfig
from coordinator.config import FreshnessConfig, RaceConfig, SeerConfig
from coordinator.cost_model import CostModel, SpeculationProfile
from coordinator.strategies import Strategies, _parts, build_strategies, with_cost


def _holders(strategies: Strategies) -> list[object]:
    return [p for p in _parts(strategies, set()) if isinstance(getattr(p, "cost", None), CostModel)]


@pytest.mark.parametrize("seer", [False, True])
def test_every_rule_decides_with_the_new_cost_model(seer: bool) -> None:
    # every rule on (the defaults, and the ones off by default)
    config = CoordinatorConfig(
        race=RaceConfig(enabled=True),
        freshness=FreshnessConfig(enabled=True),
        seer=SeerConfig(enabled=seer),
    )
    strategies = build_strategies(config)
    holders = _holders(strategies)
    # routing (inside Seer's when on), the sync's routing, migration, the estimator, the
    # critical path, the race, freshness, and the strategies themselves
    assert len(holders) >= 7
    profile = SpeculationProfile(0.7)
    told = with_cost(strategies, strategies.cost.with_speculation(profile))
    assert told.cost.speculation == profile
    assert all(p.cost is told.cost for p in _holders(told))  # type: ignore[attr-defined]
    # the same objects: what they learned (speed factors, lateness, lengths) stays
    assert told.estimator is strategies.estimator and told.routing is strategies.routing
    # built told from the start, the same model
    assert build_strategies(config, profile).cost == told.cost
    assert with_cost(told, told.cost) is told
