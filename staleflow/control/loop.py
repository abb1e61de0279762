"""The one control loop that the real control plane and the simulator both drive.

It owns the staleness manager (§4), the coordinator and its in-process executor (§5.2),
and is where every decision of a run is taken:

- **Occupy** (:meth:`ControlLoop.occupy`): a rewarded trajectory completes its group;
  the surplus that redundancy (§4.3, App. C) no longer needs is dropped: group-level
  surplus members, batch-level groups that can no longer fit, and the trajectory itself
  when its group was settled (or consumed) before it arrived; with dynamic sampling
  (``staleflow.control.dynamic_sampling``), a group whose rewards are all equal is
  filtered out instead of occupied;
- **Consume** (:meth:`ControlLoop.consume`): the trainer's buffer, once Ready; reserved
  groups that no longer fit are dropped;
- **the snapshot-command cycle** (:meth:`ControlLoop.cycle`): snapshot, validate against
  the speculative state, run the strategies, carry the commands out;
- **aborts**: whatever is dropped leaves the trajectory server at once and the instances
  at the next valid snapshot, or at a stop (the coordinator issues the Aborts, so its
  speculative state counts them); a Route that finds its trajectory gone gives its fresh
  Reserve back.

Its drivers inject only the planes, the trajectory server, the snapshot and PS-version
sources and the clock: ``staleflow.runtime.controller.control_plane.ControlPlane`` runs it on wall time on
its own thread, ``staleflow.sim.cluster.SimCluster`` on virtual time. Neither drives the
manager or the coordinator itself. Pure Python (no ray, torch), and single-threaded: one
driver thread calls it (the executor's ``run_round`` may fan one round of commands out
to a thread pool; the planes must then be thread-safe).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Protocol

from coordinator import Coordinator, CoordinatorConfig, InProcessExecutor, Snapshot
from coordinator.cost_model import SpeculationProfile, learned_speculation
from coordinator.interface import EnginePlane, ParameterPlane, TrajectoryPlane
from coordinator.types import InstanceId, InstanceSnapshot
from staleflow.control.decisions import Consumed, Decision, Dropped, Issued, Occupied
from staleflow.control.dynamic_sampling import DynamicSampling, graded_reward
from staleflow.control.late import (
    Aborter,
    GroupFilterSink,
    abort_groups_live,
    abort_live,
    filter_group_live,
)
from staleness import ConsumedBatch, StalenessConfig, StalenessManager
from staleness.errors import DuplicateTrajectory, StalenessError
from staleness.types import GroupId, TrajId
from trajectory_server.types import AbortedTrajectory, LiveTrajectory, RoutableTrajectory

logger = logging.getLogger(__name__)


class TrajectoryStore(Aborter, GroupFilterSink, Protocol):
    """What the loop needs of the trajectory server: its routing view, aborts, and (with
    dynamic sampling) its ledger and filtered groups."""

    def routing_view(self) -> Sequence[RoutableTrajectory]: ...

    def ledger(self) -> Sequence[LiveTrajectory]: ...


class Planes(EnginePlane, TrajectoryPlane, ParameterPlane, Protocol):
    """The data planes the executor drives (one object may serve all three)."""


class FinishedLike(Protocol):
    """A trajectory the TS now holds as completed (``runtime.interface.Rewarded``)."""

    @property
    def traj_id(self) -> TrajId: ...

    @property
    def group_id(self) -> GroupId: ...

    @property
    def response_len(self) -> int: ...


class ControlLoop:
    """See the module docstring. ``on_decision`` receives every decision as it is taken
    (tests compare the decisions of the runtime and of the simulator)."""

    def __init__(
        self,
        staleness: StalenessConfig,
        coordinator: CoordinatorConfig,
        *,
        ts: TrajectoryStore,
        planes: Planes,
        snapshots: Callable[[], Sequence[InstanceSnapshot]],
        ps_version: Callable[[], int],
        instances: Iterable[InstanceId],
        clock: Callable[[], float],
        run_round: Callable[[Sequence[Callable[[], None]]], None] | None = None,
        on_decision: Callable[[Decision], None] | None = None,
        manager: StalenessManager | None = None,
        versions: Mapping[InstanceId, int] | None = None,
        sampling: DynamicSampling | None = None,
        speculation: SpeculationProfile | None = None,
    ) -> None:
        """``speculation``: the engines decode speculatively, and the coordinator's cost
        model knows it; its acceptance is the prior until the engines' counters measure
        one (:meth:`speculation_measured`)."""
        # a resumed run hands in the manager it restored (same settings, checked there)
        self.manager = manager if manager is not None else StalenessManager(staleness)
        if self.manager.config != staleness:
            raise ValueError(
                f"the staleness manager was built with {self.manager.config}, the loop "
                f"with {staleness}: restore it with the run's own settings"
            )
        # a resumed run's instances start at the version they Pulled, not 0
        start = {inst: (versions or {}).get(inst, 0) for inst in instances}
        self._ts = ts
        self._snapshots = snapshots
        self._ps_version = ps_version
        self._clock = clock
        self._missed: list[TrajId] = []
        self.executor = InProcessExecutor(
            _Delivery(planes, self._missed), planes, planes, self.manager, run_round=run_round
        )
        self.coordinator = Coordinator(
            coordinator,
            snapshots=self,
            trajectories=self,
            parameters=self,
            admission=self.manager,
            executor=self.executor,
            instances=start,
            clock=clock,
            speculation=speculation,
        )
        self._speculation_prior = speculation
        self.on_decision = on_decision
        self.last_snapshot: tuple[InstanceSnapshot, ...] = ()
        self.last_discard = ""  # why the last discarded snapshot failed Eq. 1
        self._latest_version = 0
        self._view: Sequence[RoutableTrajectory] = ()
        self.sampling = sampling
        if sampling is not None:
            # a resumed manager has groups partly completed before the stop: their
            # rewards are in the TS (a fresh run's ledger holds no completion)
            sampling.seed(ts.ledger())

    # -- what the drivers call ------------------------------------------------------------

    def occupy(self, finished: Iterable[FinishedLike]) -> list[FinishedLike]:
        """Trajectories the TS now holds as completed: Occupy their groups (§4.2), and
        tell Seer's length context (if on) how long they were. Returns those applied
        now: a completion the manager already has (a report replayed after a lost reward
        worker, :meth:`replay`) is skipped."""
        context = self.coordinator.strategies.seer
        fresh = self.coordinator.strategies.freshness
        sampling = self.sampling
        applied: list[FinishedLike] = []
        for f in finished:
            keep = None
            if sampling is not None:
                sampling.note(f.group_id, f.traj_id, graded_reward(f))
                keep = self._keeper(f.group_id)
            try:
                outcome = self.manager.complete(f.group_id, f.traj_id, keep)
            except DuplicateTrajectory:
                logger.debug("completion of trajectory %d already applied", f.traj_id)
                continue
            if context is not None:
                context.finished(f.group_id, f.traj_id, f.response_len)
            if fresh is not None:
                fresh.finished(f.group_id, f.response_len)
                if outcome.occupied:
                    fresh.completed(f.group_id, self._clock())
            applied.append(f)
            if self.on_decision is not None:
                self.on_decision(Occupied(self._clock(), f.group_id, f.traj_id, outcome))
            if outcome.abort_trajectories or outcome.abort_groups:
                self._drop(outcome.abort_trajectories, outcome.abort_groups)
            if outcome.filtered:
                self._filtered(f.group_id)
            elif sampling is not None and outcome.discarded:
                sampling.forget((f.group_id,))  # a late member of a settled group
        return applied

    def _keeper(self, group_id: GroupId) -> Callable[[Sequence[TrajId]], bool]:
        """Dynamic sampling's decision, asked by the manager inside its Occupy (under its
        lock: reads its per-step count as an attribute, calls nothing of it)."""
        assert self.sampling is not None
        sampling, manager = self.sampling, self.manager
        return lambda kept: sampling.keeps(group_id, kept, manager.filtered_this_step)

    def _filtered(self, group_id: GroupId) -> None:
        """Dynamic sampling dropped ``group_id`` (its completed members; the surplus went
        as at any Occupy): out of the TS as filtered, and off any instance."""
        gone = filter_group_live(self._ts, group_id)
        on_instances = tuple(t.traj_id for t in gone if t.instance_id is not None)
        if on_instances:
            self.coordinator.request_abort(trajs=on_instances)

    def replay(self, completed: Iterable[FinishedLike]) -> list[FinishedLike]:
        """Completions the TS holds whose report may never come (the reward worker died
        between storing them and reporting them): Occupy those the manager has not
        applied and that it still tracks. Returns them."""
        pending = [
            f
            for f in completed
            if self.manager.group_version(f.group_id) is not None
            and not self.manager.is_completed(f.group_id, f.traj_id)
        ]
        return self.occupy(pending)

    # -- the instances (elastic rollout, lost instances) --------------------------------

    def add_instance(self, inst: InstanceId, version: int) -> None:
        """An instance joins at ``version`` (what it Pulled); the next cycle routes to it."""
        self.coordinator.add_instance(inst, version)

    def remove_instance(self, inst: InstanceId) -> None:
        """An instance left; what it held is already back in the TS (``instance_lost``)."""
        self.coordinator.remove_instance(inst)
        self.last_snapshot = tuple(s for s in self.last_snapshot if s.inst != inst)

    def group_of(self, traj_id: TrajId) -> GroupId | None:
        """The group of a trajectory in the last cycle's routing view (None: not in it)."""
        for t in self._view:
            if t.traj_id == traj_id:
                return t.group_id
        return None

    def release_reserves(self, trajs: Iterable[tuple[GroupId, TrajId]]) -> None:
        """Reserves made for initial trajectories that never reached an instance (a Route
        to an instance that died before it fetched them from the TS): undo them, so the
        trajectories are routed and Reserved again like any initial one."""
        for gid, tid in trajs:
            try:
                self.manager.unreserve(gid, tid)
            except StalenessError as exc:  # its group settled meanwhile: nothing held
                logger.debug("reserve of trajectory %d not released: %s", tid, exc)

    def trainer_asks(self) -> None:
        """The trainer is idle and asks for its next buffer (the freshness rule's pace:
        from here until the Consume it waits). Repeated asks keep the first."""
        fresh = self.coordinator.strategies.freshness
        if fresh is not None:
            fresh.pace.asked(self._clock())

    def consume(self) -> ConsumedBatch | None:
        """Consume the trainer's buffer if it is Ready (None otherwise)."""
        if not self.manager.is_ready():
            return None
        batch = self.manager.consume()
        if self.sampling is not None:  # rewards seeded at a resume for occupied groups
            self.sampling.forget(g.group_id for g in batch.groups)
        fresh = self.coordinator.strategies.freshness
        if fresh is not None:
            fresh.consumed(self._clock())
        if self.on_decision is not None:
            self.on_decision(Consumed(self._clock(), batch))
        if batch.aborted_groups:
            self._drop((), batch.aborted_groups)
        return batch

    def forget(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        """The TS dropped these by itself (the rest of a consumed group at ``take_batch``):
        abort those that are on an instance."""
        ids = tuple(t.traj_id for t in trajectories if t.instance_id is not None)
        if ids:
            self.coordinator.request_abort(trajs=ids)
            if self.on_decision is not None:
                self.on_decision(Dropped(self._clock(), ids, ()))

    def abort_pending(self) -> int:
        """Once the cycles have ended (a stop): issue the Aborts requested since the last
        cycle, e.g. of the surplus the last Occupy or Consume dropped just before the
        stop. The TS forgot those trajectories already; left on an instance they would
        run on for nothing, outside every count. Returns how many were to be aborted."""
        commands = self.coordinator.issue_aborts()
        if not commands:
            return 0
        if self.on_decision is not None:
            self.on_decision(Issued(self._clock(), tuple(commands)))
        self.executor.run_until_idle()
        return sum(len(c.trajs) for c in commands)

    def speculation_measured(self, counts: tuple[int, int, int] | None) -> None:
        """The engines' speculation counters over the run so far (drafts verified, draft
        tokens, accepted ones; None: none reported): the coordinator's cost model takes
        the acceptance they measure (``cost_model.learned_speculation``: the prior until
        there are enough). Nothing without speculation."""
        prior = self._speculation_prior
        if prior is not None and counts is not None:
            self.coordinator.speculate(learned_speculation(prior, *counts))

    def cycle(self) -> bool:
        """One snapshot-command cycle if it is due; True if one ran."""
        now = self._clock()
        if now < self.coordinator.next_due:
            return False
        self._latest_version = self._ps_version()
        discarded = self.coordinator.stats.discarded
        commands = self.coordinator.step(now)
        if self.coordinator.stats.discarded > discarded:
            snapshot = Snapshot(self.last_snapshot)
            self.last_discard = str(self.coordinator.speculative.mismatches(snapshot)[:2])
        if self.on_decision is not None:
            self.on_decision(Issued(now, tuple(commands)))
        self.executor.run_until_idle()
        self._release_missed()
        return True

    # -- what the coordinator reads (SnapshotSource, TrajectorySource, PS version) ---------

    def snapshot(self) -> Snapshot:
        self.last_snapshot = tuple(self._snapshots())
        return Snapshot(self.last_snapshot, self._clock())

    def routable(self) -> Sequence[RoutableTrajectory]:
        self._view = self._ts.routing_view()
        return self._view

    def latest_version(self) -> int:
        """The PS version the last cycle decided on."""
        return self._latest_version

    # -- dropping -------------------------------------------------------------------------

    def _drop(self, trajs: Sequence[TrajId], groups: Sequence[GroupId]) -> None:
        """Forget trajectories and whole groups in the TS now, and on the instances at the
        next valid snapshot. Those the TS already forgot are late news, not errors."""
        if trajs:
            abort_live(self._ts, trajs)
        if groups:
            abort_groups_live(self._ts, groups)
            if self.sampling is not None:
                self.sampling.forget(groups)
            if (fresh := self.coordinator.strategies.freshness) is not None:
                fresh.dropped(groups)
        self.coordinator.request_abort(trajs, groups)
        if self.on_decision is not None:
            self.on_decision(Dropped(self._clock(), tuple(trajs), tuple(groups)))

    def _release_missed(self) -> None:
        """Reserves made for Routes whose trajectory had left the TS by delivery (its
        group was consumed or aborted since the cycle's view) hold buffer slots for
        nothing: give them back, and drop the group if it can no longer complete."""
        if not self._missed:
            return
        missed = list(self._missed)
        self._missed.clear()
        group_of = {t.traj_id: t.group_id for t in self._view}
        for tid in missed:
            outcome = self.manager.abort_trajectory(group_of[tid], tid)
            if outcome.abort_trajectories or outcome.abort_groups:
                self._drop(outcome.abort_trajectories, outcome.abort_groups)


class _Delivery:
    """The engine plane as the loop's executor sees it: notes the initial trajectories a
    Route could not start (their Reserve is released after the round, on the loop's
    thread, see ``ControlLoop._release_missed``)."""

    __slots__ = ("_missed", "_planes")

    def __init__(self, planes: EnginePlane, missed: list[TrajId]) -> None:
        self._planes, self._missed = planes, missed

    def interrupt(self, inst: InstanceId, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        return self._planes.interrupt(inst, trajs)

    def abort(self, inst: InstanceId, trajs: Sequence[TrajId]) -> Collection[TrajId]:
        return self._planes.abort(inst, trajs)

    def submit(
        self, inst: InstanceId, payloads: Mapping[TrajId, object], v_traj: Mapping[TrajId, int]
    ) -> Collection[TrajId]:
        missed = self._planes.submit(inst, payloads, v_traj)
        if missed:
            # one list.extend of a list: atomic under the GIL when rounds run on a pool
            self._missed.extend([t for t in missed if t in v_traj])
        return missed
