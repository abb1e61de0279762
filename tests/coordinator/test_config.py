"""Configuration: defaults, strategy choice, and errors that say how to fix a value."""

from __future__ import annotations

import pytest

from coordinator import (
    AgenticRulesConfig,
    ConfigError,
    CoordinatorConfig,
    CostModelConfig,
    build_strategies,
)
from coordinator.migration import NoMigration, ThroughputMigration
from coordinator.routing import ThroughputRouting
from coordinator.sync import GreedySync, ThroughputSync
from coordinator.vanilla_routing import LeastLoadedRouting


def test_defaults_are_the_papers() -> None:
    c = CoordinatorConfig()
    assert (c.mu, c.phi_wait, c.phi_throughput) == (0.3, 3, 5.0)
    s = build_strategies(c)
    assert isinstance(s.routing, ThroughputRouting)
    assert isinstance(s.sync, ThroughputSync)
    assert isinstance(s.migration, ThroughputMigration)
    assert s.cost.k1 == 7.28e-8


def test_the_fill_headroom_never_exceeds_the_response_cap() -> None:
    c = CoordinatorConfig()
    assert c.fill_steps == 6000
    assert c.for_responses(32).fill_steps == 32  # no trajectory grows past the cap
    assert c.for_responses(20_000) is c  # a cap above the headroom changes nothing
    off = CoordinatorConfig(fill_steps=None)
    assert off.for_responses(32).fill_steps is None  # the rule stays off
    assert c.for_responses(32).mu == c.mu  # nothing else moves


def test_vanilla_counterparts_are_chosen_independently() -> None:
    s = build_strategies(CoordinatorConfig(routing="vanilla", migration="vanilla"))
    assert isinstance(s.routing, LeastLoadedRouting)
    assert isinstance(s.sync, ThroughputSync)
    assert isinstance(s.migration, NoMigration)
    assert isinstance(
        build_strategies(CoordinatorConfig(synchronization="vanilla")).sync, GreedySync
    )


def test_fresh_admission_is_wired_into_the_throughput_routing_and_sync() -> None:
    on = build_strategies(CoordinatorConfig())
    off = build_strategies(CoordinatorConfig(fresh_admission=False))
    assert isinstance(on.routing, ThroughputRouting) and on.routing.fresh
    assert isinstance(off.routing, ThroughputRouting) and not off.routing.fresh
    assert isinstance(on.sync, ThroughputSync) and on.sync.routing is on.routing
    # Behind least-loaded routing, which starts new work at any version, Algorithm 4's
    # tentative pass must not assume fresh admission.
    for routing in ("vanilla", "sticky"):
        sync = build_strategies(CoordinatorConfig(routing=routing)).sync
        assert isinstance(sync, ThroughputSync) and not sync.routing.fresh


def test_cost_model_overrides() -> None:
    model = CostModelConfig(k1=1e-7, kv_budget=500_000).build()
    assert (model.k1, model.kv_budget, model.k2) == (1e-7, 500_000, 1.72e-3)


@pytest.mark.parametrize(
    ("kwargs", "hint"),
    [
        ({"routing": "fastest"}, "'throughput'"),
        ({"mu": 0.0}, r"\(0, 1\]"),
        ({"mu": 1.5}, r"\(0, 1\]"),
        ({"phi_wait": -1}, "queued trajectories"),
        ({"phi_wait": 2.5}, "integer"),
        ({"phi_throughput": 0.5}, ">= 1"),
        ({"period_s": 0}, "> 0 seconds"),
        ({"fresh_admission": "yes"}, "fresh_admission='yes' must be true or false"),
        ({"estimation": 1}, "must be true or false"),
        ({"critical_tail": 0}, "critical_tail=0 must be an integer >= 1"),
        ({"critical_tail": True}, "critical_tail=True must be an integer >= 1"),
        ({"cost_model": CostModelConfig(preset="gpt-9")}, "coordinator.profiler"),
        ({"cost_model": CostModelConfig(kv_budget=-1)}, "kv_budget"),
    ],
)
def test_bad_values_name_the_fix(kwargs: dict[str, object], hint: str) -> None:
    with pytest.raises(ConfigError, match=hint):
        CoordinatorConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [-0.1, 1.5, True])
def test_home_below_is_a_share_of_the_kv_budget(value: object) -> None:
    with pytest.raises(ConfigError, match=r"home_below=.* share of the KV budget in \[0, 1\]"):
        AgenticRulesConfig(home_below=value)  # type: ignore[arg-type]
    assert AgenticRulesConfig(home_below=0.0).home_below == 0.0
