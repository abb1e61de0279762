"""Speculative state P (Table 1) and snapshot validation (Eq. 1)."""

from __future__ import annotations

from coordinator import (
    Abort,
    CommandDone,
    Interrupt,
    Pull,
    Reservation,
    Route,
    SpeculativeState,
)
from tests.coordinator.builders import instance, snapshot


def test_startup_state_accepts_empty_version0_instances() -> None:
    p = SpeculativeState([0, 1])
    assert p.validate(snapshot(instance(0, 0), instance(1, 0)))
    assert p.mismatches(snapshot(instance(0, 0), instance(1, 0))) == []


def test_rejects_until_every_command_shows() -> None:
    p = SpeculativeState({0: 0, 1: 0})
    p.apply(Route(0, (1, 2, 3), (Reservation(7, 1, 0),)))
    p.apply(Route(1, (4,)))
    assert p.expected(0) == (0, 3)
    # Routes not visible yet on instance 0: the snapshot is outdated.
    assert not p.validate(snapshot(instance(0, 0, [10]), instance(1, 0, [10])))
    # Completed trajectories still count (accum includes complete_trajs).
    assert p.validate(snapshot(instance(0, 0, [10], wait=1, complete=1), instance(1, 0, [10])))


def test_interrupt_abort_and_pull_effects() -> None:
    p = SpeculativeState({0: 2})
    p.apply(Route(0, (1, 2, 3, 4)))
    p.apply(Interrupt(0, (1,)))
    p.apply(Abort(0, (2,)))
    assert p.expected(0) == (2, 2)
    p.apply(Interrupt(0, (3, 4)))
    p.apply(Pull(0, 5))
    assert p.expected(0) == (5, 0)
    assert not p.validate(snapshot(instance(0, 2)))  # Pull not done yet: old version
    assert p.validate(snapshot(instance(0, 5)))
    p.apply(Route(0, (9,)))
    assert p.validate(snapshot(instance(0, 5, [10])))


def test_rejects_unknown_or_missing_instances() -> None:
    p = SpeculativeState([0, 1])
    assert not p.validate(snapshot(instance(0, 0)))
    assert not p.validate(snapshot(instance(0, 0), instance(1, 0), instance(2, 0)))
    assert not p.validate(snapshot(instance(0, 0), instance(2, 0)))
    assert {m.inst for m in p.mismatches(snapshot(instance(0, 0), instance(2, 0)))} == {1, 2}
    p.add_instance(2, 3)
    assert p.validate(snapshot(instance(0, 0), instance(1, 0), instance(2, 3)))


def test_shortfalls_are_settled_so_validation_recovers() -> None:
    p = SpeculativeState({0: 0})
    first = Route(0, (1, 2, 3))
    p.apply(first)
    p.settle(CommandDone(first))
    assert p.validate(snapshot(instance(0, 0, [5, 5, 5])))
    late = Interrupt(0, (1, 2))
    p.apply(late)
    # Trajectory 2 completed before the Interrupt reached the engine: it stays counted.
    seen = snapshot(instance(0, 0, [5], complete=1))
    assert not p.validate(seen)
    p.settle(CommandDone(late, missed=(2,)))
    assert p.validate(seen)
    route = Route(0, (8, 9))
    p.apply(route)
    p.settle(CommandDone(route, missed=(9,)))  # the TS no longer had trajectory 9
    assert p.validate(snapshot(instance(0, 0, [5, 5], complete=1)))
    assert p.in_flight == 0


def test_pull_reports_newer_version_and_voids_older_shortfalls() -> None:
    p = SpeculativeState({0: 1})
    p.apply(Route(0, (1, 2)))
    stop = Interrupt(0, (1, 2))
    pull = Pull(0, 2)
    p.apply(stop)
    p.apply(pull)
    p.settle(CommandDone(pull, loaded_version=3))  # the PS moved on meanwhile
    # The Pull cleared the instance: a late shortfall of the Interrupt must not count.
    p.settle(CommandDone(stop, missed=(2,)))
    assert p.validate(snapshot(instance(0, 3)))


def test_settle_ignores_commands_it_never_issued() -> None:
    p = SpeculativeState({0: 0})
    p.settle(CommandDone(Route(0, (1,)), missed=(1,)))
    assert p.validate(snapshot(instance(0, 0)))


def test_instance_listed_twice_does_not_hide_a_missing_one() -> None:
    p = SpeculativeState([0, 1])
    assert not p.validate(snapshot(instance(0, 0), instance(0, 0)))


def test_a_removed_instance_leaves_the_snapshot_and_its_commands_settle_nothing() -> None:
    p = SpeculativeState({0: 1, 1: 1})
    lost = Route(1, (4, 5))
    p.apply(lost)
    p.apply(Route(0, (1,)))
    p.remove_instance(1)
    assert p.instances == (0,)
    assert p.validate(snapshot(instance(0, 1, [10])))  # instance 1 is no longer expected
    assert not p.validate(snapshot(instance(0, 1, [10]), instance(1, 1, [10, 10])))
    p.settle(CommandDone(lost, missed=(4, 5)))  # arrives after the loss: ignored
    assert p.in_flight == 1
    p.add_instance(2, 4)  # a newcomer is expected empty at the version it Pulled
    assert p.validate(snapshot(instance(0, 1, [10]), instance(2, 4)))
