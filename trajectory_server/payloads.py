"""The frozen payloads the server hands out, built from its records (``records.py``):
what an instance continues from, what a reward worker scores and what the trainer
receives. Each carries the whole response so far: tokens, logprobs, versions and the
loss mask (``types.py``)."""

from __future__ import annotations

from collections.abc import Sequence

from trajectory_server.records import GroupRecord, TrajRecord
from trajectory_server.types import (
    RewardTask,
    RoutedTrajectory,
    TrainingGroup,
    TrainingTrajectory,
)


def routed(traj: TrajRecord) -> RoutedTrajectory:
    g = traj.group
    return RoutedTrajectory(
        traj.traj_id,
        g.group_id,
        traj.v_traj,  # type: ignore[arg-type]  # ROUTED implies set
        g.sample_id,
        g.answer,
        g.prompt,
        traj.tokens,
        traj.logprobs,
        traj.versions,
        traj.mask,
    )


def reward_task(traj: TrajRecord) -> RewardTask:
    g = traj.group
    return RewardTask(
        traj_id=traj.traj_id,
        group_id=g.group_id,
        v_traj=traj.v_traj,  # type: ignore[arg-type]  # REWARDING implies set
        sample_id=g.sample_id,
        answer=g.answer,
        prompt=g.prompt,
        tokens=traj.tokens,
        logprobs=traj.logprobs,
        versions=traj.versions,
        finish_reason=traj.finish_reason,
        mask=traj.mask,
        env_state=traj.env_state,
    )


def training_group(group: GroupRecord, taken: Sequence[TrajRecord]) -> TrainingGroup:
    trajectories = tuple(
        TrainingTrajectory(
            traj_id=t.traj_id,
            v_traj=t.v_traj,  # type: ignore[arg-type]  # COMPLETED implies set
            tokens=t.tokens,
            logprobs=t.logprobs,
            versions=t.versions,
            reward=t.reward,
            finish_reason=t.finish_reason,
            info=t.info,
            mask=t.mask,
        )
        for t in taken
    )
    return TrainingGroup(
        group_id=group.group_id,
        sample_id=group.sample_id,
        answer=group.answer,
        prompt=group.prompt,
        trajectories=trajectories,
    )
