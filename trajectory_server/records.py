"""The server's mutable records of live groups and trajectories (internal to the package).

``server.py`` changes them through its transitions; ``persist.py`` reads and rebuilds them
for checkpoints. Nothing outside ``trajectory_server`` sees these records: callers get the
frozen payloads of ``types.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

from trajectory_server.errors import InvalidTransition
from trajectory_server.types import (
    InfoValue,
    InstanceId,
    LiveTrajectory,
    RoutableTrajectory,
    TrajState,
)

QUEUED, ROUTED, REWARDING, COMPLETED = (
    TrajState.QUEUED,
    TrajState.ROUTED,
    TrajState.REWARDING,
    TrajState.COMPLETED,
)


def _empty(dtype: type) -> np.ndarray:
    arr = np.empty(0, dtype=dtype)
    arr.flags.writeable = False
    return arr


NO_TOKENS, NO_LOGPROBS, NO_MASK = _empty(np.int32), _empty(np.float32), _empty(np.bool_)


class GroupRecord:
    __slots__ = ("answer", "completed", "group_id", "members", "prompt", "sample_id")

    def __init__(self, group_id: int, sample_id: int, answer: str, prompt: np.ndarray) -> None:
        self.group_id = group_id
        self.sample_id = sample_id
        self.answer = answer
        self.prompt = prompt
        self.members: dict[int, TrajRecord] = {}  # creation (= id) order
        self.completed = 0


class TrajRecord:
    """One live trajectory. ``tokens``/``logprobs``/``versions``/``mask``: the longest
    response known to the TS (routed, last reported progress, interrupted, finished or completed).
    ``holder``: the instance it is ROUTED to, or the reward worker scoring it (REWARDING;
    None while no worker has it, e.g. after its worker was lost or after a restore)."""

    __slots__ = (
        "env_state",
        "finish_reason",
        "group",
        "holder",
        "info",
        "logprobs",
        "mask",
        "reward",
        "state",
        "tokens",
        "traj_id",
        "turned_on",
        "v_traj",
        "versions",
    )

    def __init__(self, traj_id: int, group: GroupRecord) -> None:
        self.traj_id = traj_id
        self.group = group
        self.state = QUEUED
        self.v_traj: int | None = None
        self.tokens = NO_TOKENS
        self.logprobs = NO_LOGPROBS
        self.versions = NO_TOKENS
        self.mask = NO_MASK  # True: a model token (trained); False: an observation
        self.holder: InstanceId | None = None
        self.reward = 0.0
        self.finish_reason = ""
        self.info: Mapping[str, InfoValue] = {}
        # a multi-turn trajectory's environment, packed plain data (b"": not started); the
        # TS keeps it opaque, so that it survives instances, workers and restarts
        self.env_state = b""
        # the instance its last model turn ended on (hand_to_reward), for the coordinator's
        # view of tool waits (TrajectoryServer.tool_waits); not persisted
        self.turned_on: InstanceId | None = None

    def record(self) -> RoutableTrajectory:
        prompt_len = len(self.group.prompt)
        return RoutableTrajectory(
            self.traj_id,
            self.group.group_id,
            self.v_traj,
            prompt_len + len(self.tokens),
            prompt_len,
        )

    def live(self) -> LiveTrajectory:
        graded = self.state is COMPLETED and "reward_error" not in self.info
        return LiveTrajectory(
            self.traj_id,
            self.group.group_id,
            self.state,
            self.v_traj,
            self.holder,
            len(self.tokens),
            self.reward if graded else None,
        )

    def describe(self) -> str:
        where = ""
        if self.state is ROUTED:
            where = f" on instance {self.holder!r}"
        elif self.state is REWARDING:
            where = f" with reward worker {self.holder!r}"
        return (
            f"trajectory {self.traj_id} (group {self.group.group_id}) is {self.state.name}{where}"
        )


def unique(ids: Iterable[int], what: str) -> list[int]:
    out = list(ids)
    if len(set(out)) != len(out):
        dup = next(i for i in out if out.count(i) > 1)
        raise InvalidTransition(f"{what} lists id {dup} more than once")
    return out
