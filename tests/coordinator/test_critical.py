"""The critical-path rule (coordinator/critical.py), decision for decision, and its moves
through Algorithm 1 (Interrupt from the source, Route to the chosen instance)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import InstanceSnapshot, Interrupt, Route, TrajRecord, plan_cycle
from coordinator.critical import CriticalPath
from coordinator.fleet import Fleet
from coordinator.migration import ThroughputMigration
from coordinator.pool import TrajectoryPool
from coordinator.strategies import MigrationStrategy
from tests.coordinator.builders import (
    COST,
    instance,
    manager,
    partial,
    running,
    snapshot,
    strategies,
)

OLD = 1  # the oldest V_traj in flight in these tests


def mixed(
    inst: int,
    version: int,
    critical: Sequence[int],
    others: int = 0,
    *,
    queued: Sequence[int] = (),
) -> InstanceSnapshot:
    """``critical`` trajectories of version OLD (lengths given) and ``others`` of 1,000
    tokens at the instance's version, running; ``queued`` critical ones waiting."""
    run = running(critical, OLD) + running([1_000] * others, version)
    wait = running(queued, OLD)
    return InstanceSnapshot(inst, sum(t.length for t in run), run, wait, (), version)


def moves(fleet: Fleet, ts: list | None = None, rule: CriticalPath | None = None) -> list:
    rule = rule or CriticalPath(COST, speedup=1.5, fill_steps=0)
    pool = TrajectoryPool(ts or [])
    return [(fleet.ids[a], t.traj_id, fleet.ids[b]) for a, t, b in rule.select(fleet, pool)]


def ids(s: InstanceSnapshot, where: str = "run") -> list[int]:
    return [t.traj_id for t in (s.run_trajs if where == "run" else s.wait_trajs)]


def test_the_oldest_tail_moves_from_a_busy_instance_to_a_light_one() -> None:
    busy = mixed(0, 3, [8_000], 60)
    assert moves(Fleet(snapshot(busy, instance(1, 3, [1_000] * 2)))) == [(0, ids(busy)[0], 1)]


def test_nothing_moves_before_the_tail() -> None:
    # 3 instances, 4 trajectories of the oldest version: not yet the tail
    fleet = Fleet(snapshot(mixed(0, 2, [1_000] * 4, 60), instance(1, 2), instance(2, 2)))
    assert moves(fleet) == []
    fleet = Fleet(snapshot(mixed(0, 2, [1_000] * 2, 60), instance(1, 2), instance(2, 2)))
    assert len(moves(fleet)) == 2
    # those waiting in the TS count too
    assert moves(fleet, [partial(OLD), partial(OLD)]) == []


def test_a_wider_tail_wakes_the_rule_earlier() -> None:
    # 3 instances, 4 trajectories of the oldest version: the tail at two per instance
    fleet = Fleet(snapshot(mixed(0, 2, [1_000] * 4, 60), instance(1, 2), instance(2, 2)))
    assert moves(fleet) == []
    wide = CriticalPath(COST, speedup=1.5, fill_steps=0, tail=2)
    assert len(moves(fleet, rule=wide)) == 4
    with pytest.raises(ValueError, match="tail"):
        CriticalPath(COST, tail=0)


def test_not_worth_it_below_the_speedup() -> None:
    # instance 0 runs 2 trajectories: moving one to an idle instance barely helps
    assert moves(Fleet(snapshot(mixed(0, 2, [1_000], 1), instance(1, 2)))) == []


def test_a_faster_instance_is_found_through_its_speed() -> None:
    fleet = Fleet(snapshot(mixed(0, 2, [1_000], 1), instance(1, 2, [1_000])))
    fleet.speed = np.array([2.0, 1.0])  # instance 0 is twice as slow as the model
    assert [(src, dst) for src, _, dst in moves(fleet)] == [(0, 1)]


def test_destinations_must_be_recent_enough_open_and_have_room() -> None:
    src = mixed(0, 3, [2_000], 60)
    too_old = instance(1, 0)  # version 0 < V_traj 1
    queued = instance(2, 3, [100], wait=1)
    full = instance(3, 3, [49_000, 49_000])
    assert moves(Fleet(snapshot(src, too_old, queued, full))) == []
    assert moves(Fleet(snapshot(src, too_old, queued, full, instance(4, 3))))[0][2] == 4


def test_longest_first() -> None:
    src = mixed(0, 2, [3_000, 9_000, 6_000], 70)
    got = moves(Fleet(snapshot(src, instance(1, 2), instance(2, 2), instance(3, 2))))
    c = ids(src)[:3]
    assert [tid for _, tid, _ in got] == [c[1], c[2], c[0]]
    assert len({dst for *_, dst in got}) == 3  # each destination is loaded for the next


def test_a_trajectory_is_not_moved_again_before_it_decodes() -> None:
    rule = CriticalPath(COST, speedup=1.5, fill_steps=0)
    fleet = Fleet(snapshot(mixed(0, 2, [5_000], 60), instance(1, 2)))
    assert len(moves(fleet, rule=rule)) == 1
    assert moves(fleet, rule=rule) == []


def test_a_queued_critical_trajectory_moves_to_any_open_instance() -> None:
    src = mixed(0, 2, [], 5, queued=[100])
    other = mixed(1, 2, [], 10)  # slower than instance 0 would be: still better than a queue
    assert moves(Fleet(snapshot(src, other))) == [(0, ids(src, "wait")[0], 1)]


