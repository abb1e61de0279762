"""The discrete-event cluster: the real staleness manager, trajectory server and
coordinator drive simulated rollout instances and a simulated trainer on a virtual clock.

One period of the loop reads like §5.2 and Figure 9:

1. the coordinator's snapshot-command cycle runs (``Coordinator.step``) and the
   in-process executor carries its commands out at once (their costs land on the
   instances' clocks: prefill, Pull);
2. every instance decodes in whole steps up to the end of the period;
3. completions, rewards, training steps and Pushes are processed in time order from a
   heap: a rewarded trajectory is completed in the TS and the staleness manager (Occupy),
   the trainer Consumes a Ready buffer, and the PS version advances when its Push lands.

The run is deterministic for a seed: every random draw comes from seeded generators, and
every iteration order is fixed (instances by id, events by time then sequence number).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from coordinator import Coordinator, CoordinatorConfig, InProcessExecutor, Snapshot
from staleflow.sim.engine import EngineCosts, SimInstance, SimTrajectory
from staleflow.sim.planes import SimPlanes
from staleflow.sim.summary import Summary, summarise
from staleflow.sim.trainer import SimTrainer, TrainerCosts
from staleflow.sim.truth import instance_truths
from staleflow.sim.workload import SyntheticWorkload, TraceWorkload, WorkloadConfig
from staleness import ConsumedBatch, Outcome, StalenessConfig, StalenessManager
from trajectory_server import TrajectoryServer, TrajectoryServerConfig, TrajState
from trajectory_server.errors import TrajectoryServerError
from trajectory_server.types import RoutableTrajectory

logger = logging.getLogger(__name__)

REWARD, TRAIN_DONE, PUSH_DONE = "reward", "train_done", "push_done"


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """A simulated cluster. The cost model (k1..k5, M) is the coordinator's own, so the
    engines and the strategies agree on it; ``engine`` adds what the model leaves out."""

    instances: int = 4
    eta: int = 1
    batch_size: int = 4
    group_size: int = 4
    steps: int = 3
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    engine: EngineCosts = field(default_factory=EngineCosts)
    trainer: TrainerCosts = field(default_factory=TrainerCosts)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    reward_latency_s: float = 0.0
    max_time_s: float = 1.0e6
    # Stop when no training step ends for this long (virtual seconds): a livelock (e.g.
    # trajectories migrated every cycle and never decoding) must not hang a sweep.
    stall_timeout_s: float = 7200.0
    seed: int = 0
    name: str = "staleflow"

    def __post_init__(self) -> None:
        if self.instances < 1 or self.steps < 1:
            raise ValueError(f"need instances >= 1 and steps >= 1, got {self}")
        if self.reward_latency_s < 0:
            raise ValueError(f"reward_latency_s={self.reward_latency_s} must be >= 0")

    def with_(self, **changes: Any) -> ClusterConfig:
        return replace(self, **changes)


class SimCluster:
    """Build with a :class:`ClusterConfig` (and optionally a trace workload), then
    :meth:`run` it; :meth:`check` verifies conservation at any point."""

    def __init__(self, config: ClusterConfig, workload: TraceWorkload | None = None) -> None:
        self.config = config
        members = config.group_size
        self.workload = workload or SyntheticWorkload(config.workload, members, config.seed)
        self.manager = StalenessManager(
            StalenessConfig(eta=config.eta, batch_size=config.batch_size, group_size=members)
        )
        self.ts = TrajectoryServer(
            TrajectoryServerConfig(
                eta=config.eta, batch_size=config.batch_size, group_size=members
            ),
            self.workload,
        )
        cost = config.coordinator.cost_model.build()
        # What each engine really does (speed, estimate error, ...; sim/truth.py).
        truths = instance_truths(cost, config.engine.truth, config.instances, config.seed)
        self.instances = {
            i: SimInstance(
                i, cost, config.engine, np.random.default_rng([config.seed, i]), truths[i]
            )
            for i in range(config.instances)
        }
        self.trainer = SimTrainer(config.trainer)
        self.now = 0.0
        self.planes = SimPlanes(
            self.instances,
            self.ts,
            self.workload.response_length,
            lambda: self.trainer.ps_version,
            lambda: self.now,
        )
        self.executor = InProcessExecutor(self.planes, self.planes, self.planes, self.manager)
        self.coordinator = Coordinator(
            config.coordinator,
            snapshots=self,
            trajectories=self,
            parameters=self,
            admission=self.manager,
            executor=self.executor,
            instances=dict.fromkeys(self.instances, 0),
            clock=lambda: self.now,
        )
        self._events: list[tuple[float, int, str, Any]] = []
        self.stalled = False
        # Called once per cycle, after the commands were applied (state at ``now``): lets
        # an optional recorder (``timeline.Timeline``) sample instances without a copy of
        # this loop.
        self.observers: list[Callable[[SimCluster], None]] = []
        self._seq = 0
        self.rewarding: dict[int, SimTrajectory] = {}  # finished, reward pending
        self.batches: list[ConsumedBatch] = []
        self.consumed: set[int] = set()
        self.duplicates: list[int] = []
        self.response_lengths: list[int] = []  # of consumed trajectories
        # (sample id, prompt length, response lengths) of every consumed group
        self.trained: list[tuple[int, int, tuple[int, ...]]] = []

    # -- sources the coordinator reads ------------------------------------------------

    def snapshot(self) -> Snapshot:
        return Snapshot(tuple(i.snapshot() for i in self.instances.values()), self.now)

    def routable(self) -> list[RoutableTrajectory]:
        return list(self.ts.routing_view())

    def latest_version(self) -> int:
        return self.trainer.ps_version

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> Summary:
        c = self.config
        period = c.coordinator.period_s
        while self.trainer.steps < c.steps and self.now < c.max_time_s:
            last = self.trainer.step_ends[-1] if self.trainer.step_ends else 0.0
            if self.now - last > c.stall_timeout_s:
                self.stalled = True
                logger.warning(
                    "no training step for %.0f s of virtual time at t=%.0f (step %d): stopping",
                    c.stall_timeout_s,
                    self.now,
                    self.trainer.steps,
                )
                break
            self.coordinator.step(self.now)
            self.executor.run_until_idle()
            for observe in self.observers:
                observe(self)
            horizon = self.now + period
            for inst in self.instances.values():
                inst.advance(horizon, self._finished)
            self._drain(horizon)
            self.now = horizon
        if self.trainer.steps < c.steps and not self.stalled:
            logger.warning(
                "stopped at max_time_s=%s after %d steps", c.max_time_s, self.trainer.steps
            )
        return summarise(self)

    def _push(self, t: float, kind: str, data: Any) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, data))
        self._seq += 1

    def _finished(self, t: float, inst: SimInstance, traj: SimTrajectory) -> None:
        self.rewarding[traj.traj_id] = traj
        self._push(t + self.config.reward_latency_s, REWARD, (traj, inst.version))

    def _drain(self, horizon: float) -> None:
        while self._events and self._events[0][0] <= horizon:
            t, _, kind, data = heapq.heappop(self._events)
            if kind == REWARD:
                self._reward(*data)
            elif kind == TRAIN_DONE:
                self._push(self.trainer.finish_step(t), PUSH_DONE, None)
            else:
                self.trainer.push_landed()
            self._maybe_train(t)

    def _reward(self, traj: SimTrajectory, version: int) -> None:
        self.rewarding.pop(traj.traj_id)
        self.workload.forget(traj.traj_id)
        if _state(self.ts, traj.traj_id) is not TrajState.ROUTED:
            return  # aborted meanwhile
        tokens, logprobs, versions = traj.response(version)
        capped = traj.target - traj.prompt_len >= self.config.workload.max_response
        self.ts.complete(
            traj.traj_id, tokens, logprobs, versions, 1.0, "length" if capped else "stop"
        )
        self._handle(self.manager.complete(traj.group_id, traj.traj_id))

    def _handle(self, outcome: Outcome) -> None:
        """Redundancy surplus reported by the manager: drop it in the TS and on instances."""
        if not (outcome.abort_trajectories or outcome.abort_groups):
            return
        self.ts.abort(t for t in outcome.abort_trajectories if _state(self.ts, t) is not None)
        for g in outcome.abort_groups:
            if _has_group(self.ts, g):
                self.ts.abort_group(g)
        self.coordinator.request_abort(outcome.abort_trajectories, outcome.abort_groups)

    def _maybe_train(self, t: float) -> None:
        if self.trainer.busy or not self.manager.is_ready():
            return
        batch = self.manager.consume()
        self.batches.append(batch)
        ids = [g.group_id for g in batch.groups]
        taken = self.ts.take_batch(ids)
        tokens = squares = 0
        for group in taken.groups:
            lengths = tuple(len(tr.tokens) for tr in group.trajectories)
            self.trained.append((group.sample_id, len(group.prompt), lengths))
            for tr in group.trajectories:
                if tr.traj_id in self.consumed:
                    self.duplicates.append(tr.traj_id)
                self.consumed.add(tr.traj_id)
                tokens += len(group.prompt) + len(tr.tokens)
                squares += (len(group.prompt) + len(tr.tokens)) ** 2  # attention's cost
                self.response_lengths.append(len(tr.tokens))
        for gid in batch.aborted_groups:
            if _has_group(self.ts, gid):
                self.ts.abort_group(gid)
        if batch.aborted_groups:
            self.coordinator.request_abort(groups=batch.aborted_groups)
        self._push(self.trainer.start_step(t, tokens, squares), TRAIN_DONE, None)

    # -- invariants -------------------------------------------------------------------

    def check(self) -> list[str]:
        """Conservation problems (empty when healthy): every trajectory the TS created is
        in exactly one place, and nothing was consumed twice."""
        problems = [f"trajectory {t} consumed twice" for t in self.duplicates]
        seen: dict[int, str] = {}
        for i, inst in self.instances.items():
            for tid in inst.holds():
                if tid in seen:
                    problems.append(f"trajectory {tid} on {seen[tid]} and instance {i}")
                seen[tid] = f"instance {i}"
        for tid in self.rewarding:
            if tid in seen:
                problems.append(f"trajectory {tid} rewarding and on {seen[tid]}")
            seen[tid] = "reward"
        for tid in seen:
            if _state(self.ts, tid) is not TrajState.ROUTED:
                problems.append(f"trajectory {tid} is on {seen[tid]} but not ROUTED in the TS")
        s = self.ts.stats()
        if s.routed != len(seen):
            problems.append(f"TS has {s.routed} ROUTED but instances + reward hold {len(seen)}")
        total = s.queued + s.routed + s.completed + s.consumed_trajectories
        if total + s.aborted_trajectories != s.created_trajectories:
            problems.append(f"TS counts do not add up: {s}")
        if s.consumed_trajectories != len(self.consumed):
            problems.append(
                f"TS consumed {s.consumed_trajectories} but the trainer got {len(self.consumed)}"
            )
        if self.planes.claimed:
            problems.append(f"claims left after the executor went idle: {self.planes.claimed}")
        return problems


def _state(ts: TrajectoryServer, traj_id: int) -> TrajState | None:
    try:
        return ts.state_of(traj_id)
    except TrajectoryServerError:
        return None  # consumed or aborted


def _has_group(ts: TrajectoryServer, group_id: int) -> bool:
    try:
        ts.group_status(group_id)
    except TrajectoryServerError:
        return False
    return True
