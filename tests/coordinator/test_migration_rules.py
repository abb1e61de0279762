"""Algorithm 5's case 2 with improving moves (coordinator/migration.py): only the
trajectories whose move raises the estimated throughput leave, decided one by one; with
multi-turn work both cases count the trajectories expected back from their tools."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator import CoordinatorConfig, InstanceSnapshot, TrajRecord, build_strategies
from coordinator.config import AgenticRulesConfig
from coordinator.fleet import Fleet
from coordinator.migration import ThroughputMigration
from tests.coordinator.builders import COST, instance, snapshot


def moved(fleet: Fleet, min_gain: float = 0.3) -> list[tuple[int, list[int]]]:
    m = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0, min_gain=min_gain)
    return [(fleet.ids[p], [t.traj_id for t in ts]) for p, ts in m.select(fleet)]


def test_paper_case_2_empties_the_instance_improving_moves_take_a_few() -> None:
    fast = instance(0, 2, [1_000] * 30)
    fleet = Fleet(snapshot(fast, instance(1, 2)))
    paper = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0)
    assert len(paper.select(fleet)[0][1]) == 30
    [(inst, trajs)] = moved(fleet)
    assert inst == 0 and 0 < len(trajs) < 30
    # each move was worth it when made: replay them one by one
    n0, kv0, n1, kv1 = 30.0, 30_000.0, 0.0, 0.0
    for _ in trajs:
        loss = COST.throughput(n0, kv0) - COST.throughput(n0 - 1, kv0 - 1_000)
        gain = COST.marginal_gain(n1, kv1, 0, 1_000)
        assert gain - loss >= 0.3 * COST.ideal_gain(1_000)
        n0, kv0, n1, kv1 = n0 - 1, kv0 - 1_000, n1 + 1, kv1 + 1_000
    # and the next one would not have been
    loss = COST.throughput(n0, kv0) - COST.throughput(n0 - 1, kv0 - 1_000)
    assert COST.marginal_gain(n1, kv1, 0, 1_000) - loss < 0.3 * COST.ideal_gain(1_000)


def test_shortest_first_and_never_to_an_older_instance() -> None:
    top = instance(0, 3, [500, 8_000, 2_000] + [1_000] * 27, v_traj=3)
    fleet = Fleet(snapshot(top, instance(1, 2)))  # idle but too old for V_traj 3
    assert moved(fleet) == []  # (the paper's T_min guard too: no host at all)
    fleet = Fleet(snapshot(top, instance(1, 2), instance(2, 3)))
    [(_, trajs)] = moved(fleet)
    lengths = {t.traj_id: t.length for t in top.run_trajs}
    got = [lengths[t] for t in trajs]
    assert got == sorted(got) and got[0] == 500


def test_a_slow_destination_is_worth_less() -> None:
    fleet = Fleet(snapshot(instance(0, 2, [1_000] * 30), instance(1, 2)))
    fast = len(moved(fleet)[0][1])
    fleet.speed = np.array([1.0, 3.0])
    slow = moved(fleet)
    assert (len(slow[0][1]) if slow else 0) < fast


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.integers(0, 60), min_size=2, max_size=5),
    speeds=st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=5, max_size=5),
)
def test_moves_come_from_one_instance_and_never_repeat(
    loads: list[int], speeds: list[float]
) -> None:
    fleet = Fleet(snapshot(*(instance(i, 2, [1_000] * n) for i, n in enumerate(loads))))
    fleet.speed = np.array(speeds[: len(loads)])
    m = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0, min_gain=0.3)
    out = m.select(fleet)
    ids = [t.traj_id for _, ts in out for t in ts]
    assert len(ids) == len(set(ids))
    assert len({p for p, _ in out}) == len(out) <= 1
    again = {t.traj_id for _, ts in m.select(fleet) for t in ts}
    assert not again & set(ids)  # nothing moves again before it decodes


def _back(n: float, kv: float):
    """A ``returns`` that expects ``n`` trajectories of ``kv`` KV back on instance 1."""
    return lambda fleet: (np.array([0.0, n]), np.array([0.0, kv]))


def _at_tools(snap: InstanceSnapshot, ids: range) -> InstanceSnapshot:
    """``snap`` with trajectories of ``ids`` at their tools (migration reads returns only
    where some wait)."""
    return replace(snap, env_trajs=tuple(TrajRecord(i, 0, 2, 1_000, 50) for i in ids))


def test_an_instance_whose_trajectories_come_back_is_not_idle_to_case_2() -> None:
    """Instance 1 decodes nothing, but 30 trajectories whose prefixes it caches are
    expected back from their tools within a turn: moves onto it that pay on its decoding
    load alone do not pay on the load it is about to run."""
    fleet = Fleet(snapshot(instance(0, 2, [1_000] * 30), _at_tools(instance(1, 2), range(30))))
    plain = ThroughputMigration(COST, phi_wait=3, phi_throughput=5.0, min_gain=0.3)
    assert plain.select(fleet)  # its empty batch draws moves
    some = ThroughputMigration(
        COST, phi_wait=3, phi_throughput=5.0, min_gain=0.3, returns=_back(3.0, 3_000.0)
    )
    full = ThroughputMigration(
        COST, phi_wait=3, phi_throughput=5.0, min_gain=0.3, returns=_back(30.0, 30_000.0)
    )
    assert 0 < len(some.select(fleet)[0][1]) < len(plain.select(fleet)[0][1])
    assert full.select(fleet) == []  # level with instance 0 once they are back


def test_case_1_gives_a_queue_back_only_where_room_is_left_after_the_returns() -> None:
    # instance 1 decodes as much as instance 0 (case 2 has no ratio to act on)
    busy = instance(1, 2, [1_000] * 4)
    fleet = Fleet(snapshot(instance(0, 2, [1_000] * 4, wait=10), _at_tools(busy, range(90))))
    plain = ThroughputMigration(COST, phi_wait=3, phi_throughput=1e9)
    assert [len(t) for _, t in plain.select(fleet)] == [7]  # the excess over phi_wait
    back = ThroughputMigration(
        COST, phi_wait=3, phi_throughput=1e9, returns=_back(90.0, COST.kv_budget)
    )
    assert back.select(fleet) == []  # instance 1's KV is spoken for


def test_migration_counts_the_returns_only_with_the_rule_on() -> None:
    """The switch (``coordinator.agentic.expected_returns``) reaches migration, with the
    run's learned waits: short waits measured, so the waiting trajectories whose prefix
    instance 1 caches are expected back, and improving moves onto it stop."""
    base = instance(1, 2)
    held = tuple((i, 1_000) for i in range(30))
    snap = snapshot(instance(0, 2, [1_000] * 30), replace(_at_tools(base, range(30)), held=held))
    on, off = (
        build_strategies(CoordinatorConfig(agentic=AgenticRulesConfig(expected_returns=flag)))
        for flag in (True, False)
    )
    for s in (on, off):
        assert s.waits is not None
        s.waits.learn([0.01] * 64, [250] * 64)  # tools answer at once: all back soon
        s.waits.observe(snap, [])
    assert isinstance(on.migration, ThroughputMigration) and on.migration.returns is not None
    fleet = Fleet(snap)
    moved_off = off.migration.select(fleet)
    assert moved_off and len(moved_off[0][1]) > len(
        (on.migration.select(Fleet(snap)) or [(0, ())])[0][1]
    )
