"""The control actor as the trainer and the reward workers reach it: the
:class:`~staleflow.runtime.interface.ControlHandle` over its Ray handle.

The worker actors' own client of the control actor; the driver's and the dashboard's are
in :mod:`staleflow.runtime.controller.clients` (this package may not import that one).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, TypeVar

from staleflow.runtime.interface import Rewarded, StepReport, StopRequested, TrainerGroups
from staleflow.runtime.placement.ray_cluster import RayApi, import_ray
from staleness.types import ConsumedBatch
from trajectory_server.types import AbortedTrajectory

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray.actor import ActorHandle

T = TypeVar("T")


class WorkerControl:
    """``ControlHandle`` over the ``ControlActor``'s Ray handle; every call waits for
    the answer, and a Consume refused because the run stops is ``StopRequested``."""

    def __init__(self, handle: ActorHandle, ray: RayApi | None = None) -> None:
        self._ray: RayApi = ray if ray is not None else import_ray()
        self.handle = handle  # the ControlActor's (typed there; this package cannot name it)

    def rewarded(self, records: Sequence[Rewarded]) -> None:
        self._ray.get(self.handle.rewarded.remote(list(records)))

    def consume(self, version: int, timeout_s: float | None = None) -> ConsumedBatch:
        return self._stoppable(self.handle.consume.remote(version, timeout_s))

    def trainer_groups(self, version: int, have: int, wait_s: float) -> TrainerGroups:
        return self._stoppable(self.handle.trainer_groups.remote(version, have, wait_s))

    def _stoppable(self, ref: ObjectRef[T]) -> T:
        try:
            return self._ray.get(ref)
        except self._ray.exceptions.RayTaskError as exc:
            if isinstance(getattr(exc, "cause", None), StopRequested):
                raise StopRequested(str(exc.cause)) from exc
            raise

    def dropped(self, trajectories: Iterable[AbortedTrajectory]) -> None:
        self._ray.get(self.handle.dropped.remote(list(trajectories)))

    def trained(self, report: StepReport) -> None:
        self._ray.get(self.handle.trained.remote(report))
