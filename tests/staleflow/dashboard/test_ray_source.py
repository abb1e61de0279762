"""The live source's polling over faked actors (``FakeRay``: no Ray is started)."""

from __future__ import annotations

import pytest

from staleflow.dashboard.ray_source import RayHandles, RaySource, actor_name
from staleflow.rollout.instance import InstanceTimes
from staleflow.runtime.controller.plane_records import LiveState
from tests.staleflow.dashboard.fakes import (
    FakeActor,
    FakeRay,
    FakeRayActorError,
    manager,
    record,
    snapshot,
    ts_stats,
)


class _Run:
    """What the actors report; tests move it along."""

    def __init__(self) -> None:
        self.version = 0
        self.tokens = 0
        self.elapsed = 1.0
        self.records = [record(1)]
        self.dead = False

    def live(self) -> LiveState:
        if self.dead:
            return FakeRayActorError("the actor died unexpectedly")
        return LiveState(
            buffers=manager().view(),
            instances=(snapshot(0, self.version), snapshot(1, 0)),
            ts=None,
            ps_version=self.version,
            steps=len(self.records),
            rewarded=10,
            elapsed_s=self.elapsed,
            cycles=7,
            last_discard="",
            pending={1: 2},
            commands={0: {"pull": 1, "route": 3}},
        )

    def times(self) -> InstanceTimes:
        return InstanceTimes(3.0, 1.0, 0.5, 2.5, 100, self.tokens, 0.1, 4)


def _source(run: _Run) -> RaySource:
    control = FakeActor(live=run.live, records=lambda since: run.records[since:])
    ts = FakeActor(stats=ts_stats)
    instances = {i: FakeActor(times=run.times) for i in (0, 1)}
    return RaySource(
        RayHandles(control, ts, None, instances), name="run-x", ray=FakeRay(), poll_s=0.01
    )


def test_polls_state_records_markers_and_rates():
    run = _Run()
    src = _source(run)
    assert src.poll_once()
    run.version, run.tokens, run.elapsed = 1, 400, 3.0
    run.records.append(record(2))
    assert src.poll_once()
    live = src.live()
    assert live.buffers is not None and live.ts is not None and live.steps == 2
    assert [d.version for d in live.instances] == [1, 0]
    assert live.instances[0].measured_tokens_per_s == 200.0
    assert live.instances[0].idle_ratio == pytest.approx(0.25)
    assert [d.pending_commands for d in live.instances] == [0, 2] and live.pending_commands == 2
    assert live.instances[0].commands_total == {"pull": 1, "route": 3}
    assert live.instances[1].commands_total == {}
    assert src.records(0, 10).total == 2
    kinds = [(e.kind, e.inst) for e in src.events(0, 10).items]
    assert ("pull", 0) in kinds and ("push", None) in kinds and ("step", None) in kinds
    ps = src.ps()
    assert ps.latest is None and ps.last_pull_s == {0: 3.0} and len(ps.notes) == 2
    info = src.info()
    assert info.kind == "live" and info.eta == 2 and info.instances == 2


def test_the_launcher_phase_is_shown_and_kept_across_polls():
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from staleflow.dashboard.app import create_app

    src = _source(_Run())
    client = TestClient(create_app(src))
    assert src.live().phase is None and client.get("/api/run").json()["phase"] is None
    src.set_phase("training 3 steps with eta=2")  # before the first poll
    assert src.poll_once()
    assert src.live().phase == "training 3 steps with eta=2"
    src.set_phase("saving the checkpoint")
    assert src.poll_once()
    assert client.get("/api/run").json()["phase"] == "saving the checkpoint"


def test_a_dead_control_actor_ends_polling_and_keeps_the_last_state():
    run = _Run()
    src = _source(run)
    assert src.poll_once()
    run.dead = True
    assert not src.poll_once()
    live = src.live()
    assert live.finished and live.steps == 1
    assert any("stopped answering" in n for n in live.notes)


def test_actor_names_match_the_launcher():
    from staleflow.runtime.driver.pools import PoolContext
    from staleflow.runtime.placement.ray_cluster import ACTOR_NAMESPACE

    ctx = PoolContext(None, "20250101-000000-eta3", None, None, "", False, print)  # type: ignore[arg-type]
    assert ctx.naming("control") == {
        "name": actor_name("20250101-000000-eta3", "control"),
        "namespace": ACTOR_NAMESPACE,
    }
