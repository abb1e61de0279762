"""Algorithm 1 (one decision over a validated snapshot) and the snapshot-command cycle."""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from coordinator.aborts import AbortRequests
from coordinator.commands import Abort, Command, Interrupt, Pull, Reservation, Route
from coordinator.config import CoordinatorConfig
from coordinator.cost_model import SpeculationProfile
from coordinator.fleet import Fleet
from coordinator.interface import (
    AdmissionSource,
    CommandExecutor,
    ParameterVersionSource,
    SnapshotSource,
    TrajectorySource,
)
from coordinator.pool import TrajectoryPool
from coordinator.routing import Placement
from coordinator.speculative import SpeculativeState
from coordinator.strategies import Strategies, build_strategies, with_cost
from coordinator.types import InstanceId, Snapshot, TrajectoryView
from staleness.interface import AdmissionSketch
from staleness.types import GroupId, TrajId

logger = logging.getLogger(__name__)


def plan_cycle(
    snapshot: Snapshot,
    ts_trajs: Sequence[TrajectoryView],
    ps_version: int,
    sketch: AdmissionSketch,
    strategies: Strategies,
    aborts: AbortRequests | None = None,
) -> list[Command]:
    """Algorithm 1 on a validated snapshot. Routes are Reserved in ``sketch`` only."""
    S = Fleet(snapshot)
    if strategies.waits is not None:  # environment waits (coordinator/agentic.py)
        strategies.waits.observe(snapshot, ts_trajs)
    estimator, fresh = strategies.estimator, strategies.freshness
    if estimator is not None:
        estimator.observe(snapshot)
        S.speed = estimator.relative(S.ids)
    held: set[GroupId] = set()
    if fresh is not None:  # new groups that need not start yet (freshness.py)
        factors = estimator.factors(S.ids) if estimator is not None else None
        held = fresh.hold(ts_trajs, sketch, S, snapshot.taken_at, factors)
    commands = _decide(S, ts_trajs, ps_version, sketch, strategies, aborts, held)
    if estimator is not None:
        estimator.note(commands)
    if fresh is not None:
        fresh.note(commands, snapshot.taken_at)
    return commands


def _decide(
    S: Fleet,
    ts_trajs: Sequence[TrajectoryView],
    ps_version: int,
    sketch: AdmissionSketch,
    strategies: Strategies,
    aborts: AbortRequests | None,
    held: set[GroupId],
) -> list[Command]:
    commands: list[Command] = []
    if aborts:
        for pos, trajs in aborts.on_instances(S):
            commands.append(Abort(S.ids[pos], _ids(trajs)))
            S.discard(pos, trajs, strategies.cost.k5)
    excluded: Collection[GroupId] = aborts.groups if aborts else ()
    if held:  # neither routed nor a reason to Pull this cycle
        excluded = held | set(excluded)
    ts = TrajectoryPool(
        ts_trajs,
        excluded_trajs=aborts.trajs if aborts else (),
        excluded_groups=excluded,
    )
    for pos in strategies.sync.select(S, ts, ps_version, sketch):  # lines 3-8
        trajs = S.discard_all(pos)
        if trajs:
            commands.append(Interrupt(S.ids[pos], _ids(trajs)))
        commands.append(Pull(S.ids[pos], ps_version))
        S.set_version(pos, ps_version)
        ts.add(trajs)
    for pos, trajs in strategies.migration.select(S):  # lines 9-12
        commands.append(Interrupt(S.ids[pos], _ids(trajs)))
        S.discard(pos, trajs, strategies.cost.k5)
        ts.add(trajs)
    if strategies.hold is not None and strategies.hold.holds_routing(S, ps_version):
        return commands  # instances drain before a global Pull (drain_sync.py)
    placements: list[Placement] = []
    if strategies.critical is not None:  # the oldest buffer's tail first (critical.py)
        placements = _critical_moves(S, ts, ps_version, strategies, commands)
    placements += strategies.routing.route(S, ts, sketch, ps_version)  # lines 13-14
    commands.extend(_routes(S.ids, placements))
    return commands


