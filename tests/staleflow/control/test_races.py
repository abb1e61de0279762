"""The tail-race selection both backends share (staleflow/control/races.py)."""

from __future__ import annotations

from typing import Any

from coordinator.types import InstanceSnapshot
from staleflow.control.races import RaceEntry, hosting, select_races


def _never() -> Any:
    raise AssertionError("read although no instance outside the races is idle")


class _Recording:
    """Stands in for ``coordinator.race.TailRace``: records what it is asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[dict[int, int], set[int], tuple[int, ...]]] = []

    def select(self, fleet: Any, pool: Any, racing: dict[int, int], busy: set[int]) -> list:
        self.asked.append((racing, busy, tuple(fleet.ids)))
        return []


def _idle(inst: int) -> InstanceSnapshot:
    return InstanceSnapshot(
        inst=inst, kv_cache=0, run_trajs=(), wait_trajs=(), complete_trajs=(), inst_version=0
    )


def test_hosting_names_every_destination_of_a_copy() -> None:
    active = {7: RaceEntry(holder=0, fork=3, dests=[1, 2]), 9: RaceEntry(0, 5, [2])}
    assert hosting(active) == {1, 2}


def test_nothing_is_read_while_only_the_races_hosts_are_idle() -> None:
    rule = _Recording()
    active = {7: RaceEntry(holder=0, fork=3, dests=[1])}
    assert tuple(select_races(rule, active, [1], _never, _never)) == ()  # type: ignore[arg-type]
    assert rule.asked == []


def test_an_idle_instance_hands_the_rule_the_fleet_and_who_races_where() -> None:
    rule = _Recording()
    active = {7: RaceEntry(holder=0, fork=3, dests=[1])}
    snapshots = [_idle(0), _idle(1), _idle(2)]
    select_races(rule, active, [1, 2], lambda: snapshots, lambda: [])  # type: ignore[arg-type]
    assert rule.asked == [({7: 1}, {1}, (0, 1, 2))]
