"""The control plane as a Ray actor (:class:`~staleflow.runtime.controller.control_plane.ControlPlane`
over the run's rollout actors, the TS and the PS replicas).

It runs with several threads: ``consume`` blocks one of them until the buffer is Ready
while ``rewarded`` calls keep arriving on the others. Besides the control loop it is
where the rest of the run meets: the supervisor (in the driver) learns of lost
instances, posts restarts and reads the checkpoint cuts here; ``staleflow scale`` and the
dashboard post elastic-rollout requests; ``staleflow status`` and the dashboard read the
placement, the members and the recovery events.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from coordinator.types import InstanceSnapshot
from staleflow.recovery.events import RecoveryEvent
from staleflow.rewards.estimators import EvalScores
from staleflow.runfolder.step_record import StepRecord
from staleflow.runtime.controller.control_plane import ControlPlane
from staleflow.runtime.interface import InstanceGone, Rewarded, StepReport, TrainerGroups
from staleflow.runtime.placement.ray_cluster import import_ray
from staleflow.runtime.workers.actors import InstanceClient, gone
from staleflow.runtime.workers.ps_healing import HealingVersions
from staleness import StalenessManager
from staleness.types import ConsumedBatch
from trajectory_server.actor import TrajectoryServerClient
from trajectory_server.types import AbortedTrajectory

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from parameter_server.transport.base import Endpoint
    from staleflow.runtime.controller.fleet import LostInstance
    from staleflow.runtime.controller.plane_records import ControlConfig, Cut, LiveState
    from staleflow.runtime.workers.actors import RolloutActor
    from staleflow.runtime.workers.ps_healing import ReplicaResolver
    from trajectory_server.actor import TrajectoryServerService

logger = logging.getLogger(__name__)


class ControlActor:
    def __init__(
        self,
        config: ControlConfig,
        ts_handle: ActorHandle[TrajectoryServerService],
        resolver: ReplicaResolver | None = None,
        snapshot_timeout_s: float = 60.0,
    ) -> None:

        self._config = config
        self._ts = TrajectoryServerClient(ts_handle)
        self._resolver = resolver
        self._snapshot_timeout = snapshot_timeout_s
        self._plane: Any = None
        self._versions: Any = None
        self._placement: dict[str, Any] = {}
        self._scale: int | None = None  # instances asked for by `staleflow scale`

    def attach(
        self,
        instances: Mapping[int, tuple[Any, str]],
        ps_endpoints: Mapping[str, Endpoint],
        versions: Mapping[int, int] | None = None,
        staleness: dict[str, Any] | None = None,
        records: Sequence[Mapping[str, float]] = (),
    ) -> None:
        """Start the loop over the instances (actor handle and holder id each); the PS
        version is the newest that every replica holds (what any instance's Pull gets at
        least). A resumed run passes the restored manager's ``staleness`` state, the
        instances' ``versions`` and the metric ``records`` so far."""

        ray = import_ray()
        clients = {i: InstanceClient(h, i) for i, (h, _) in instances.items()}
        pool = ThreadPoolExecutor(max(4, len(clients)), thread_name_prefix="commands")
        self._versions = HealingVersions(ps_endpoints, self._resolver or _no_resolver)
        timeout = self._snapshot_timeout

        def gather(insts: Sequence[int]) -> list[InstanceSnapshot | InstanceGone]:
            refs = {i: self._plane.members[i].handle.snapshot.remote() for i in insts}
            ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout)
            done = set(ready)
            out: list[InstanceSnapshot | InstanceGone] = []
            for i, ref in refs.items():
                if ref not in done:
                    out.append(InstanceGone(i, f"no snapshot within {timeout:g} s (hung)"))
                    continue
                try:
                    out.append(ray.get(ref))
                except Exception as exc:
                    lost = gone(i, exc)
                    if lost is None:
                        raise
                    out.append(lost)
            return out

        self._plane = ControlPlane(
            self._config,
            ts=self._ts,
            instances=clients,
            holders={i: holder for i, (_, holder) in instances.items()},
            versions=versions,
            ps_version=self._versions.latest,
            gather=gather,
            run_round=lambda actions: list(pool.map(lambda a: a(), actions)),
            manager=None if staleness is None else StalenessManager.restore(staleness),
            records=[StepRecord.from_flat(r) for r in records],
        )
        self._plane.start()

    # -- where the run's actors are ----------------------------------------------------

    def set_placement(self, placement: dict[str, Any]) -> None:
        """Where the run's actors are and how weights travel (``staleflow status`` and the
        dashboard read it from any node)."""
        self._placement = dict(placement)

    def placement(self) -> dict[str, Any]:
        return self._placement

    def members(self) -> dict[int, tuple[str, Any]]:
        """The rollout instances in the run now: holder id and actor handle each."""
        plane = self._plane
        holders = plane.members.holders()
        return {i: (str(h), plane.members[i].handle) for i, h in holders.items()}

    # -- the control loop --------------------------------------------------------------

    def rewarded(self, records: list[Rewarded]) -> None:
        self._plane.rewarded(records)

    def consume(self, version: int, timeout_s: float | None) -> ConsumedBatch:
        return self._plane.consume(version, timeout_s)

    def dropped(self, trajectories: list[AbortedTrajectory]) -> None:
        self._plane.dropped(trajectories)

    def trainer_groups(self, version: int, have: int, wait_s: float) -> TrainerGroups:
        return self._plane.trainer_groups(version, have, wait_s)

    def trained(self, report: StepReport) -> None:
        self._plane.trained(report)

    def records(self, since: int = 0) -> list[StepRecord]:
        return self._plane.records(since)

    def eval_due(self) -> int | None:
        return self._plane.eval_due()

    def eval_done(self, step: int, scores: EvalScores | None) -> None:
        self._plane.eval_done(step, scores)

    def live(self) -> LiveState:
        return self._plane.live()

    def staleness(self) -> dict[int, int]:
        return dict(self._plane.staleness_of_consumed())

    def manager_state(self) -> dict[str, Any]:
        """The staleness manager's state now (a resume test compares it with the one
        written)."""
        return self._plane.manager.export_state()

    # -- recovery ----------------------------------------------------------------------

    def lost(self, inst: int, reason: str) -> None:
        self._plane.lost(inst, reason)

    def settle(self) -> dict[int, Any]:
        """After :meth:`stop`: every member interrupted, the gone ones out of the run with
        their trajectories back in the TS; the members left, by instance."""
        self._plane.settle()
        return {i: h for i, (_, h) in self.members().items()}

    def join(
        self, inst: int, handle: ActorHandle[RolloutActor], holder: str, version: int, kind: str
    ) -> None:
        self._plane.join(inst, InstanceClient(handle, inst), holder, version, kind).result()

    def remove(self, inst: int) -> int:
        return self._plane.remove(inst).result()

    def replay_completions(self) -> int:
        return self._plane.replay_completions().result()

    def take_lost(self) -> list[LostInstance]:
        return self._plane.take_lost()

    def note(self, kind: str, subject: str, detail: str = "", **amounts: float) -> None:
        self._plane.note(kind, subject, detail, **amounts)

    def events(self, since: int = 0) -> list[RecoveryEvent]:
        return self._plane.events(since)

    def request_stop(self) -> None:
        self._plane.request_stop()

    def pending_cut(self) -> Cut | None:
        return self._plane.pending_cut()

    def release_cut(self, steps: int) -> None:
        self._plane.release_cut(steps)

    # -- elastic rollout requests ------------------------------------------------------

    def request_scale(self, instances: int) -> str:
        """Ask for ``instances`` rollout instances (``staleflow scale``, the dashboard);
        the launcher adds or removes them at its next look."""
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 1:
            raise ValueError(f"instances={instances!r}: a run needs at least 1 rollout instance")
        self._scale = instances
        now = len(self._plane.members) if self._plane is not None else 0
        return f"asked for {instances} rollout instances (now {now})"

    def take_scale(self) -> int | None:
        out, self._scale = self._scale, None
        return out

    def stop(self) -> None:
        if self._plane is not None:
            self._plane.stop()
        if self._versions is not None:
            self._versions.close()
            self._versions = None


def _no_resolver(replica: str) -> Endpoint:
    raise RuntimeError(f"PS replica {replica} cannot be found again (no resolver was given)")
