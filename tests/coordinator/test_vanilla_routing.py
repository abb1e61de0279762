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
