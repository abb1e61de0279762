"""The bookkeeping of the groups the staleness manager tracks (``staleness.manager``).

Reserved group ids per version and occupied ones per buffer, in two rings kept in arrival
order, beside their counts (``staleness.feasibility``), and the entry movement that packs
occupied groups into earlier buffers (Figure 7 right, Figure 8c). No locking and no
protocol decisions here: the manager holds its lock around every call.
"""

from __future__ import annotations

from staleness.errors import NotReserved
from staleness.feasibility import AdmissionCounts
from staleness.types import GroupId, TrajId

REMEMBER_CLOSED = 1 << 16  # aborted and consumed ids kept to recognise late messages


class TrackedGroup:
    __slots__ = ("buffer", "completed", "dropped", "members", "version")

    def __init__(self, version: int) -> None:
        self.version = version  # min V_traj over the members that count
        self.members: dict[TrajId, int] = {}  # reserved trajectories -> V_traj
        self.completed: list[TrajId] = []
        self.dropped = 0  # members aborted one by one
        self.buffer: int | None = None  # the buffer an occupied group is committed to


class GroupTracker:
    """Where every tracked group is, for buffers ``version .. version + eta``."""

    def __init__(self, eta: int, batch_size: int, capacity: int, version: int) -> None:
        self._n = eta + 1
        self._counts = AdmissionCounts(eta, batch_size, capacity, version)
        self._groups: dict[GroupId, TrackedGroup] = {}
        # Reserved group ids per version and occupied ones per buffer (rings, arrival order).
        self._reserved: list[dict[GroupId, None]] = [{} for _ in range(self._n)]
        self._pinned: list[dict[GroupId, None]] = [{} for _ in range(self._n)]
        # Groups that left for good (aborted, filtered or consumed): a late message about
        # one is discarded, and a Reserve for one refused, instead of tracking it anew.
        self._closed: dict[GroupId, None] = {}
        self.aborted_groups = 0

    @property
    def version(self) -> int:
        """The trainer's version: the buffer it consumes next."""
        return self._counts.version

    def _add_reserved(self, gid: GroupId, v: int) -> None:
        self._reserved[v % self._n][gid] = None
        self._counts.add_reserved(v)

    def _remove_reserved(self, gid: GroupId, v: int) -> None:
        del self._reserved[v % self._n][gid]
        self._counts.add_reserved(v, -1)

    def _check_running(self, gid: GroupId, group: TrackedGroup | None, traj_id: TrajId) -> None:
        if group is None or traj_id not in group.members or traj_id in group.completed:
            raise NotReserved(f"trajectory {traj_id} of group {gid} is not a running member")
        if group.buffer is not None:
            raise NotReserved(f"trajectory {traj_id}: group {gid} is already occupied")

    def _rereserve(self, gid: GroupId, group: TrackedGroup) -> bool:
        """After a member left: the group's version is the min of those left (it only
        ever rises, which only relaxes). True if it moved."""
        new_v = min(group.members.values())
        if new_v == group.version:
            return False
        self._remove_reserved(gid, group.version)
        self._add_reserved(gid, new_v)
        group.version = new_v
        return True

    def _pin(self, gid: GroupId, group: TrackedGroup, buffer: int) -> None:
        group.buffer = buffer
        self._pinned[buffer % self._n][gid] = None
        self._counts.add_pinned(buffer)

    def _unpin(self, gid: GroupId, group: TrackedGroup) -> None:
        assert group.buffer is not None
        del self._pinned[group.buffer % self._n][gid]
        self._counts.add_pinned(group.buffer, -1)
        group.buffer = None

    def _untrack(self, gid: GroupId, group: TrackedGroup) -> None:
        if group.buffer is not None:
            self._unpin(gid, group)
        else:
            self._remove_reserved(gid, group.version)
        self._forget(gid)

    def _forget(self, gid: GroupId) -> None:
        del self._groups[gid]
        self._close(gid)
        self.aborted_groups += 1

    def _close(self, gid: GroupId) -> None:
        self._closed[gid] = None
        if len(self._closed) > REMEMBER_CLOSED:
            del self._closed[next(iter(self._closed))]

    def _repacked(self) -> list[int]:
        layout = self._counts.repack()
        if layout is None:
            raise AssertionError("occupied groups no longer fit: the invariant is broken")
        return layout

    def _apply_layout(self, target: list[int]) -> None:
        """Move occupied groups earlier until buffer ``j`` holds ``target[j]`` of them,
        pulling from the nearest later buffers in arrival order."""
        n, base = self._n, self.version
        if target == self._counts.pinned_by_buffer():
            return
        for j in range(n):
            here = self._pinned[(base + j) % n]
            src = j + 1
            while len(here) < target[j]:
                while not self._pinned[(base + src) % n]:
                    src += 1
                    if src >= n:
                        raise AssertionError("repack asked for more occupied groups than exist")
                gid = next(iter(self._pinned[(base + src) % n]))
                group = self._groups[gid]
                self._unpin(gid, group)
                self._pin(gid, group, base + j)