def _critical_moves(
    S: Fleet, ts: TrajectoryPool, ps_version: int, strategies: Strategies, commands: list[Command]
) -> list[Placement]:
    """Interrupt the critical trajectories the rule moves and place them where it chose."""
    assert strategies.critical is not None
    k5 = strategies.cost.k5
    moves = strategies.critical.select(S, ts, ps_version)
    by_source: dict[int, list[TrajectoryView]] = {}
    for pos, t, _ in moves:
        by_source.setdefault(pos, []).append(t)
    for pos, trajs in by_source.items():
        commands.append(Interrupt(S.ids[pos], _ids(trajs)))
        S.discard(pos, tuple(trajs), k5)
    out = []
    for _, t, dest in moves:
        S.n_run[dest] += 1.0
        S.kv[dest] += k5 * t.length
        assert t.v_traj is not None  # on an instance, so routed before
        out.append(Placement(dest, t, t.v_traj, False))
    return out


def _ids(trajs: Iterable[TrajectoryView]) -> tuple[TrajId, ...]:
    return tuple(t.traj_id for t in trajs)


def _routes(ids: list[InstanceId], placements: list[Placement]) -> list[Route]:
    """One Route per instance, trajectories in decision order."""
    trajs: dict[int, list[TrajId]] = {}
    reservations: dict[int, list[Reservation]] = {}
    for p in placements:
        trajs.setdefault(p.pos, []).append(p.traj.traj_id)
        if p.initial:
            reservations.setdefault(p.pos, []).append(
                Reservation(p.traj.group_id, p.traj.traj_id, p.v_traj)
            )
    return [Route(ids[pos], tuple(t), tuple(reservations.get(pos, ()))) for pos, t in trajs.items()]


class Decision(NamedTuple):
    """One ``plan_cycle``: the CPU time it took and the size of what it decided over (the
    figures ``experiments/bench_coordinator.py`` sets for a cycle, measured in a run)."""

    cpu_s: float  # the deciding thread's CPU time: neighbours and other threads excluded
    instances: int
    on_instances: int  # trajectories decoding or queued on an instance
    waiting_on_tools: int  # trajectories at their environment (InstanceSnapshot.env_trajs)
    routable: int  # trajectories the TS offered to route


class DecisionTimes(NamedTuple):
    """CPU milliseconds of a window of decisions (``CycleStats.take_recent``)."""

    count: int
    median_ms: float
    max_ms: float


# the decisions a step record summarises: a step of a real run spans tens to hundreds of
# cycles; more than this between two reads keeps the latest
_RECENT = 4096


@dataclass(slots=True)
class CycleStats:
    cycles: int = 0  # snapshots taken
    discarded: int = 0  # snapshots rejected by Eq. 1
    commands: int = 0
    last_decision_s: float = 0.0  # wall time of the last plan_cycle
    decisions: int = 0  # plan_cycle calls (valid snapshots)
    last_decision: Decision | None = None
    # CPU seconds of the decisions since the last ``take_recent`` (the latest _RECENT)
    recent_cpu_s: deque[float] = field(default_factory=lambda: deque(maxlen=_RECENT))
    taken: int = 0  # ``decisions`` at the last ``take_recent``

    def take_recent(self) -> DecisionTimes | None:
        """The CPU time of the decisions since the last call, and forget them (one step
        record's figures); None if there were none."""
        if not self.recent_cpu_s:
            return None
        ms = sorted(s * 1e3 for s in self.recent_cpu_s)
        self.recent_cpu_s.clear()
        count, self.taken = self.decisions - self.taken, self.decisions
        return DecisionTimes(count, statistics.median(ms), ms[-1])


