"""The tail race (coordinator/race.py), decision for decision on small fleets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from coordinator import InstanceSnapshot, RaceConfig
from coordinator.config import ConfigError
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.race import TailRace
from tests.coordinator.builders import COST, instance, partial, running, snapshot, strategies

OLD = 1  # the oldest V_traj in flight in these tests


def holder(inst: int, version: int, critical: Sequence[int], others: int = 0) -> InstanceSnapshot:
    """``critical`` trajectories of V_traj OLD running with ``others`` newer ones."""
    run = running(critical, OLD) + running([1_000] * others, version + 1)
    return InstanceSnapshot(inst, sum(t.length for t in run), run, (), (), version)


def races(fleet: Fleet, ts: list | None = None, rule: TailRace | None = None, **kw) -> list:
    rule = rule or TailRace(COST)
    return [
        (r.holder, r.traj.traj_id, r.dest)
        for r in rule.select(fleet, TrajectoryPool(ts or []), **kw)
    ]


def tid(s: InstanceSnapshot, i: int = 0) -> int:
    return s.run_trajs[i].traj_id


def test_a_straggler_is_raced_on_an_idle_instance_of_its_version() -> None:
    busy = holder(0, 2, [3_000], 40)
    assert races(Fleet(snapshot(busy, instance(1, 2)))) == [(0, tid(busy), 1)]


def test_nothing_without_an_idle_instance() -> None:
    busy = holder(0, 2, [3_000], 40)
    assert races(Fleet(snapshot(busy, instance(1, 2, [500])))) == []
    assert races(Fleet(snapshot(busy, instance(1, 2, wait=1, kv=0)))) == []


def test_nothing_before_the_oldest_version_is_the_tail() -> None:
    # 2 instances, 3 trajectories of the oldest version: not yet the tail
    fleet = Fleet(snapshot(holder(0, 2, [1_000] * 3), instance(1, 2)))
    assert races(fleet) == []
    # those waiting in the TS count too
    fleet = Fleet(snapshot(holder(0, 2, [1_000]), instance(1, 2), instance(2, 2)))
    assert len(races(fleet)) == 1
    assert races(fleet, [partial(OLD)] * 3) == []


def test_a_destination_on_another_version_is_refused() -> None:
    # a copy under other weights would be another sample, not the same tokens
    busy = holder(0, 2, [3_000], 40)
    assert races(Fleet(snapshot(busy, instance(1, 3)))) == []
    assert races(Fleet(snapshot(busy, instance(1, 1)))) == []


def test_one_copy_per_trajectory_and_one_per_destination() -> None:
    busy = holder(0, 2, [3_000], 40)
    fleet = Fleet(snapshot(busy, instance(1, 2), instance(2, 2)))
    assert races(fleet) == [(0, tid(busy), 1)]
    # already racing: no second copy
    assert races(fleet, racing={tid(busy): 1}) == []
    # copies=2 takes both idle instances
    assert races(fleet, rule=TailRace(COST, copies=2)) == [(0, tid(busy), 1), (0, tid(busy), 2)]
    # two stragglers, one idle instance: the one whose holder is slower gets it
    slow, fast = holder(0, 2, [2_000], 60), holder(1, 2, [2_000], 5)
    fleet = Fleet(snapshot(slow, fast, instance(2, 2)))
    assert races(fleet) == [(0, tid(slow), 2)]
    fleet.speed = np.array([1.0, 20.0, 1.0])  # estimated: instance 1 is far slower
    assert races(fleet) == [(1, tid(fast), 2)]


def test_an_instance_hosting_a_copy_is_not_idle() -> None:
    busy = holder(0, 2, [3_000], 40)
    fleet = Fleet(snapshot(busy, instance(1, 2), instance(2, 2)))
    assert races(fleet, hosting={1}) == [(0, tid(busy), 2)]
    assert races(fleet, hosting={1, 2}) == []


def test_queued_stragglers_are_not_raced_and_room_is_needed() -> None:
    queued = InstanceSnapshot(0, 0, (), running([3_000], OLD), (), 2)
    assert races(Fleet(snapshot(queued, instance(1, 2)))) == []
    big = holder(0, 2, [90_000])
    fleet = Fleet(snapshot(big, instance(1, 2)))
    assert races(fleet) == [(0, tid(big), 1)]
    assert races(fleet, rule=TailRace(COST, fill_steps=1_000_000)) == []


def test_config_and_strategies() -> None:
    assert strategies().race is None
    rule = strategies(race=RaceConfig(enabled=True, copies=2)).race
    assert isinstance(rule, TailRace) and rule.copies == 2
    with pytest.raises(ConfigError, match=r"coordinator\.race\.copies=0"):
        RaceConfig(copies=0)
    with pytest.raises(ConfigError, match=r"coordinator\.race\.enabled"):
        RaceConfig(enabled="yes")  # type: ignore[arg-type]
