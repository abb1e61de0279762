"""Drain-then-global synchronisation (the one-step-overlap baseline, VeRL-Pipeline)."""

from __future__ import annotations

import pytest

from coordinator import (
    ConfigError,
    CoordinatorConfig,
    Interrupt,
    Pull,
    Route,
    Strategies,
    plan_cycle,
)
from coordinator.drain_sync import DrainGlobalSync
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.strategies import build_strategies
from tests.coordinator.builders import initial, instance, manager, snapshot, strategies


def pipeline(**overrides: object) -> Strategies:
    """The pipeline system's strategies: least-loaded routing, drain sync, no migration."""
    kwargs: dict[str, object] = {
        "routing": "vanilla",
        "synchronization": "drain",
        "migration": "vanilla",
        **overrides,
    }
    return strategies(**kwargs)


def select(fleet: Fleet, ps: int) -> list[int]:
    m = manager(ps, eta=1, batch=8)
    return [
        fleet.ids[p] for p in DrainGlobalSync().select(fleet, TrajectoryPool([]), ps, m.sketch())
    ]


def test_is_selected_by_configuration_and_holds_routing() -> None:
    s = build_strategies(CoordinatorConfig(synchronization="drain"))
    assert isinstance(s.sync, DrainGlobalSync)
    assert s.hold is s.sync
    # Every other synchronisation leaves routing alone.
    for name in ("throughput", "vanilla"):
        assert build_strategies(CoordinatorConfig(synchronization=name)).hold is None


def test_drain_is_a_synchronisation_name_only() -> None:
    with pytest.raises(ConfigError, match="'drain'"):
        CoordinatorConfig(synchronization="drained")
    with pytest.raises(ConfigError, match="'vanilla'") as e:
        CoordinatorConfig(routing="drain")
    assert "or 'drain'" not in str(e.value)  # routing has no drain counterpart


def test_no_pull_while_any_instance_is_busy() -> None:
    # Running trajectories on one instance, queued ones on another: nobody Pulls.
    assert select(Fleet(snapshot(instance(0, 1, [500]), instance(1, 1))), 2) == []
    assert select(Fleet(snapshot(instance(0, 1), instance(1, 1, wait=2))), 2) == []
    # Not even the idle instances alone: synchronisation is global.
    assert select(Fleet(snapshot(instance(0, 1), instance(1, 1), instance(2, 1, [9]))), 5) == []


def test_all_instances_pull_together_once_empty() -> None:
    fleet = Fleet(snapshot(instance(0, 1), instance(1, 1), instance(2, 1)))
    assert select(fleet, 2) == [0, 1, 2]
    # Up to date: nothing to do.
    assert select(fleet, 1) == []


def test_plan_pulls_without_interrupting_and_routes_at_the_new_version() -> None:
    m = manager(2, eta=1, batch=8)
    snap = snapshot(instance(0, 1), instance(1, 1))
    cmds = plan_cycle(snap, initial(1, 4), 2, m.sketch(), pipeline())
    assert not any(isinstance(c, Interrupt) for c in cmds)
    assert [c for c in cmds if isinstance(c, Pull)] == [Pull(0, 2), Pull(1, 2)]
    routes = [c for c in cmds if isinstance(c, Route)]
    assert sum(len(r.trajs) for r in routes) == 4
    assert {res.v_traj for r in routes for res in r.reservations} == {2}


def test_no_routing_while_a_sync_is_pending() -> None:
    m = manager(2, eta=1, batch=8)
    ts = initial(1, 4)  # admissible at version 1 (staleness 1 at buffer 2)
    busy = snapshot(instance(0, 1, [500]), instance(1, 1))
    assert m.sketch().verify(1, 1)
    assert plan_cycle(busy, ts, 2, m.sketch(), pipeline()) == []
    # The same snapshot without a newer PS routes to the idle instance first.
    routes = plan_cycle(busy, ts, 1, manager(1, eta=1, batch=8).sketch(), pipeline())
    assert routes and all(isinstance(c, Route) for c in routes)
    assert {c.inst for c in routes} == {0, 1}


def test_hold_leaves_other_strategies_untouched() -> None:
    # Greedy sync on the same snapshot interrupts, Pulls and routes in one cycle.
    m = manager(2, eta=1, batch=8)
    busy = snapshot(instance(0, 1, [500]), instance(1, 1))
    cmds = plan_cycle(busy, initial(1, 4), 2, m.sketch(), pipeline(synchronization="vanilla"))
    kinds = {type(c) for c in cmds}
    assert kinds == {Interrupt, Pull, Route}