def test_the_cycle_interrupts_and_routes_the_move() -> None:
    src = mixed(0, 3, [6_000], 60)
    crit = ids(src)[0]
    light = instance(1, 3, [1_000] * 2)
    # phi_throughput out of reach: Algorithm 5's case 2 would otherwise empty instance 0
    strat = strategies(critical_speedup=1.5, phi_throughput=1e9)
    cmds = plan_cycle(snapshot(src, light), [], 3, manager(3).sketch(), strat)
    assert cmds[0] == Interrupt(0, (crit,))
    assert Route(1, (crit,), ()) in cmds  # partial: no Reserve
    off = strategies(phi_throughput=1e9)
    assert plan_cycle(snapshot(src, light), [], 3, manager(3).sketch(), off) == []


def test_records_are_plain_views() -> None:
    assert isinstance(running([1], OLD)[0], TrajRecord)


def _unfiltered(rule: CriticalPath, fleet: Fleet, pool: TrajectoryPool) -> list:
    """The rule's loop without its lower-bound skip: every tail trajectory is tried."""
    from coordinator.critical import oldest_tail
    from coordinator.gains import spare

    oldest, on = oldest_tail(fleet, pool, rule.tail)
    c, out = rule.cost, []
    lat = fleet.latencies(c)
    n, kv = fleet.n_run.copy(), fleet.kv.copy()
    open_ = (fleet.n_wait == 0) & (fleet.version >= oldest)
    for pos, t in sorted(on, key=lambda pt: (-pt[1].length, pt[1].traj_id)):
        ok = open_ & spare(c, n, kv, t.length, rule.fill_steps)
        ok[pos] = False
        if not ok.any():
            continue
        after = c.k1 * (kv + c.k5 * t.length) + np.maximum(c.k2, c.k3 * (n + 1.0)) + c.k4
        after *= fleet.speed
        best = int(np.flatnonzero(ok)[after[ok].argmin()])
        if t not in fleet.wait[pos] and lat[pos] < rule.speedup * after[best]:
            continue
        out.append((fleet.ids[pos], t.traj_id, fleet.ids[best]))
        n[best] += 1.0
        kv[best] += c.k5 * t.length
    return out


@settings(max_examples=150, deadline=None)
@given(
    loads=st.lists(
        st.tuples(
            st.lists(st.integers(100, 30_000), max_size=4),  # oldest-version lengths
            st.integers(0, 90),  # newer trajectories running
            st.integers(0, 2),  # queued oldest ones
            st.floats(0.5, 2.0),  # speed factor
        ),
        min_size=2,
        max_size=6,
    ),
    tail=st.integers(1, 4),
    fill=st.sampled_from([0, 200]),
)
def test_the_lower_bound_skips_only_trajectories_that_cannot_move(
    loads: list[tuple[list[int], int, int, float]], tail: int, fill: int
) -> None:
    """The rule skips a running trajectory whose instance is not ``speedup`` times slower
    than a bound on every destination; it must decide exactly as trying every one."""
    insts = [
        mixed(i, 2, crit, others, queued=[500] * q) for i, (crit, others, q, _) in enumerate(loads)
    ]
    fleet = Fleet(snapshot(*insts))
    fleet.speed = np.array([speed for *_, speed in loads])
    rule = CriticalPath(COST, speedup=1.5, fill_steps=fill, tail=tail)
    want = _unfiltered(rule, fleet, TrajectoryPool([]))
    assert moves(fleet, rule=rule) == want


def test_migration_leaves_a_trajectory_the_rule_just_moved() -> None:
    """The two movers share one record (build_strategies): what the critical rule has just
    moved, Algorithm 5's case 2 does not move again before it has decoded where it went.
    Without that the simulator saw tail trajectories bounce every cycle onto the fastest
    instance and off again, each move a re-prefill, until that instance stalled."""
    strat = strategies(critical_speedup=1.5, improving_moves=True)
    assert strat.critical is not None
    src = mixed(0, 3, [6_000], 60)
    crit = ids(src)[0]
    fleet = Fleet(snapshot(src, instance(1, 3, [1_000] * 2)))
    assert [
        (t.traj_id, fleet.ids[b]) for _, t, b in strat.critical.select(fleet, TrajectoryPool([]), 3)
    ] == [(crit, 1)]

    def after(length: int) -> Fleet:
        """The next snapshots: the moved trajectory, the shortest, runs on instance 1 beside
        long ones; instance 2 is idle, so case 2 unloads instance 1 shortest first."""
        run = (TrajRecord(crit, -1, OLD, length, 50), *running([8_000] * 10, 3))
        busy = InstanceSnapshot(1, sum(t.length for t in run), run, (), (), 3)
        return Fleet(snapshot(instance(0, 3, [1_000] * 2), busy, instance(2, 3)))

    def case_2(migration: MigrationStrategy, fleet: Fleet) -> list[int]:
        return [t.traj_id for _, ts in migration.select(fleet) for t in ts]

    alone = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0, min_gain=0.3)
    assert crit in case_2(alone, after(6_000))  # on its own, case 2 would move it back
    assert crit not in case_2(strat.migration, after(6_000))
    assert crit in case_2(strat.migration, after(6_001))  # once it has decoded, it may
