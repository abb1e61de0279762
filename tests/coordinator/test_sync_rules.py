"""Algorithm 4 with the rules beyond the paper: the single tentative pass still equals
Algorithm 4 as written when routing uses the fill rule and per-instance speeds, and
deferred Pulls leave an instance with running work alone until it has drained."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import CoordinatorConfig, TrajectoryView, build_strategies
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.routing import ThroughputRouting
from coordinator.sync import ThroughputSync
from staleness import StalenessManager
from tests.coordinator.builders import COST, initial, instance, manager, partial, snapshot
from tests.coordinator.test_sync import brute_force_algorithm4, scenarios

ROUTING = ThroughputRouting(COST, 0.3, fill_steps=200)
FRESH = ThroughputRouting(COST, 0.3, fill_steps=200, fresh=True)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_single_pass_equals_algorithm4_with_fill_and_speeds(
    case: tuple[Fleet, list[TrajectoryView], int, StalenessManager], data: st.DataObject
) -> None:
    fleet, ts, ps, m = case
    fleet.speed = np.array([data.draw(st.sampled_from([0.5, 1.0, 1.7])) for _ in fleet.ids])
    strategy = ThroughputSync(ROUTING)
    got = [fleet.ids[p] for p in strategy.select(fleet, TrajectoryPool(ts), ps, m.sketch())]
    assert got == brute_force_algorithm4(fleet, list(ts), ps, m, ROUTING)


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.data())
def test_single_pass_equals_algorithm4_with_fresh_admission(
    case: tuple[Fleet, list[TrajectoryView], int, StalenessManager], data: st.DataObject
) -> None:
    fleet, ts, ps, m = case
    fleet.speed = np.array([data.draw(st.sampled_from([0.5, 1.0, 1.7])) for _ in fleet.ids])
    strategy = ThroughputSync(FRESH)
    got = [fleet.ids[p] for p in strategy.select(fleet, TrajectoryPool(ts), ps, m.sketch())]
    assert got == brute_force_algorithm4(fleet, list(ts), ps, m, FRESH)


@settings(max_examples=150, deadline=None)
@given(scenarios(group=4), st.booleans(), st.data())
def test_single_pass_equals_algorithm4_with_whole_groups(
    case: tuple[Fleet, list[TrajectoryView], int, StalenessManager],
    fresh: bool,
    data: st.DataObject,
) -> None:
    # A decision below the threshold (the rest of a started group) is one the upgraded
    # instance would have won, whichever version the rest went to.
    fleet, ts, ps, m = case
    fleet.speed = np.array([data.draw(st.sampled_from([0.5, 1.0, 1.7])) for _ in fleet.ids])
    routing = ThroughputRouting(COST, 0.3, fill_steps=200, fresh=fresh, whole_groups=True)
    strategy = ThroughputSync(routing)
    got = [fleet.ids[p] for p in strategy.select(fleet, TrajectoryPool(ts), ps, m.sketch())]
    assert got == brute_force_algorithm4(fleet, list(ts), ps, m, routing)


def test_an_upgrade_would_win_the_rest_of_a_group() -> None:
    # Instance 1 (version 2, busy) clears mu for 5 members of the group; whole_groups
    # places the other 11 there too. Upgraded, the empty instance 0 would have taken
    # them instead: Algorithm 4 Pulls it.
    m = manager(3, eta=1, batch=64, group=16)  # version 1 admits nothing any more
    fleet = Fleet(snapshot(instance(0, 1), instance(1, 2, [1_000] * 70)))
    ts = initial(1, 16)
    routing = ThroughputRouting(COST, 0.3, None, whole_groups=True)
    assert ThroughputSync(routing).select(fleet, TrajectoryPool(ts), 3, m.sketch()) == [0]
    assert brute_force_algorithm4(fleet, ts, 3, m, routing) == [0]


def test_with_fresh_admission_only_a_partial_trajectory_keeps_a_version() -> None:
    # Instance 0 lags at version 2, empty; version 2 still admits the TS's new group.
    m = manager(3, eta=1)
    fleet = Fleet(snapshot(instance(0, 2), instance(1, 3, [1_000] * 80)))
    assert ThroughputSync(ROUTING).select(fleet, TrajectoryPool(initial(1)), 3, m.sketch()) == []
    fresh = ThroughputSync(FRESH)
    assert fresh.select(fleet, TrajectoryPool(initial(1)), 3, m.sketch()) == [0]
    # A partial trajectory it can resume at its version keeps it there.
    ts = [*initial(1), partial(2, 500)]
    assert fresh.select(fleet, TrajectoryPool(ts), 3, m.sketch()) == []


def test_a_pull_waits_until_the_instance_has_drained() -> None:
    m = manager(3, eta=1)  # version 1 admits nothing any more
    ts = initial(1, 4)
    plain = ThroughputSync(ROUTING)
    deferred = ThroughputSync(ROUTING, pull_kv=0.25)  # 25K of the 100K budget
    for run, pulled in (([1_000] * 30, False), ([1_000] * 25, True), ([], True)):
        fleet = Fleet(snapshot(instance(0, 1, run, v_traj=1), instance(1, 3, [1_000] * 80)))
        assert plain.select(fleet, TrajectoryPool(ts), 3, m.sketch()) == [0]
        assert deferred.select(fleet, TrajectoryPool(ts), 3, m.sketch()) == ([0] if pulled else [])


def test_an_instance_running_the_critical_tail_keeps_its_version() -> None:
    """The oldest version's last trajectories run fastest where nothing new joins them."""
    m = manager(3, eta=1)  # version 1 admits nothing any more
    ts = initial(1, 4)
    newer = instance(1, 3, [1_000] * 80)
    deferred = ThroughputSync(ROUTING, pull_kv=0.25)
    held = ThroughputSync(ROUTING, pull_kv=0.25, hold_tail=1)
    # Instance 0 lags and runs two trajectories of V_traj 1, the oldest in flight: with
    # two instances, the tail at one per instance.
    tail = Fleet(snapshot(instance(0, 1, [1_000] * 2, v_traj=1), newer))
    assert deferred.select(tail, TrajectoryPool(ts), 3, m.sketch()) == [0]
    assert held.select(tail, TrajectoryPool(ts), 3, m.sketch()) == []
    # Three are not the tail yet, unless the tail is wider.
    three = Fleet(snapshot(instance(0, 1, [1_000] * 3, v_traj=1), newer))
    assert held.select(three, TrajectoryPool(ts), 3, m.sketch()) == [0]
    wide = ThroughputSync(ROUTING, pull_kv=0.25, hold_tail=2)
    assert wide.select(three, TrajectoryPool(ts), 3, m.sketch()) == []
    # One version behind the PS the hold would starve the next buffer: no hold. (Fresh
    # admission: a new group is no reason to keep the version either.)
    fresh_held = ThroughputSync(FRESH, pull_kv=0.25, hold_tail=1)
    for v_traj, pulled in ((2, [0]), (1, [])):
        fleet = Fleet(snapshot(instance(0, 2, [1_000] * 2, v_traj=v_traj), newer))
        assert fresh_held.select(fleet, TrajectoryPool(ts), 3, m.sketch()) == pulled
    # The oldest trajectory runs elsewhere (V_traj 0 on instance 2): instance 0 is Pulled.
    other = Fleet(
        snapshot(instance(0, 1, [1_000], v_traj=1), newer, instance(2, 3, [1_000], v_traj=0))
    )
    assert held.select(other, TrajectoryPool(ts), 3, m.sketch()) == [0]


