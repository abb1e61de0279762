"""The trajectory server's whole public API, as one protocol.

Written three times: the in-process core (:class:`~trajectory_server.server.TrajectoryServer`),
the bytes service the Ray actor runs and its blocking client (``actor.py``).
``tests/trajectory_server/test_ts_api_contract.py`` checks all three against
:class:`TrajectoryServerApi`, and each caller's narrower protocol (``RoutingServer``,
``TrajectoryStore``, ``BatchSource``, ...) against it, so a method added or renamed in one
place fails there. What each method does is documented on the core.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from trajectory_server.types import (
    AbortedTrajectory,
    Completion,
    FinishedTrajectory,
    GroupStatus,
    InfoValue,
    InstanceId,
    LiveTrajectory,
    NextTurn,
    PartialTrajectory,
    RewardTask,
    RoutableTrajectory,
    RoutedTrajectory,
    SiblingResponses,
    TrainingBatch,
    TrajState,
    TSStats,
    WorkerId,
)

# The core's public names outside the API, each with why: the contract test keeps this list
# and the core's public methods in step.
IN_PROCESS_ONLY: Mapping[str, str] = {
    "config": "the caller built the server from it; the actor's caller holds its own copy",
    "restore": "a constructor; the actor restores by taking the state at spawn",
}


class TrajectoryServerApi(Protocol):
    """Every call the runtime, the trainer and the simulator make on the TS."""

    # -- reading --------------------------------------------------------------------

    def routing_view(self) -> Sequence[RoutableTrajectory]: ...

    def state_of(self, traj_id: int) -> TrajState: ...

    def group_members(self, group_id: int) -> tuple[int, ...]: ...

    def group_status(self, group_id: int) -> GroupStatus: ...

    def ledger(self) -> tuple[LiveTrajectory, ...]: ...

    def routed_to(self, instance_id: InstanceId) -> tuple[int, ...]: ...

    def group_responses(
        self,
        known: Mapping[int, Mapping[int, int]],
        instance_id: InstanceId | None = None,
        watch: Iterable[int] = (),
    ) -> SiblingResponses: ...

    def tool_waits(self) -> tuple[tuple[RoutableTrajectory, InstanceId], ...]: ...

    def stats(self) -> TSStats: ...

    def env_states(self, traj_ids: Iterable[int]) -> dict[int, bytes]: ...

    # -- the rollout side -----------------------------------------------------------

    def refill(self) -> tuple[int, ...]: ...

    def route(
        self,
        traj_ids: Iterable[int],
        v_traj: int | Mapping[int, int] | None,
        instance_id: InstanceId,
        *,
        skip_unavailable: bool = False,
    ) -> tuple[RoutedTrajectory, ...]: ...

    def fork(self, traj_id: int, instance_id: InstanceId) -> RoutedTrajectory | None: ...

    def interrupt_return(
        self, partials: Iterable[PartialTrajectory], *, instance_id: InstanceId | None = None
    ) -> None: ...

    def report_progress(
        self, partials: Iterable[PartialTrajectory], instance_id: InstanceId
    ) -> tuple[int, ...]: ...

    def requeue(self, traj_ids: Iterable[int]) -> None: ...

    def instance_lost(self, instance_id: InstanceId) -> tuple[int, ...]: ...

    # -- rewards and turns ----------------------------------------------------------

    def hand_to_reward(
        self,
        finished: Iterable[FinishedTrajectory],
        worker_id: WorkerId,
        *,
        instance_id: InstanceId | None = None,
    ) -> None: ...

    def next_turn(self, turns: Iterable[NextTurn], *, worker_id: WorkerId) -> None: ...

    def reassign_rewards(
        self, from_worker: WorkerId | None, to_worker: WorkerId | None
    ) -> tuple[RewardTask, ...]: ...

    def complete(
        self,
        traj_id: int,
        tokens: np.ndarray,
        logprobs: np.ndarray,
        versions: np.ndarray,
        reward: float,
        finish_reason: str,
        info: Mapping[str, InfoValue] | None = None,
        mask: np.ndarray | None = None,
    ) -> GroupStatus: ...

    def complete_many(
        self,
        completions: Iterable[Completion],
        *,
        instance_id: InstanceId | None = None,
        worker_id: WorkerId | None = None,
    ) -> tuple[GroupStatus, ...]: ...

    # -- the trainer ----------------------------------------------------------------

    def take_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
        read: Iterable[int] = (),
    ) -> TrainingBatch: ...

    def read_batch(
        self,
        group_ids: Iterable[int],
        select: Mapping[int, Sequence[int]] | None = None,
    ) -> TrainingBatch: ...

    # -- dropping -------------------------------------------------------------------

    def abort(self, traj_ids: Iterable[int]) -> tuple[AbortedTrajectory, ...]: ...

    def abort_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]: ...

    def filter_group(self, group_id: int) -> tuple[AbortedTrajectory, ...]: ...

    # -- checkpoints ----------------------------------------------------------------

    def export_state(self) -> dict[str, Any]: ...
