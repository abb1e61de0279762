"""Algorithm 5 and the vanilla counterpart."""

from __future__ import annotations

from dataclasses import replace

from coordinator.fleet import Fleet
from coordinator.migration import NoMigration, ThroughputMigration
from tests.coordinator.builders import COST, instance, snapshot

MIGRATION = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0)


def chosen(fleet: Fleet) -> list[tuple[int, list[int]]]:
    return [(fleet.ids[p], [t.traj_id for t in ts]) for p, ts in MIGRATION.select(fleet)]


def test_excess_waiting_trajectories_leave_from_the_tail_of_the_queue() -> None:
    busy = instance(0, 2, [1_000] * 5, wait=5)
    fleet = Fleet(snapshot(busy, instance(1, 2, [1_000] * 5)))
    [(inst, trajs)] = chosen(fleet)
    assert inst == 0
    assert trajs == [t.traj_id for t in busy.wait_trajs[-2:]]


def test_no_migration_at_or_below_phi_wait() -> None:
    fleet = Fleet(snapshot(instance(0, 2, [1_000] * 5, wait=3), instance(1, 2, [1_000] * 5)))
    assert chosen(fleet) == []


def test_throughput_gap_above_phi_empties_the_fastest_instance() -> None:
    fast = instance(0, 2, [1_000] * 30)
    slow = instance(1, 2, [20_000])
    fleet = Fleet(snapshot(fast, slow))
    t_fast, t_slow = COST.throughput(30, 30_000), COST.throughput(1, 20_000)
    assert t_fast / t_slow > 5
    assert chosen(fleet) == [(0, [t.traj_id for t in fast.run_trajs])]


def test_gap_within_phi_is_left_alone() -> None:
    fleet = Fleet(snapshot(instance(0, 2, [1_000] * 30), instance(1, 2, [1_000] * 12)))
    assert COST.throughput(30, 30_000) / COST.throughput(12, 12_000) <= 5
    assert chosen(fleet) == []


def test_idle_instance_counts_as_zero_throughput() -> None:
    fast = instance(0, 2, [1_000] * 4)
    fleet = Fleet(snapshot(fast, instance(1, 2)))
    assert chosen(fleet) == [(0, [t.traj_id for t in fast.run_trajs])]


def test_an_instance_too_old_for_the_trajectories_does_not_trigger_migration() -> None:
    # Instance 1 is idle but older than every trajectory on instance 0: they could only
    # come back where they were, so emptying instance 0 would be pure churn.
    fleet = Fleet(snapshot(instance(0, 3, [1_000] * 4), instance(1, 2)))
    assert chosen(fleet) == []


def test_a_single_trajectory_is_never_migrated() -> None:
    fleet = Fleet(snapshot(instance(0, 2, [1_000]), instance(1, 2)))
    assert chosen(fleet) == []


def test_both_cases_on_one_instance_interrupt_each_trajectory_once() -> None:
    fast = instance(0, 2, [1_000] * 30, wait=5)
    fleet = Fleet(snapshot(fast, instance(1, 2, [20_000])))
    moves = chosen(fleet)
    assert [inst for inst, _ in moves] == [0, 0]
    flat = [t for _, ts in moves for t in ts]
    assert len(flat) == len(set(flat)) == 35


def test_vanilla_never_migrates() -> None:
    fleet = Fleet(snapshot(instance(0, 2, [1_000] * 30, wait=9), instance(1, 2)))
    assert NoMigration().select(fleet) == []


def test_trajectories_moved_without_progress_since_are_not_moved_again() -> None:
    """The livelock the simulator found: an idle instance makes the ratio infinite every
    cycle, and the same trajectories came back and left again before decoding a token."""
    migration = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0)
    fast = instance(0, 2, [1_000] * 4)
    [(_, moved)] = migration.select(Fleet(snapshot(fast, instance(1, 2))))
    assert len(moved) == 4
    # Routing put them all on instance 1 and instance 0 is idle: no progress, no move.
    back = replace(instance(1, 2), run_trajs=fast.run_trajs, kv_cache=4_000)
    assert migration.select(Fleet(snapshot(instance(0, 2), back))) == []
    # Once they have decoded, the imbalance may move them again.
    grown = tuple(replace(t, length=t.length + 50) for t in fast.run_trajs)
    back = replace(back, run_trajs=grown)
    assert len(migration.select(Fleet(snapshot(instance(0, 2), back)))[0][1]) == 4


def test_a_queue_stays_where_it_is_when_no_instance_could_start_it() -> None:
    # Both instances queue: giving instance 0's excess back would only queue it again
    # (a least-loaded router puts it straight back), so case 1 leaves it.
    fleet = Fleet(
        snapshot(instance(0, 2, [1_000] * 5, wait=9), instance(1, 2, [1_000] * 5, wait=1))
    )
    assert chosen(fleet) == []
    # an idle instance, but too old for the queued trajectories (V_traj 3): same
    busy = instance(0, 3, [1_000] * 5, wait=9)
    assert chosen(Fleet(snapshot(busy, instance(1, 2)))) == []
    # at a version that admits them, the idle instance takes the excess
    moves = chosen(Fleet(snapshot(busy, instance(1, 3))))
    assert moves[0] == (0, [t.traj_id for t in busy.wait_trajs[-6:]])


def test_a_queue_given_back_is_not_given_back_again_before_it_runs() -> None:
    migration = ThroughputMigration(COST, phi_wait=3, phi_throughput=1e9)  # case 1 only
    busy = instance(0, 2, [1_000] * 5, wait=5)
    fleet = Fleet(snapshot(busy, instance(1, 2, [1_000] * 5)))
    [(_, first)] = migration.select(fleet)
    # a least-loaded router queued the same two right back: they have not run since
    assert migration.select(Fleet(snapshot(busy, instance(1, 2, [1_000] * 5)))) == []
    # once they have generated tokens, they may move again
    grown = replace(
        busy,
        wait_trajs=busy.wait_trajs[:-2]
        + tuple(replace(t, length=t.length + 1) for t in busy.wait_trajs[-2:]),
    )
    [(_, again)] = migration.select(Fleet(snapshot(grown, instance(1, 2, [1_000] * 5))))
    assert [t.traj_id for t in again] == [t.traj_id for t in first]
