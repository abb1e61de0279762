"""Aborts requested by the staleness manager (footnote 2 of §5.1, redundancy in §4.3).

They go through the coordinator so that the speculative state counts them (Table 1) and
so that the routing of the same cycle no longer sees the dropped trajectories.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from coordinator.fleet import Fleet
from coordinator.types import TrajectoryView
from staleness.types import GroupId, TrajId


class AbortRequests:
    """Trajectories and whole groups to drop, kept until no instance and no TS view holds
    them any more."""

    __slots__ = ("groups", "trajs")

    def __init__(self) -> None:
        self.trajs: set[TrajId] = set()
        self.groups: set[GroupId] = set()

    def add(self, trajs: Iterable[TrajId] = (), groups: Iterable[GroupId] = ()) -> None:
        self.trajs.update(trajs)
        self.groups.update(groups)

    def __bool__(self) -> bool:
        return bool(self.trajs or self.groups)

    def on_instances(self, fleet: Fleet) -> list[tuple[int, tuple[TrajectoryView, ...]]]:
        """(position, trajectories) to Abort: requested trajectories in run + wait."""
        out = []
        for pos in range(len(fleet)):
            hit = tuple(
                t
                for t in fleet.trajectories(pos)
                if t.traj_id in self.trajs or t.group_id in self.groups
            )
            if hit:
                out.append((pos, hit))
        return out

    def retain_listed(self, ts_trajs: Sequence[TrajectoryView]) -> None:
        """Forget requests the TS no longer lists (whatever was on an instance was just
        aborted; anything else has left the rollout path)."""
        trajs: set[TrajId] = set()
        groups: set[GroupId] = set()
        for t in ts_trajs:
            if t.traj_id in self.trajs:
                trajs.add(t.traj_id)
            if t.group_id in self.groups:
                groups.add(t.group_id)
        self.trajs, self.groups = trajs, groups