def test_pulls_are_deferred_only_in_a_loaded_fleet() -> None:
    """Light on both terms of Eq. 11 (a mean batch below k2 / k3, a mean KV below pull_kv
    of the budget), a drained instance steps no faster than a refilled one and a Pull's
    trajectories find light batches: neither the KV deferral nor the hold applies."""
    m = manager(3, eta=1)  # version 1 admits nothing any more
    ts = initial(1, 4)
    deferred = ThroughputSync(ROUTING, pull_kv=0.25)  # 25K of the 100K budget
    held = ThroughputSync(ROUTING, pull_kv=0.25, hold_tail=1)
    crossover = COST.k2 / COST.k3  # 13.8 trajectories
    # Instance 1 is up to date and queued (it wins no routing decision), with `batch`
    # running trajectories in `kv` tokens; instance 0 lags.
    for batch, kv, loaded in (
        (10, 10_000, False),
        (24, 12_000, False),  # a mean batch of 13
        (26, 12_000, True),  # 14
        (2, 60_000, True),  # a mean KV of 45K: few trajectories, long ones
    ):
        newer = instance(1, 3, [1_000] * batch, wait=1, kv=kv)
        # Instance 0 holds 30K of KV, over pull_kv: the KV deferral.
        heavy = Fleet(snapshot(instance(0, 1, [15_000] * 2), newer))
        assert deferred.loaded(heavy) == loaded
        assert (heavy.n_run.mean() >= crossover or heavy.kv.mean() >= 25_000) == loaded
        want = [] if loaded else [0]
        assert deferred.select(heavy, TrajectoryPool(ts), 3, m.sketch()) == want
        # Instance 0 runs the critical tail in 2K of KV: the hold.
        tail = Fleet(snapshot(instance(0, 1, [1_000] * 2, v_traj=1), newer))
        assert deferred.select(tail, TrajectoryPool(ts), 3, m.sketch()) == [0]
        assert held.loaded(tail) == (tail.n_run.mean() >= crossover or tail.kv.mean() >= 25_000)
        want = [] if held.loaded(tail) else [0]
        assert held.select(tail, TrajectoryPool(ts), 3, m.sketch()) == want


def test_critical_holds_come_with_deferred_pulls_and_share_the_tail() -> None:
    s = build_strategies(CoordinatorConfig(critical_tail=5))
    assert isinstance(s.sync, ThroughputSync) and s.sync.hold_tail == 5
    assert s.critical is not None and s.critical.tail == 5
    for overrides in ({"pull_kv": None}, {"routing": "vanilla"}):
        sync = build_strategies(CoordinatorConfig(**overrides)).sync  # type: ignore[arg-type]
        assert isinstance(sync, ThroughputSync) and sync.hold_tail is None
    with pytest.raises(ValueError, match="hold_tail"):
        ThroughputSync(ROUTING, hold_tail=0)


def test_pull_kv_is_validated() -> None:
    with pytest.raises(ValueError, match="pull_kv"):
        ThroughputSync(ROUTING, pull_kv=1.5)


def test_pulls_are_deferred_only_behind_the_throughput_routing() -> None:
    """Least-loaded routing keeps the caches full of queued work, so a Pull deferred until
    the KV drains would come late or never: the rule needs the throughput routing."""
    budget = CoordinatorConfig().cost_model.build().kv_budget
    with_r1 = build_strategies(CoordinatorConfig(pull_kv=0.25)).sync
    assert isinstance(with_r1, ThroughputSync) and with_r1.max_kv == 0.25 * budget
    for routing in ("vanilla", "sticky"):
        sync = build_strategies(CoordinatorConfig(routing=routing, pull_kv=0.25)).sync
        assert isinstance(sync, ThroughputSync) and sync.max_kv is None
