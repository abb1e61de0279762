"""The live source follows a run whose rollout instances come and go (docs/recovery.md):
membership from the control actor at each poll, a lost instance left out instead of
ending the polling, recoveries as events, and the elastic-rollout actions (``FakeRay``:
no Ray is started)."""

from __future__ import annotations

import pytest

from staleflow.dashboard.interface import ActionNotSupported
from staleflow.dashboard.ray_source import RayHandles, RaySource
from staleflow.recovery.events import RecoveryEvent
from staleflow.rollout.instance import InstanceTimes
from staleflow.runtime.controller.plane_records import LiveState
from tests.staleflow.dashboard.fakes import FakeActor, FakeRay, FakeRayActorError, manager, snapshot


class _Run:
    def __init__(self) -> None:
        self.members = {0: ("0.0", "i0"), 1: ("1.0", "i1")}
        self.events: list[RecoveryEvent] = []
        self.asked: list[int] = []
        self.dead: set[int] = set()

    def live(self) -> LiveState:
        snaps = tuple(snapshot(i, 2) for i in self.members)
        return LiveState(manager().view(), snaps, None, 2, 3, 10, 5.0)

    def handles(self) -> dict:
        return {i: (h, self.actor(i)) for i, (h, _) in self.members.items()}

    def actor(self, i: int) -> FakeActor:
        def times() -> InstanceTimes | Exception:
            if i in self.dead:
                return FakeRayActorError(f"instance {i} died")
            return InstanceTimes(1.0, 1.0, 0.1, 0.9, 10, 20, 0.0, 1)

        return FakeActor(times=times)

    def scale(self, n: int) -> str:
        self.asked.append(n)
        return f"asked for {n}"


def _source(run: _Run) -> RaySource:
    control = FakeActor(
        live=run.live,
        records=lambda since: [],
        members=run.handles,
        events=lambda since: run.events[since:],
        request_scale=run.scale,
    )
    return RaySource(RayHandles(control, None, None, {}), name="r", ray=FakeRay(), poll_s=0.01)


def test_instances_that_come_and_go_and_recoveries_as_events():
    run = _Run()
    src = _source(run)
    assert src.poll_once()
    assert [d.inst for d in src.live().instances] == [0, 1] and src.info().instances == 2
    run.dead.add(1)  # lost: its counters do not come, the polling goes on
    run.events.append(RecoveryEvent(6.0, "instance_lost", "instance/1", "its actor died", 3))
    assert src.poll_once()
    assert not src.live().finished
    run.dead.clear()
    run.members[2] = ("2.0", "i2")  # added (elastic rollout)
    run.events.append(RecoveryEvent(7.0, "instance_added", "instance/2", "version 2", 3))
    assert src.poll_once()
    assert [d.inst for d in src.live().instances] == [0, 1, 2]
    recoveries = [e for e in src.events(0, 100).items if e.kind == "recovery"]
    assert [(e.time, e.version, e.inst) for e in recoveries] == [(6.0, 3, 1), (7.0, 3, 2)]
    assert recoveries[0].detail == "instance lost instance/1: its actor died"
    assert src.poll_once()  # an event is shown once
    assert len([e for e in src.events(0, 100).items if e.kind == "recovery"]) == 2


def test_add_and_remove_instance_ask_the_run_for_one_more_or_less():
    run = _Run()
    src = _source(run)
    assert src.poll_once()
    assert src.info().actions == ("add_instance", "remove_instance")
    assert src.act("add_instance") == "asked for 3"
    assert src.act("remove_instance") == "asked for 1"
    assert run.asked == [3, 1]
    run.members = {0: ("0.0", "i0")}
    with pytest.raises(ActionNotSupported, match="at least one"):
        src.act("remove_instance")
    with pytest.raises(ActionNotSupported, match="not 'poke'"):
        src.act("poke")
