"""The simulator and the real control plane run one control loop.

The same simulated cluster (same seed, so the same scripted sequence of completions,
rewards, training steps and Pushes) is driven twice: once by ``SimCluster`` itself
(``SimPlanes``, its own event loop) and once by the runtime's ``ControlPlane``
(``RuntimePlanes`` over instance handles, the inbox, Consume requests as the trainer
posts them, ``run_once`` on the same virtual clock). Both must take the same decisions:
the same commands at every cycle, the same Occupies and their outcomes, the same
Consumes, the same drops, and end in the same state.

Faked here, at the runtime's boundary only: :class:`SimHandle` plays a rollout actor
(``staleflow.runtime.interface.InstanceHandle``) over a simulated instance, fetching
routed trajectories from the TS and returning interrupted ones to it as the real one does.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import replace

import pytest

from staleflow.control import Consumed, Decision, Dropped, Issued, Occupied
from staleflow.control.late import return_live
from staleflow.rollout.instance import InstanceTimes
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.controller.plane_records import ControlConfig
from staleflow.runtime.interface import Rewarded
from staleflow.sim import SimCluster, system, tiny
from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.engine import SimInstance, SimTrajectory
from staleness import ConsumedBatch
from trajectory_server.types import AbortedTrajectory


class SimHandle:
    """A rollout actor over a simulated instance (see the module docstring)."""

    def __init__(self, cluster: SimCluster, inst: SimInstance) -> None:
        self._cluster, self._inst = cluster, inst

    def snapshot(self):
        return self._inst.snapshot()

    def route(self, traj_ids, v_traj):
        c = self._cluster
        routed = c.ts.route(list(traj_ids), dict(v_traj), self._inst.inst_id, skip_unavailable=True)
        target = c.workload.response_length
        sims = [
            SimTrajectory(r, len(r.prompt) + target(r.sample_id, r.traj_id), self._inst)
            for r in routed
        ]
        self._inst.submit(sims, c.now)
        return tuple(r.traj_id for r in routed)

    def interrupt(self, traj_ids):
        partials = self._inst.remove(list(traj_ids), self._cluster.now)
        return_live(self._cluster.ts, list(partials.values()))
        return tuple(partials)

    def abort(self, traj_ids):
        return tuple(self._inst.abort(list(traj_ids), self._cluster.now))

    def pull(self, at_least):
        version = self._cluster.trainer.ps_version
        assert version >= at_least
        self._inst.pull(version, self._cluster.now)
        return version

    def times(self):
        return InstanceTimes(0.0, 0.0, 0.0, 0.0, 0, 0, 0.0, 0)


class RuntimeTwin(SimCluster):
    """The same simulated world with the runtime's control plane in place of the
    simulator's own driving of the loop: rewards are posted to its inbox, the idle
    trainer posts a Consume request and trains when it is served, the TS's drops at
    ``take_batch`` are posted back; ``run_once`` runs at every event and every period."""

    def __init__(self, config: ClusterConfig, decisions: list[Decision]) -> None:
        super().__init__(config)
        self.plane = ControlPlane(
            ControlConfig(  # the same settings
                self.loop.manager.config,
                config.coordinator.for_responses(config.workload.max_response),
            ),
            ts=self.ts,
            instances={i: SimHandle(self, inst) for i, inst in self.instances.items()},
            ps_version=lambda: self.trainer.ps_version,
            clock=lambda: self.now,
            on_decision=decisions.append,
        )
        self.manager = self.plane.manager
        self.coordinator = self.plane.coordinator
        self.executor = self.plane.executor
        self._at = 0.0
        self._request: Future[ConsumedBatch] | None = None

    def _cycle(self) -> None:
        self._serve(self.now)

    def _maybe_train(self, t: float) -> None:
        self._serve(t)

    def _occupy(self, traj: SimTrajectory) -> None:
        self.plane.rewarded(
            [Rewarded(traj.traj_id, traj.group_id, traj.v_traj, 1.0, "", 0, "stop", 0)]
        )

    def _forget(self, dropped: tuple[AbortedTrajectory, ...]) -> None:
        self.plane.dropped(dropped)

    def _serve(self, t: float) -> None:
        self._at = t
        if not self.trainer.busy and (self._request is None or self._request.done()):
            self._request = self.plane.request_consume(len(self.batches))
            self._request.add_done_callback(self._consumed)
        self.plane.run_once()
        # the trainer posted take_batch's drops as it started a step: apply them before
        # the next event, as the simulator does
        self.plane.run_once()
        self.plane.check()

    def _consumed(self, future: Future[ConsumedBatch]) -> None:
        self._train(self._at, future.result())


def _pair(config: ClusterConfig) -> tuple[SimCluster, list[Decision], RuntimeTwin, list[Decision]]:
    sim_decisions: list[Decision] = []
    sim = SimCluster(config)
    sim.loop.on_decision = sim_decisions.append
    twin_decisions: list[Decision] = []
    twin = RuntimeTwin(config, twin_decisions)
    return sim, sim_decisions, twin, twin_decisions


def _kinds(decisions: list[Decision]) -> dict[type, int]:
    out: dict[type, int] = {}
    for d in decisions:
        out[type(d)] = out.get(type(d), 0) + 1
    return out


CASES = {
    "staleflow-eta0": tiny(eta=0, steps=4, seed=1),
    "staleflow-eta2": tiny(eta=2, steps=5, seed=0),
    "vanilla-eta1": system("vanilla", tiny(eta=1, steps=4, seed=2)),
    "late-rewards": tiny(eta=1, steps=4, seed=3).with_(reward_latency_s=1.3),
    "redundancy": tiny(eta=2, steps=5, seed=4).with_(batch_redundancy=0.5, group_redundancy=0.5),
    "redundancy-eta0": tiny(eta=0, steps=4, seed=5).with_(
        batch_redundancy=0.25, group_redundancy=0.25, reward_latency_s=0.7
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_runtime_plane_and_the_simulator_take_the_same_decisions(name: str) -> None:
    config = CASES[name]
    sim, sim_decisions, twin, twin_decisions = _pair(config)
    sim_summary = sim.run()
    twin_summary = twin.run()
    assert sim_summary.steps == config.steps and not sim_summary.stalled
    kinds = _kinds(sim_decisions)
    assert kinds[Issued] > 10 and kinds[Occupied] >= config.steps * config.batch_size
    # one Consume per trained step, plus possibly the next batch, consumed the moment
    # the last step ends when it is already Ready (the run stops right after)
    assert kinds[Consumed] == len(sim.batches) and config.steps <= len(sim.batches)
    assert len(sim.batches) <= config.steps + 1
    assert any(d.commands for d in sim_decisions if isinstance(d, Issued))
    # the same decisions, in the same order, at the same (virtual) times
    for k, (a, b) in enumerate(zip(sim_decisions, twin_decisions, strict=False)):
        assert a == b, f"decision {k} differs: simulator {a} / runtime {b}"
    assert len(sim_decisions) == len(twin_decisions)
    # and the same outcome
    assert sim.batches == twin.batches
    assert sim.ts.stats() == twin.ts.stats()
    assert sim.check() == [] and twin.check() == []
    ignore = {"commands"}  # the simulator's planes count commands, the runtime's time them
    a = {k: v for k, v in sim_summary.as_dict().items() if k not in ignore}
    b = {k: v for k, v in twin_summary.as_dict().items() if k not in ignore}
    assert a == b


def test_redundancy_cases_really_drop_surplus() -> None:
    """The redundancy cases above compare something: both redundancies drop work."""
    sim, decisions, _, _ = _pair(CASES["redundancy"])
    sim.run()
    drops = [d for d in decisions if isinstance(d, Dropped)]
    assert any(d.trajs for d in drops) and any(d.groups for d in drops)
    aborts = [c for d in decisions if isinstance(d, Issued) for c in d.commands]
    assert any(type(c).__name__ == "Abort" for c in aborts)


def test_a_difference_in_driving_is_caught() -> None:
    """The comparison can fail: a plane that reads its inbox only once per coordinator
    period (Occupies late, so Consumes late) takes different decisions."""

    class OncePerPeriod(RuntimeTwin):
        def _maybe_train(self, t: float) -> None:
            self._at = t  # rewards and Consume requests wait for the next cycle

    config = replace(CASES["staleflow-eta2"], steps=3)
    sim, sim_decisions, _, _ = _pair(config)
    sim.run()
    late_decisions: list[Decision] = []
    OncePerPeriod(config, late_decisions).run()
    assert [type(d) for d in late_decisions] != [type(d) for d in sim_decisions]
