"""The runtime wired in one process with threads: real TS, staleness manager, coordinator,
executor, instance wrappers, reward stage and training loop; fake engine, trainer, PS
and reward function (``fakes.py``). No Ray."""

from __future__ import annotations

import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from coordinator import CoordinatorConfig
from staleflow.runtime.control import ControlConfig, ControlPlane
from staleflow.runtime.instance_host import InstanceHost
from staleflow.runtime.reward_stage import RewardStage
from staleflow.runtime.serialized import Serialized
from staleflow.runtime.training import TrainingLoop
from staleness import StalenessConfig
from tests.staleflow.runtime.fakes import (
    CountingTrainer,
    MemoryPS,
    ScriptedEngine,
    SyncPusher,
    parity_scorer,
)
from trajectory_server import TrajectoryServer, TrajectoryServerConfig


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


def wire(eta: int, *, instances: int = 2, batch: int = 2, group: int = 2) -> Wired:
    ts = Serialized(TrajectoryServer(TrajectoryServerConfig(eta, batch, group), _Prompts()))
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

    engines = {i: ScriptedEngine(target=3 + i, max_running=3) for i in range(instances)}
    hosts = {
        i: InstanceHost(i, engines[i], ts=ts, weights=ps, max_response=16, on_finished=on_finished)
        for i in range(instances)
    }
    pool = ThreadPoolExecutor(4)
    control = ControlPlane(
        ControlConfig(
            StalenessConfig(eta=eta, batch_size=batch, group_size=group),
            CoordinatorConfig(period_s=0.005),
            idle_wait_s=0.002,
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
    # conservation: every live trajectory the TS holds as routed is on an instance or was
    # handed to the reward path; nothing the TS forgot is still on an instance
    stats = w.ts.stats()
    assert stats.created_trajectories == (
        stats.consumed_trajectories
        + stats.aborted_trajectories
        + stats.queued
        + stats.routed
        + stats.completed
    )
    held = set().union(*(h.held() for h in w.hosts.values()))
    for tid in held:
        assert w.ts.state_of(tid).value == "routed"
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


def test_a_dead_instance_stops_the_run_with_its_error():
    w = wire(1)

    def broken_step():
        raise RuntimeError("engine exploded")

    w.engines[0].step = broken_step  # type: ignore[method-assign]
    with pytest.raises(Exception, match="engine exploded"):
        run(w, steps=3)


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
