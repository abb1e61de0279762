"""The one control loop that the real control plane and the simulator both drive.

It owns the staleness manager (§4), the coordinator and its in-process executor (§5.2),
and is where every decision of a run is taken:

- **Occupy** (:meth:`ControlLoop.occupy`): a rewarded trajectory completes its group;
  the surplus that redundancy (§4.3, App. C) no longer needs is dropped: group-level
  surplus members, batch-level groups that can no longer fit, and the trajectory itself
  when its group was settled (or consumed) before it arrived;
- **Consume** (:meth:`ControlLoop.consume`): the trainer's buffer, once Ready; reserved
  groups that no longer fit are dropped;
- **the snapshot-command cycle** (:meth:`ControlLoop.cycle`): snapshot, validate against
  the speculative state, run the strategies, carry the commands out;
- **aborts**: whatever is dropped leaves the trajectory server at once and the instances
  at the next valid snapshot (the coordinator issues the Aborts, so its speculative state
  counts them); a Route that finds its trajectory gone gives its fresh Reserve back.

Its drivers inject only the planes, the trajectory server, the snapshot and PS-version
sources and the clock: ``staleflow.runtime.control.ControlPlane`` runs it on wall time on
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
from coordinator.interface import EnginePlane, ParameterPlane, TrajectoryPlane
from coordinator.types import InstanceId, InstanceSnapshot
from staleflow.control.decisions import Consumed, Decision, Dropped, Issued, Occupied
from staleflow.control.late import Aborter, abort_groups_live, abort_live
from staleness import ConsumedBatch, StalenessConfig, StalenessManager
from staleness.types import GroupId, TrajId
from trajectory_server.types import AbortedTrajectory, RoutableTrajectory

logger = logging.getLogger(__name__)


class TrajectoryStore(Aborter, Protocol):
    """What the loop needs of the trajectory server: its routing view and aborts."""

    def routing_view(self) -> Sequence[RoutableTrajectory]: ...


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
    ) -> None:
        self.manager = StalenessManager(staleness)
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
            instances=dict.fromkeys(instances, 0),
            clock=clock,
        )
        self.on_decision = on_decision
        self.last_snapshot: tuple[InstanceSnapshot, ...] = ()
        self.last_discard = ""  # why the last discarded snapshot failed Eq. 1
        self._latest_version = 0
        self._view: Sequence[RoutableTrajectory] = ()

    # -- what the drivers call ------------------------------------------------------------

    def occupy(self, finished: Iterable[FinishedLike]) -> None:
        """Trajectories the TS now holds as completed: Occupy their groups (§4.2), and
        tell Seer's length context (if on) how long they were."""
        context = self.coordinator.strategies.seer
        for f in finished:
            if context is not None:
                context.finished(f.group_id, f.traj_id, f.response_len)
            outcome = self.manager.complete(f.group_id, f.traj_id)
            if self.on_decision is not None:
                self.on_decision(Occupied(self._clock(), f.group_id, f.traj_id, outcome))
            if outcome.abort_trajectories or outcome.abort_groups:
                self._drop(outcome.abort_trajectories, outcome.abort_groups)

    def consume(self) -> ConsumedBatch | None:
        """Consume the trainer's buffer if it is Ready (None otherwise)."""
        if not self.manager.is_ready():
            return None
        batch = self.manager.consume()
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
