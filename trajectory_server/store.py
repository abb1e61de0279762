"""The indexes of the trajectory server: live records, counts per state and the MLQ.

``TrajectoryStore`` keeps the records (``records.py``), the multi-level queue and the
per-state counts consistent with each other; it validates nothing else. The public
transitions, and every check of their input, are in ``server.py``; checkpoints
(``persist.py``) rebuild a store record by record with ``insert``.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from trajectory_server import validate
from trajectory_server.errors import (
    GroupGone,
    InvalidPayload,
    TrajectoryGone,
    UnknownGroup,
    UnknownTrajectory,
)
from trajectory_server.mlq import MultiLevelQueue
from trajectory_server.records import (
    COMPLETED,
    QUEUED,
    REWARDING,
    ROUTED,
    GroupRecord,
    TrajRecord,
)
from trajectory_server.types import AbortedTrajectory, InstanceId, TrajState, TSStats


class TrajectoryStore:
    def __init__(self) -> None:
        self.trajs: dict[int, TrajRecord] = {}
        self.groups: dict[int, GroupRecord] = {}
        self.mlq = MultiLevelQueue()
        # live trajectories per state and V_traj (None: initial), for stats() in O(levels)
        self.counts: dict[TrajState, Counter[int | None]] = {s: Counter() for s in TrajState}
        self.next_traj = 0
        self.next_group = 0
        self.consumed_trajs = self.aborted_trajs = 0
        self.consumed_groups = self.aborted_groups = 0
        self.filtered_trajs = self.filtered_groups = 0  # dynamic sampling's drops
        self.exhausted = False
        # instances declared lost (``instance_lost``): a Route to one is refused, so a
        # message it sent before it died cannot strand trajectories on it afterwards
        self.lost: set[InstanceId] = set()

    # -- lookups ------------------------------------------------------------------------

    def lookup(self, traj_id: int) -> TrajRecord:
        traj = self.trajs.get(traj_id)
        if traj is not None:
            return traj
        if isinstance(traj_id, int | np.integer) and 0 <= traj_id < self.next_traj:
            raise TrajectoryGone(
                f"trajectory {traj_id} was already consumed or aborted; drop this late message"
            )
        raise UnknownTrajectory(f"trajectory {traj_id!r} was never created by this server")

    def group(self, group_id: int) -> GroupRecord:
        group = self.groups.get(group_id)
        if group is None:
            if isinstance(group_id, int | np.integer) and 0 <= group_id < self.next_group:
                raise GroupGone(f"group {group_id} was already consumed or aborted")
            raise UnknownGroup(f"group {group_id!r} was never created by this server")
        return group

    def routed_to(self, instance_id: InstanceId) -> tuple[int, ...]:
        return tuple(
            t.traj_id for t in self.trajs.values() if t.state is ROUTED and t.holder == instance_id
        )

    def stats(self, capacity: int) -> TSStats:
        def by_v(state: TrajState) -> dict[int, int]:
            return dict(sorted((v, n) for v, n in self.counts[state].items() if v is not None))

        return TSStats(
            capacity_groups=capacity,
            groups=len(self.groups),
            queued=self.counts[QUEUED].total(),
            routed=self.counts[ROUTED].total(),
            completed=self.counts[COMPLETED].total(),
            rewarding=self.counts[REWARDING].total(),
            initial=self.counts[QUEUED][None],
            queued_by_v=by_v(QUEUED),
            routed_by_v=by_v(ROUTED),
            completed_by_v=by_v(COMPLETED),
            created_trajectories=self.next_traj,
            consumed_trajectories=self.consumed_trajs,
            aborted_trajectories=self.aborted_trajs,
            created_groups=self.next_group,
            consumed_groups=self.consumed_groups,
            aborted_groups=self.aborted_groups,
            dataset_exhausted=self.exhausted,
            filtered_trajectories=self.filtered_trajs,
            filtered_groups=self.filtered_groups,
        )

    # -- changes ------------------------------------------------------------------------

    def add_group(self, sample_id: int, answer: str, prompt_ids: object, size: int) -> int:
        """A new group of ``size`` initial trajectories at the back of the queue."""
        group = GroupRecord(
            self.next_group, int(sample_id), str(answer), as_prompt(prompt_ids, sample_id)
        )
        self.next_group += 1
        self.groups[group.group_id] = group
        for _ in range(size):
            traj = TrajRecord(self.next_traj, group)
            self.next_traj += 1
            self.insert(traj)
        return group.group_id

    def insert(self, traj: TrajRecord) -> None:
        """Index a record whose fields are all set (its group is in ``groups``)."""
        traj.group.members[traj.traj_id] = traj
        self.trajs[traj.traj_id] = traj
        self.counts[traj.state][traj.v_traj] += 1
        if traj.state is QUEUED:
            self.mlq.push(traj.record())
        elif traj.state is COMPLETED:
            traj.group.completed += 1

    def set_state(self, traj: TrajRecord, state: TrajState, v: int | None) -> None:
        self._uncount(traj)
        self.counts[state][v] += 1
        traj.state, traj.v_traj = state, v

    def requeue(self, traj: TrajRecord) -> None:
        """Back to the end of its MLQ level with the response it has; ``V_traj`` is kept."""
        traj.holder = None
        self.set_state(traj, QUEUED, traj.v_traj)
        self.mlq.push(traj.record())

    def drop(self, traj: TrajRecord) -> AbortedTrajectory:
        """Forget one trajectory (the caller does the consumed/aborted accounting)."""
        if traj.state is QUEUED:
            self.mlq.remove(traj.traj_id, traj.v_traj)
        elif traj.state is COMPLETED:
            traj.group.completed -= 1
        self._uncount(traj)
        del self.trajs[traj.traj_id]
        del traj.group.members[traj.traj_id]
        on_instance = traj.holder if traj.state is ROUTED else None
        return AbortedTrajectory(traj.traj_id, traj.group.group_id, traj.state, on_instance)

    def drop_filtered(self, group: GroupRecord) -> tuple[AbortedTrajectory, ...]:
        """Forget a group dynamic sampling filtered out, counted as filtered."""
        out = tuple(self.drop(t) for t in list(group.members.values()))
        del self.groups[group.group_id]
        self.filtered_trajs += len(out)
        self.filtered_groups += 1
        return out

    def _uncount(self, traj: TrajRecord) -> None:
        counts = self.counts[traj.state]
        counts[traj.v_traj] -= 1
        if not counts[traj.v_traj]:
            del counts[traj.v_traj]  # versions come and go; keep stats() O(live levels)


def as_prompt(prompt_ids: object, sample_id: object = "?") -> np.ndarray:
    """A prompt as a read-only int32 array (shared by its group's trajectories and every
    payload, so it must not change)."""
    prompt = np.asarray(prompt_ids)
    if prompt.ndim != 1 or len(prompt) == 0 or prompt.dtype.kind not in "iu":
        raise InvalidPayload(
            f"sample {sample_id}: prompt_ids must be a non-empty 1-D integer array, got "
            f"shape {prompt.shape} dtype {prompt.dtype}; fix the prompt source"
        )
    return validate.frozen(prompt.astype(np.int32, copy=False))
