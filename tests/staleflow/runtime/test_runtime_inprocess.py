"""The runtime wired in one process with threads: real TS, staleness manager, coordinator,
executor, instance wrappers, reward stage and training loop; fake engine, trainer, PS
and reward function (``fakes.py``). No Ray."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from coordinator import CoordinatorConfig, SeerConfig
from coordinator.cost_model import SpeculationProfile
from staleflow.rollout.instance import Finished
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.in_process import Serialized
from staleflow.runtime.workers.instance_host import InstanceHost
from staleflow.runtime.workers.reward_stage import RewardStage
from staleflow.runtime.workers.training_loop import TrainingLoop
from staleness import StalenessConfig
from tests.staleflow.runtime.fakes import (
    CountingTrainer,
    MemoryPS,
    ScriptedEngine,
    SyncPusher,
    parity_scorer,
)
from trajectory_server import TrajectoryServer, TrajectoryServerConfig
from trajectory_server.errors import TrajectoryGone
from trajectory_server.types import RewardTask


@dataclass(frozen=True)
class _Sample:
    sample_id: int
    prompt_ids: np.ndarray
    answer: str


class _Prompts:
    def __init__(self) -> None:
        self.n = 0

    def next_sample(self) -> _Sample:
        self.n += 1
        return _Sample(self.n, np.arange(3, dtype=np.int32) + 3, "x")


@dataclass
class Wired:
    control: ControlPlane
    ts: Serialized
    hosts: dict[int, InstanceHost]
    engines: dict[int, ScriptedEngine]
    loop: TrainingLoop
    trainer: CountingTrainer
    ps: MemoryPS


def wire(
    eta: int,
    *,
    instances: int = 2,
    batch: int = 2,
    group: int = 2,
    batch_redundancy: float = 0.0,
    group_redundancy: float = 0.0,
    hold: Callable[[int], bool] | None = None,
    max_running: int = 3,
    chunk_tokens: int | None = None,
    speculation: SpeculationProfile | None = None,
) -> Wired:
    ts = Serialized(
        TrajectoryServer(
            TrajectoryServerConfig(
                eta,
                batch,
                group,
                group_redundancy=group_redundancy,
                batch_redundancy=batch_redundancy,
            ),
            _Prompts(),
        )
    )
    ps = MemoryPS()
    control_box: list[ControlPlane] = []
    stage = RewardStage(
        parity_scorer,
        lambda tokens: "a" * len(tokens),
        ts,
        lambda records: control_box[0].rewarded(records),
    )
    lock = threading.Lock()

    def on_finished(finished):  # reward "workers": one at a time, like a pool of one
        with lock:
            stage.process(finished)

    engines = {
        i: ScriptedEngine(target=3 + i, max_running=max_running, hold=hold)
        for i in range(instances)
    }
    hosts = {
        i: InstanceHost(
            i,
            engines[i],
            ts=ts,
            weights=ps,
            max_response=16,
            on_finished=on_finished,
            chunk_tokens=chunk_tokens,
        )
        for i in range(instances)
    }
    pool = ThreadPoolExecutor(4)
    control = ControlPlane(
        ControlConfig(
            StalenessConfig(
                eta=eta,
                batch_size=batch,
                group_size=group,
                batch_redundancy=batch_redundancy,
                group_redundancy=group_redundancy,
            ),
            CoordinatorConfig(
                period_s=0.005,
                seer=SeerConfig(enabled=chunk_tokens is not None, chunk_tokens=chunk_tokens or 1),
            ),
            idle_wait_s=0.002,
            speculation=speculation,
        ),
        ts=ts,
        instances=hosts,
        ps_version=ps.latest,
        run_round=lambda actions: list(pool.map(lambda a: a(), actions)),
    )
    control_box.append(control)
    trainer = CountingTrainer()
    loop = TrainingLoop(
        trainer, control=control, ts=ts, pusher=SyncPusher(ps), consume_timeout_s=30
    )
    return Wired(control, ts, hosts, engines, loop, trainer, ps)


def _assert_conserved(w: Wired) -> None:
    """Every trajectory the TS created is in exactly one place: consumed, aborted, queued,
    routed (on an instance or in the reward path) or completed; nothing the TS forgot is
    still on an instance."""
    stats = w.ts.stats()
    assert stats.created_trajectories == (
        stats.consumed_trajectories
        + stats.aborted_trajectories
        + stats.queued
        + stats.routed
        + stats.completed
    )
    for h in w.hosts.values():
        for tid in h.held():
            assert w.ts.state_of(tid).value == "routed", tid


def run(w: Wired, steps: int) -> list:
    for h in w.hosts.values():
        h.start()
    w.control.start()
    try:
        return w.loop.run(steps)
    finally:
        w.control.stop()
        for h in w.hosts.values():
            h.stop()


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_every_consumed_trajectory_is_within_eta_and_nothing_is_lost(eta):
    w = wire(eta)
    reports = run(w, steps=6)
    w.control.check()
    assert [r.version for r in reports] == list(range(6))
    seen: Counter[int] = Counter()
    for r, batch in zip(reports, w.trainer.batches, strict=True):
        assert len(batch.groups) == 2 and all(len(g.trajectories) == 2 for g in batch.groups)
        for g in batch.groups:
            for t in g.trajectories:
                seen[t.traj_id] += 1
                assert r.version - t.v_traj <= eta
                assert (t.versions >= t.v_traj).all()
                if eta == 0:  # exactly on-policy: every token from the version trained
                    assert (t.versions == r.version).all()
        assert max(r.staleness) <= eta
    assert max(seen.values()) == 1  # nothing consumed twice
    _assert_conserved(w)
    # instances saw the PS advance: the last buffer (version 5) admits only trajectories
    # of version >= 5 - eta, so some instance loaded at least that (more is timing: the
    # throughput sync Pulls only when routing needs it)
    assert max(max(e.loads) for e in w.engines.values()) >= 5 - eta
    records = w.control.records()
    assert len(records) == 6
    assert all(rec.staleness_max is not None and rec.staleness_max <= eta for rec in records)


def test_consume_for_the_wrong_version_is_refused_with_a_clear_error():
    w = wire(1)
    w.control.start()
    try:
        with pytest.raises(ValueError, match="disagree on the version"):
            w.control.consume(3, timeout_s=10)
    finally:
        w.control.stop()


def test_a_wedged_rollout_stops_the_trainer_with_the_fix_instead_of_a_hang():
    w = wire(1)
    w.control.start()  # no instance host runs: buffer 0 never becomes Ready
    try:
        with pytest.raises(TimeoutError, match=r"buffer 0 was not Ready.*stall_timeout_s"):
            w.control.consume(0, timeout_s=0.3)
    finally:
        w.control.stop()


def test_the_push_of_version_v_overlaps_the_training_of_the_next_step():
    """The loop waits for the Push of ``v + 1`` only after training step ``v + 1``: the
    copy to the PS runs while the next step trains, one Push in flight at a time."""
    events: list[str] = []

    class Handle:
        def __init__(self, version: int) -> None:
            self.version = version

        def wait(self, timeout: float | None = None) -> int:
            events.append(f"wait {self.version}")
            return self.version

    class RecordingPusher:
        def __init__(self, ps: MemoryPS) -> None:
            self.ps = ps

        def push_async(self, version, weights):
            events.append(f"push {version}")
            self.ps.push(weights, version)  # instances must see the new versions
            return Handle(version)

    class RecordingTrainer(CountingTrainer):
        def train_step(self, batch):
            events.append(f"train {self.version}")
            return super().train_step(batch)

    w = wire(1)
    w.loop = TrainingLoop(
        RecordingTrainer(),
        control=w.control,
        ts=w.ts,
        pusher=RecordingPusher(w.ps),
        consume_timeout_s=30,
    )
    run(w, steps=3)
    assert events == [
        "train 0",
        "push 1",
        "train 1",
        "wait 1",
        "push 2",
        "train 2",
        "wait 2",
        "push 3",
        "wait 3",  # finish(): the PS holds the final version before the run ends
    ]


# -- redundant rollout (§4.3, App. C) ------------------------------------------------------


def _flush_aborts(w: Wired, deadline_s: float = 30.0) -> None:
    """With rollout stopped, drive the control loop until a cycle validated its snapshot:
    the Aborts of everything dropped so far have then been carried out."""
    stats = w.control.coordinator.stats
    valid = stats.cycles - stats.discarded
    give_up = time.monotonic() + deadline_s
    while stats.cycles - stats.discarded <= valid:
        assert time.monotonic() < give_up, "no valid snapshot: the instances keep changing"
        w.control.run_once()


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_redundancy_keeps_the_bound_aborts_the_surplus_and_loses_nothing(eta):
    """Group redundancy: 3 members per group of 2, and the third member of every group is
    the long tail: held until redundancy drops it (then it finishes at the engine's next
    step, and its reward arrives late). Only aborting it as surplus lets its group
    through. Batch redundancy: 3 entries per buffer of 2, and every fourth group is held
    entirely: only dropping it lets the buffers fill. Members of group ``g`` are
    trajectories 3g..3g+2."""

    def tail(traj_id: int) -> bool:
        return traj_id % 3 == 2 or traj_id // 3 % 4 == 3

    w = wire(eta, batch_redundancy=0.5, group_redundancy=0.5, max_running=8)

    def held(traj_id: int) -> bool:
        if not tail(traj_id):
            return False
        try:
            w.ts.state_of(traj_id)
        except TrajectoryGone:
            return False  # dropped: finish now (unless the Abort gets here first)
        return True

    for engine in w.engines.values():
        engine.hold = held
    reports = run(w, steps=6)
    w.control.check()
    assert [r.version for r in reports] == list(range(6))
    consumed: Counter[int] = Counter()
    for r, batch in zip(reports, w.trainer.batches, strict=True):
        assert len(batch.groups) == 2 and all(len(g.trajectories) == 2 for g in batch.groups)
        assert max(r.staleness) <= eta
        for g in batch.groups:
            for t in g.trajectories:
                consumed[t.traj_id] += 1
                assert r.version - t.v_traj <= eta
                assert not tail(t.traj_id)
    assert max(consumed.values()) == 1  # nothing consumed twice
    # the surplus was aborted: one member of every consumed group, and the held groups
    stats = w.ts.stats()
    assert stats.aborted_trajectories >= 6 * 2
    assert w.control.manager.aborted_groups >= 1
    aborts = sum(kinds.get("abort", 0) for kinds in w.control.executor.issued.values())
    assert aborts > 0, "no surplus was ever aborted on an instance"
    # nothing lost: every trajectory is in exactly one place, and once the last drops
    # reached the instances, nothing the TS forgot is still on one
    _flush_aborts(w)
    _assert_conserved(w)
    assert w.ts.stats().consumed_trajectories == sum(consumed.values())


def _routed_host(w: Wired, ids: list[int]) -> InstanceHost:
    """Instance 0 with trajectories ``ids`` routed onto it (its thread not started)."""
    host = w.hosts[0]
    host.pull(0)
    assert host.route(ids, dict.fromkeys(ids, 0)) == tuple(ids)
    return host


def test_an_interrupt_of_a_trajectory_redundancy_dropped_is_not_fatal():
    """Redundancy aborted trajectory 1 in the TS while it still ran on its instance; a
    Pull's Interrupt then stops it there: its partial is dropped, the others go back."""
    w = wire(1, group_redundancy=0.5)
    host = _routed_host(w, [0, 1, 2])
    w.ts.abort([1])
    assert set(host.interrupt([0, 1, 2])) == {0, 1, 2}  # all three left the instance
    assert host.held() == set()
    assert [t.traj_id for t in w.ts.routing_view()][:2] == [0, 2]
    with pytest.raises(TrajectoryGone):
        w.ts.state_of(1)


def test_a_late_reward_of_a_trajectory_redundancy_dropped_is_not_fatal():
    """Trajectory 1 finished while redundancy aborted it: the reward stage stores and
    reports the others and drops it (it used to raise TrajectoryGone and stop the run)."""
    w = wire(1, group_redundancy=0.5)
    _routed_host(w, [0, 1, 2])
    reported: list[int] = []
    stage = RewardStage(
        parity_scorer,
        lambda tokens: "a" * len(tokens),
        w.ts,
        lambda records: reported.extend(r.traj_id for r in records),
    )
    w.ts.abort([1])
    tokens = np.array([7, 2], np.int32)
    finished = [
        Finished(RewardTask(t, 0, 0, 1, "x", np.arange(3, dtype=np.int32), tokens,
                            np.zeros(2, np.float32), np.zeros(2, np.int32), "stop"), 0)
        for t in (0, 1, 2)
    ]  # fmt: skip
    stage.process(finished)
    assert reported == [0, 2]
    assert stage.late == 1
    assert w.ts.group_status(0).completed == 2