class Coordinator:
    """The snapshot-command cycle of §5.2, one :meth:`step` per period.

    Time comes from outside (``step(now)`` or the injected ``clock``) so that a simulator
    can drive it on virtual time.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        *,
        snapshots: SnapshotSource,
        trajectories: TrajectorySource,
        parameters: ParameterVersionSource,
        admission: AdmissionSource,
        executor: CommandExecutor,
        instances: Mapping[InstanceId, int],
        clock: Callable[[], float] = time.monotonic,
        speculation: SpeculationProfile | None = None,
    ) -> None:
        """``speculation``: the engines decode speculatively (docs/speculation.md); the
        cost model then counts the tokens a step keeps (coordinator/cost_model.py)."""
        self.config = config
        self.strategies = build_strategies(config, speculation)
        self.speculative = SpeculativeState(instances)
        self.stats = CycleStats()
        self._snapshots, self._trajectories = snapshots, trajectories
        self._parameters, self._admission = parameters, admission
        self._executor = executor
        self._clock = clock
        self._aborts = AbortRequests()
        self._next_due = float("-inf")

    @property
    def next_due(self) -> float:
        """When the next cycle may run (on the caller's clock)."""
        return self._next_due

    def speculate(self, profile: SpeculationProfile | None) -> None:
        """Decide with ``profile``'s speculation from the next cycle on (e.g. the
        acceptance the engines measured so far: ``cost_model.learned_speculation``);
        what the strategies learned stays. None: the engines do not speculate."""
        cost = self.strategies.cost.with_speculation(profile)
        self.strategies = with_cost(self.strategies, cost)

    def add_instance(self, inst: InstanceId, version: int) -> None:
        """An instance joins (elastic rollout, or a restarted one under a new id): the next
        snapshot must include it, empty and at ``version`` (what it Pulled on start)."""
        self.speculative.add_instance(inst, version)

    def remove_instance(self, inst: InstanceId) -> None:
        """An instance left (lost, or removed): later snapshots leave it out. What it held
        is the caller's to give back to the TS."""
        self.speculative.remove_instance(inst)

    def request_abort(self, trajs: Iterable[TrajId] = (), groups: Iterable[GroupId] = ()) -> None:
        """Drop these trajectories / whole groups at the next valid snapshot."""
        self._aborts.add(trajs, groups)

    def issue_aborts(self) -> list[Abort]:
        """The requested Aborts alone, now, without the rest of a cycle: for a caller whose
        cycles have ended (a stop), so that no instance keeps running what was dropped.
        They are found on a fresh snapshot, valid or not (an Abort names its trajectories;
        one that left meanwhile is settled as missed), and counted in P as a cycle's are,
        so that later snapshots still validate. Returns them."""
        if not self._aborts:
            return []
        for done in self._executor.poll():
            self.speculative.settle(done)
        tracked = set(self.speculative.instances)
        S = Fleet(self._snapshots.snapshot())
        commands = [
            Abort(S.ids[pos], _ids(trajs))
            for pos, trajs in self._aborts.on_instances(S)
            if S.ids[pos] in tracked
        ]
        self._aborts.retain_listed(self._trajectories.routable())
        for command in commands:
            self.speculative.apply(command)
        self._executor.issue(commands)
        self.stats.commands += len(commands)
        return commands

    def step(self, now: float | None = None) -> list[Command]:
        """One cycle if it is due: snapshot → validate → strategies → issue."""
        now = self._clock() if now is None else now
        if now < self._next_due:
            return []
        self._next_due = now + self.config.period_s
        for done in self._executor.poll():
            self.speculative.settle(done)
        snapshot = self._snapshots.snapshot()
        self.stats.cycles += 1
        if not self.speculative.validate(snapshot):
            self.stats.discarded += 1
            if logger.isEnabledFor(logging.DEBUG):
                logger.debug("snapshot discarded: %s", self.speculative.mismatches(snapshot)[:3])
            return []
        ts_trajs = self._trajectories.routable()
        started, started_cpu = time.perf_counter(), time.thread_time()
        commands = plan_cycle(
            snapshot,
            ts_trajs,
            self._parameters.latest_version(),
            self._admission.sketch(),
            self.strategies,
            self._aborts if self._aborts else None,
        )
        cpu = time.thread_time() - started_cpu
        self.stats.last_decision_s = time.perf_counter() - started
        self.stats.decisions += 1
        self.stats.recent_cpu_s.append(cpu)
        self.stats.last_decision = Decision(
            cpu,
            len(snapshot.instances),
            sum(len(s.run_trajs) + len(s.wait_trajs) for s in snapshot.instances),
            sum(len(s.env_trajs) for s in snapshot.instances),
            len(ts_trajs),
        )
        if self._aborts:
            self._aborts.retain_listed(ts_trajs)
        for command in commands:
            self.speculative.apply(command)
        self._executor.issue(commands)
        self.stats.commands += len(commands)
        return commands
