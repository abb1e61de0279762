"""Vanilla routing (§6.5): least-loaded by trajectory count, still staleness-safe."""

from __future__ import annotations

from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.vanilla_routing import LeastLoadedRouting
from tests.coordinator.builders import COST, initial, instance, manager, partial, snapshot


def test_routes_everything_to_the_least_loaded_admissible_instance() -> None:
    fleet = Fleet(snapshot(instance(0, 3, [1_000] * 3), instance(1, 3, [1_000]), instance(2, 3)))
    placements = LeastLoadedRouting(COST).route(
        fleet, TrajectoryPool(initial(1, 5)), manager(3, batch=8).sketch()
    )
    assert [fleet.ids[p.pos] for p in placements] == [2, 1, 2, 1, 2]
    assert (fleet.n_run + fleet.n_wait).tolist() == [3, 3, 3]


def test_ignores_kv_budget_and_queues_but_not_staleness() -> None:
    m = manager(3, eta=1)  # version 1 is too stale for a new group
    full = instance(0, 1, [99_000])
    fleet = Fleet(snapshot(full, instance(1, 3, [1_000] * 50), instance(2, 2, [50_000], wait=2)))
    old = partial(3)
    placements = LeastLoadedRouting(COST).route(
        fleet, TrajectoryPool([old, *initial(1, 2)]), m.sketch()
    )
    got = [(fleet.ids[p.pos], p.traj.traj_id) for p in placements]
    assert got[0] == (1, old.traj_id)  # V_traj 3: only instance 1 is new enough
    assert [inst for inst, _ in got[1:]] == [2, 2]  # instance 0 is inadmissible
    assert fleet.n_wait[2] == 4  # queued behind the waiting trajectories


def test_skips_a_trajectory_with_no_admissible_instance() -> None:
    m = manager(3, eta=0, batch=1)
    fleet = Fleet(snapshot(instance(0, 3)))
    first, second = initial(1), initial(2)
    placements = LeastLoadedRouting(COST).route(
        fleet, TrajectoryPool([*first, *second, partial(3)]), m.sketch()
    )
    assert [p.traj.group_id for p in placements] == [-2, 1]  # partial first; group 2 skipped


# -- sticky: the in-flight-limited systems' fixed assignment ------------------------------


def test_sticky_routing_sends_an_interrupted_trajectory_back_to_its_instance() -> None:
    routing = LeastLoadedRouting(COST, sticky=True)
    m = manager(3, batch=8, group=4)
    fleet = Fleet(snapshot(instance(0, 3, [1_000] * 5), instance(1, 3), instance(2, 3)))
    first = routing.route(fleet, TrajectoryPool(initial(1, 4)), m.sketch())
    home = {p.traj.traj_id: fleet.ids[p.pos] for p in first}
    assert sorted(home.values()) == [1, 1, 2, 2]  # new ones: least loaded
    # A global Pull interrupted them all; they come back as partials of version 3 and
    # return home although instance 0 is now the least loaded.
    back = [partial(3, 500) for _ in first]
    for t, p in zip(back, first, strict=True):
        routing.home[t.traj_id] = home[p.traj.traj_id]
    fleet = Fleet(snapshot(instance(0, 3), instance(1, 3, [1_000] * 9), instance(2, 3)))
    again = routing.route(fleet, TrajectoryPool(back), m.sketch())
    assert [fleet.ids[p.pos] for p in again] == [routing.home[t.traj_id] for t in back]
    # the non-sticky router spreads them instead
    fleet = Fleet(snapshot(instance(0, 3), instance(1, 3, [1_000] * 9), instance(2, 3)))
    spread = LeastLoadedRouting(COST).route(fleet, TrajectoryPool(back), m.sketch())
    assert 0 in [fleet.ids[p.pos] for p in spread]


def test_sticky_routing_remembers_its_own_placements() -> None:
    routing = LeastLoadedRouting(COST, sticky=True)
    m = manager(3, batch=8, group=2)
    fleet = Fleet(snapshot(instance(0, 3, [1_000]), instance(1, 3)))
    [p] = routing.route(fleet, TrajectoryPool(initial(1, 1)), m.sketch())
    assert routing.home == {p.traj.traj_id: 1}


def test_sticky_falls_back_when_home_is_too_old_or_gone() -> None:
    routing = LeastLoadedRouting(COST, sticky=True)
    t, u = partial(3), partial(3)
    routing.home = {t.traj_id: 0, u.traj_id: 7}  # 0 is at version 2; 7 does not exist
    fleet = Fleet(snapshot(instance(0, 2), instance(1, 3, [1_000] * 4), instance(2, 3)))
    placed = routing.route(fleet, TrajectoryPool([t, u]), manager(3).sketch())
    assert [fleet.ids[p.pos] for p in placed] == [2, 2]
    assert routing.home == {t.traj_id: 2, u.traj_id: 2}


def test_sticky_home_counts_as_load_for_later_choices() -> None:
    routing = LeastLoadedRouting(COST, sticky=True)
    t = partial(3)
    routing.home = {t.traj_id: 0}
    fleet = Fleet(snapshot(instance(0, 3), instance(1, 3)))
    m = manager(3, batch=8, group=2)
    placed = routing.route(fleet, TrajectoryPool([t, *initial(1, 2)]), m.sketch())
    # t goes home to 0; the two new ones then see 0 holding one: 1 first, then 0 or 1
    assert [fleet.ids[p.pos] for p in placed][:2] == [0, 1]
    assert (fleet.n_run + fleet.n_wait).tolist() in ([2.0, 1.0], [1.0, 2.0])


def test_sticky_map_is_pruned_to_what_is_in_flight() -> None:
    routing = LeastLoadedRouting(COST, sticky=True)
    routing.home = {i: 0 for i in range(5_000)}  # finished long ago
    t = partial(3)
    routing.home[t.traj_id] = 0
    fleet = Fleet(snapshot(instance(0, 3)))
    routing.route(fleet, TrajectoryPool([t]), manager(3).sketch())
    assert routing.home == {t.traj_id: 0}
