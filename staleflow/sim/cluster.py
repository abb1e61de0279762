"""The discrete-event cluster: the real staleness manager, trajectory server and
coordinator drive simulated rollout instances and a simulated trainer on a virtual clock.

The decisions are taken by the control loop the real control plane runs
(``staleflow.control.loop``); this module only supplies its planes (``planes.py``) and
its clock, and plays the rest of the system. One period reads like §5.2 and Figure 9,
in the order the real control plane's ``run_once`` follows:

1. the loop's snapshot-command cycle runs, and its in-process executor carries the
   commands out at once (their costs land on the instances' clocks: prefill, Pull);
2. every instance decodes in whole steps up to the end of the period;
3. completions, rewards, training steps and Pushes are processed in time order from a
   heap: a rewarded trajectory is stored in the TS as completed and Occupied by the
   loop (redundancy's surplus dropped), the idle trainer Consumes a Ready buffer, and the
   PS version advances when its Push lands. With ``stream_training`` the idle trainer
   whose buffer is not Ready yet works on the groups already occupied in it instead
   (RolloutPipe's complete-group pipelining; ``trainer.py`` has the costs).

The run is deterministic for a seed: every random draw comes from seeded generators, and
every iteration order is fixed (instances by id, events by time then sequence number).
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from coordinator import CoordinatorConfig, Snapshot
from coordinator.cycle import Decision
from staleflow.control import ControlLoop
from staleflow.control.dynamic_sampling import DynamicSampling, SamplingConfig
from staleflow.control.late import complete_live, return_live
from staleflow.sim.agentic import AgenticConfig, AgenticWorkload
from staleflow.sim.engine import EngineCosts, SimInstance, SimTrajectory
from staleflow.sim.env import SimEnvironments
from staleflow.sim.planes import SimPlanes
from staleflow.sim.race import SimRaces
from staleflow.sim.summary import Summary, summarise
from staleflow.sim.trainer import SimTrainer, TrainerCosts
from staleflow.sim.truth import instance_truths
from staleflow.sim.workload import SyntheticWorkload, TraceWorkload, WorkloadConfig
from staleness import ConsumedBatch, StalenessConfig
from trajectory_server import TrajectoryServer, TrajectoryServerConfig, TrajState
from trajectory_server.errors import TrajectoryServerError
from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    RoutableTrajectory,
    TrainingGroup,
)

logger = logging.getLogger(__name__)

REWARD, TRAIN_DONE, PUSH_DONE = "reward", "train_done", "push_done"
STREAM_DONE, TOOL_DONE = "stream_done", "tool_done"


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
    # Redundant rollout (§4.3, App. C): extra groups per buffer / members per group, the
    # surplus aborted once a buffer or group is full (validated by the staleness manager).
    batch_redundancy: float = 0.0
    group_redundancy: float = 0.0
    # RolloutPipe's complete-group pipelining (its §3.2): the idle trainer starts forward
    # and backward on the groups occupied in its buffer before the buffer is Ready, and
    # the step at Consume pays only for the rest. The version moves at the step as
    # before, so staleness is unchanged; off, the trainer waits for a Ready buffer.
    stream_training: bool = False
    # Multi-turn, tool-using trajectories (staleflow/sim/agentic.py): turns, tokens per
    # turn, observations and tool latencies; ``workload`` then only says the cap (use
    # ``AgenticConfig.as_workload()``). None: single-turn responses.
    agentic: AgenticConfig | None = None
    # Dynamic sampling (staleflow/control/dynamic_sampling.py): the simulator grades no
    # rewards, so each completed group is drawn uniform (and filtered out) with this
    # probability, seeded by (seed, group); at most the share ``max_drop`` of a step's
    # groups is dropped, as in a real run. 0: off.
    filtered_share: float = 0.0
    max_drop: float = 0.75

    def __post_init__(self) -> None:
        if self.instances < 1 or self.steps < 1:
            raise ValueError(f"need instances >= 1 and steps >= 1, got {self}")
        if not 0.0 <= self.filtered_share <= 1.0:
            raise ValueError(f"filtered_share={self.filtered_share} must be in [0, 1]")
        if self.reward_latency_s < 0:
            raise ValueError(f"reward_latency_s={self.reward_latency_s} must be >= 0")

    def with_(self, **changes: object) -> ClusterConfig:
        return replace(self, **changes)


class SimCluster:
    """Build with a :class:`ClusterConfig` (and optionally a trace workload), then
    :meth:`run` it; :meth:`check` verifies conservation at any point."""

    def __init__(self, config: ClusterConfig, workload: TraceWorkload | None = None) -> None:
        self.config = config
        ts_config = TrajectoryServerConfig(
            eta=config.eta,
            batch_size=config.batch_size,
            group_size=config.group_size,
            group_redundancy=config.group_redundancy,
            batch_redundancy=config.batch_redundancy,
        )
        members = ts_config.trajectories_per_group
        self.workload: SyntheticWorkload | TraceWorkload | AgenticWorkload
        if config.agentic is not None:
            self.workload = AgenticWorkload(config.agentic, members, config.seed)
        else:
            self.workload = workload or SyntheticWorkload(config.workload, members, config.seed)
        self.ts = TrajectoryServer(ts_config, self.workload)
        plain = config.coordinator.cost_model.build()
        # What each engine really does (speed, estimate error, ...; sim/truth.py).
        truths = instance_truths(plain, config.engine.truth, config.instances, config.seed)
        # the coordinator's model: told of the engines' speculation, as a launch tells it
        told = config.engine.speculation if config.engine.tell_coordinator else None
        cost = plain.with_speculation(told)
        pool: set[int] | None = set() if config.engine.kv_pool else None  # shared by all
        self.instances = {
            i: SimInstance(
                i, cost, config.engine, np.random.default_rng([config.seed, i]), truths[i], pool
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
            config.coordinator.seer.chunk,
        )
        # the environment pool of multi-turn work (sim/env.py): tool calls wait there
        self.envs: SimEnvironments | None = None
        if isinstance(self.workload, AgenticWorkload):
            self.envs = SimEnvironments(
                self.ts, self.workload, lambda when, tid: self._push(when, TOOL_DONE, tid)
            )
            self.planes.turn_end = self.workload.turn_end
            for inst in self.instances.values():
                inst.turned = self.envs.turned
        self.loop = ControlLoop(
            StalenessConfig(
                eta=config.eta,
                batch_size=config.batch_size,
                group_size=config.group_size,
                batch_redundancy=config.batch_redundancy,
                group_redundancy=config.group_redundancy,
            ),
            config.coordinator.for_responses(config.workload.max_response),
            ts=self.ts,
            planes=self.planes,
            snapshots=lambda: [i.snapshot() for i in self.instances.values()],
            ps_version=lambda: self.trainer.ps_version,
            instances=self.instances,
            clock=lambda: self.now,
            sampling=_sampling(config),
            speculation=cost.speculation,
        )
        self.manager = self.loop.manager
        rule = self.loop.coordinator.strategies.race
        self.races = SimRaces(rule, self.instances) if rule is not None else None
        self.planes.races = self.races
        self.coordinator = self.loop.coordinator
        self.executor = self.loop.executor
        self._events: list[tuple[float, int, str, object]] = []
        self.stalled = False
        # Called once per cycle, after the commands were applied (state at ``now``): lets
        # an optional recorder (``timeline.Timeline``) sample instances without a copy of
        # this loop.
        self.observers: list[Callable[[SimCluster], None]] = []
        # every plan_cycle's CPU time and size (summary.decision_figures): measured, so
        # kept out of the deterministic Summary
        self.decisions: list[Decision] = []
        self._seq = 0
        self.rewarding: dict[int, SimTrajectory] = {}  # finished, reward pending
        self.batches: list[ConsumedBatch] = []
        self.consumed: set[int] = set()
        self.duplicates: list[int] = []
        self.response_lengths: list[int] = []  # of consumed trajectories
        self.late_wasted_tokens = 0  # responses finished after their trajectory was dropped
        # rewarded, not yet trained -> when, and the trainer's finished steps then
        self.finished_at: dict[int, tuple[float, int]] = {}
        # per consumed batch: the steps the trainer finished between the batch's last
        # reward and its Consume
        self.ready_wait: list[int] = []
        # per consumed batch: seconds from its 90th-percentile finish to its last (the time
        # the buffer waited on its long tail, Seer's "long-tail time")
        self.tail_s: list[float] = []
        # (sample id, prompt length, response lengths) of every consumed group
        self.trained: list[tuple[int, int, tuple[int, ...]]] = []
        self.streamed: set[int] = set()  # groups of the trainer's buffer already trained on

    # -- sources the coordinator reads (the control loop's) ---------------------------

    def snapshot(self) -> Snapshot:
        return self.loop.snapshot()

    def routable(self) -> list[RoutableTrajectory]:
        return list(self.loop.routable())

    def latest_version(self) -> int:
        return self.trainer.ps_version

    # -- the loop ---------------------------------------------------------------------

    def run(self) -> Summary:
        c = self.config
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
            self.step()
        if self.trainer.steps < c.steps and not self.stalled:
            logger.warning(
                "stopped at max_time_s=%s after %d steps", c.max_time_s, self.trainer.steps
            )
        return summarise(self)

    def step(self) -> None:
        """One coordinator period: the cycle at ``now``, then decoding and the events up
        to ``now + period``."""
        self._cycle()
        if self.races is not None:  # after routing: what routing filled is not idle
            self.races.start(self.ts.routing_view(), self.now, self._speeds())
        for observe in self.observers:
            observe(self)
        horizon = self.now + self.config.coordinator.period_s
        for inst in self.instances.values():
            inst.advance(horizon, self._finished)
            returned = inst.take_returned()
            if returned:  # chunk boundaries (divided rollout): the TS re-places them
                return_live(self.ts, returned)
        if self.races is not None:
            for t, inst, traj in self.races.settle(horizon):
                self._reward_at(t, inst, traj)
        self._drain(horizon)
        self.now = horizon

    def _cycle(self) -> None:
        """The control loop's snapshot-command cycle at ``now``; the trainer Consumes if
        the cycle made its buffer Ready (the real control plane's order)."""
        stats = self.coordinator.stats
        decided = stats.decisions
        self.loop.cycle()
        if stats.decisions != decided and stats.last_decision is not None:
            self.decisions.append(stats.last_decision)
        self._maybe_train(self.now)

    def _push(self, t: float, kind: str, data: object) -> None:
        heapq.heappush(self._events, (t, self._seq, kind, data))
        self._seq += 1

    def _speeds(self) -> np.ndarray | None:
        """The coordinator's speed estimates, as its cycle normalises them (cycle.py)."""
        estimator = self.loop.coordinator.strategies.estimator
        if estimator is None:
            return None
        return estimator.relative(sorted(self.instances))

    def _finished(self, t: float, inst: SimInstance, traj: SimTrajectory) -> None:
        if self.races is not None and self.races.hold_finish(t, inst, traj):
            return  # settled once every instance has advanced (sim/race.py)
        self._reward_at(t, inst, traj)

    def _reward_at(self, t: float, inst: SimInstance, traj: SimTrajectory) -> None:
        self.rewarding[traj.traj_id] = traj
        self._push(t + self.config.reward_latency_s, REWARD, (traj, inst.version))

    def _drain(self, horizon: float) -> None:
        while self._events and self._events[0][0] <= horizon:
            t, _, kind, data = heapq.heappop(self._events)
            if kind == REWARD:
                self.finished_at[data[0].traj_id] = (t, self.trainer.steps)
                self._reward(*data)
            elif kind == TRAIN_DONE:
                self._push(self.trainer.finish_step(t), PUSH_DONE, None)
            elif kind == STREAM_DONE:
                self.trainer.stream_done()
            elif kind == TOOL_DONE:
                assert self.envs is not None
                self.envs.answer(t, data)
            else:
                self.trainer.push_landed(t)
            self._maybe_train(t)

    def _reward(self, traj: SimTrajectory, version: int) -> None:
        """A reward worker: store the finished trajectory in the TS as completed (unless
        it was aborted meanwhile: a late message, dropped), then report it."""
        self.rewarding.pop(traj.traj_id)
        self.workload.forget(traj.traj_id)
        tokens, logprobs, versions = traj.response(version)
        capped = traj.target - traj.prompt_len >= self.config.workload.max_response
        reason = "length" if capped else "stop"
        completion = Completion(
            traj.traj_id, tokens, logprobs, versions, 1.0, reason, {}, traj.mask()
        )
        if complete_live(self.ts, [completion]):
            self._occupy(traj)
        else:  # aborted while it finished: its tokens were generated for nothing
            self.late_wasted_tokens += len(tokens)

    def _occupy(self, traj: SimTrajectory) -> None:
        self.loop.occupy((traj,))

    def _maybe_train(self, t: float) -> None:
        """The trainer, when idle, Consumes its buffer as soon as it is Ready, and streams
        the groups occupied in it so far while it is not (``stream_training``)."""
        if self.trainer.busy:
            return
        self.loop.trainer_asks()
        batch = self.loop.consume()
        if batch is not None:
            self._train(t, batch)
        elif self.config.stream_training:
            self._stream(t)

    def _stream(self, t: float) -> None:
        """Forward and backward on the trainer's buffer's occupied groups not streamed yet,
        read from the TS without taking them: they stay there, whole, until the Consume
        (occupied groups only move earlier, and the trainer's buffer is the earliest)."""
        fresh = {
            g.group_id: g.trajectories
            for g in self.manager.trainer_groups()
            if g.group_id not in self.streamed
        }
        if not fresh:
            return
        tokens = squares = 0
        for group in self.ts.read_batch(list(fresh), fresh).groups:
            g_tokens, g_squares = _cost(group)
            tokens, squares = tokens + g_tokens, squares + g_squares
        self.streamed.update(fresh)
        self._push(self.trainer.stream(t, tokens, squares), STREAM_DONE, None)

    def _train(self, t: float, batch: ConsumedBatch) -> None:
        """Fetch the consumed groups' kept trajectories from the TS and train on them."""
        self.batches.append(batch)
        select = {g.group_id: g.trajectories for g in batch.groups}
        kept = [t for ts in select.values() for t in ts]
        taken = self.ts.take_batch(list(select), select)
        if taken.dropped:
            self._forget(taken.dropped)
        now = self.trainer.steps  # finished steps: the version this batch trains
        finished = [self.finished_at.pop(t, (0.0, now)) for t in kept]
        self.tail_s.append(tail_seconds([when for when, _ in finished]))
        self.ready_wait.append(now - max((steps for _, steps in finished), default=now))
        tokens = squares = ahead_groups = ahead_tokens = 0
        for group in taken.groups:
            lengths = tuple(len(tr.tokens) for tr in group.trajectories)
            self.trained.append((group.sample_id, len(group.prompt), lengths))
            for tr in group.trajectories:
                if tr.traj_id in self.consumed:
                    self.duplicates.append(tr.traj_id)
                self.consumed.add(tr.traj_id)
                self.response_lengths.append(len(tr.tokens))
            g_tokens, g_squares = _cost(group)
            if group.group_id in self.streamed:  # trained on already: only counted
                ahead_groups, ahead_tokens = ahead_groups + 1, ahead_tokens + g_tokens
            else:
                tokens, squares = tokens + g_tokens, squares + g_squares
        self.streamed.clear()
        end = self.trainer.start_step(t, tokens, squares, (ahead_groups, ahead_tokens))
        self._push(end, TRAIN_DONE, None)

    def _forget(self, dropped: Iterable[AbortedTrajectory]) -> None:
        self.loop.forget(dropped)

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
        tools = self.envs.waiting if self.envs is not None else {}
        for tid in tools:
            if tid in seen:
                problems.append(f"trajectory {tid} waits on a tool and is on {seen[tid]}")
        routed = rewarding = 0
        for tid in tools:
            state = _state(self.ts, tid)
            if state is TrajState.REWARDING:
                rewarding += 1
            elif state is not None:
                problems.append(f"trajectory {tid} waits on a tool but is {state} in the TS")
        for tid, where in seen.items():
            state = _state(self.ts, tid)
            if state is TrajState.ROUTED:
                routed += 1
            elif state is not None or tid in self.consumed:
                problems.append(f"trajectory {tid} is on {where} but not ROUTED in the TS")
            # else: dropped from the TS (redundancy surplus) and on its way out: the next
            # valid cycle aborts it on its instance, and its reward arrives late and is
            # dropped
        s = self.ts.stats()
        if s.routed != routed:
            problems.append(f"TS has {s.routed} ROUTED but instances + reward hold {routed}")
        if s.rewarding != rewarding:
            problems.append(f"TS has {s.rewarding} REWARDING but {rewarding} wait on tools")
        total = s.queued + s.routed + s.rewarding + s.completed + s.consumed_trajectories
        if total + s.aborted_trajectories + s.filtered_trajectories != s.created_trajectories:
            problems.append(f"TS counts do not add up: {s}")
        if s.consumed_trajectories != len(self.consumed):
            problems.append(
                f"TS consumed {s.consumed_trajectories} but the trainer got {len(self.consumed)}"
            )
        if self.races is not None:
            problems += self.races.check()
        if self.planes.claimed:
            problems.append(f"claims left after the executor went idle: {self.planes.claimed}")
        return problems


def _sampling(config: ClusterConfig) -> DynamicSampling | None:
    """Dynamic sampling with drawn drops (``ClusterConfig.filtered_share``), or None."""
    share, seed = config.filtered_share, config.seed
    if share <= 0.0:
        return None

    def uniform(group_id: int, _rewards: object) -> bool:
        draw = np.random.default_rng([seed, group_id, 0x5A]).random()
        return bool(draw >= share)  # True: the group has a signal and is kept

    return DynamicSampling(SamplingConfig(config.batch_size, config.max_drop), decide=uniform)


def _cost(group: TrainingGroup) -> tuple[int, int]:
    """A group's tokens and its sequences' squared lengths (attention's cost)."""
    lengths = [len(group.prompt) + len(tr.tokens) for tr in group.trajectories]
    return sum(lengths), sum(n * n for n in lengths)


def tail_seconds(finish_times: list[float], share: float = 0.9) -> float:
    """Seconds from the moment ``share`` of the trajectories had finished to the last."""
    if not finish_times:
        return 0.0
    ordered = sorted(finish_times)
    k = max(0, math.ceil(share * len(ordered)) - 1)
    return ordered[-1] - ordered[k]


def _state(ts: TrajectoryServer, traj_id: int) -> TrajState | None:
    try:
        return ts.state_of(traj_id)
    except TrajectoryServerError:
        return None  # consumed or aborted
