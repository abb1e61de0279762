"""A throwaway copy of the admission state for one coordinator cycle."""

from __future__ import annotations

from collections.abc import Callable

from staleness.errors import StalenessError, StalenessViolation
from staleness.feasibility import AdmissionCounts
from staleness.types import GroupId, Outcome, TrajId

_EMPTY = Outcome()
CLOSED = -1  # what ``parent_group`` reports for a group that takes no more members


def check_v_traj(v_traj: object) -> None:
    """The one argument check of ``verify`` and ``reserve``: versions are counts."""
    if isinstance(v_traj, bool) or not isinstance(v_traj, int) or v_traj < 0:
        raise StalenessError(f"V_traj must be a non-negative int, got {v_traj!r}")


def admits(
    counts: AdmissionCounts,
    group_version: Callable[[GroupId], int | None],
    v_traj: int,
    group_id: GroupId | None,
) -> bool:
    """The admission rule shared by the manager and its sketches.

    ``group_version`` gives a tracked group's version, ``CLOSED`` for a group that takes no
    more members, or None for an unknown group.
    """
    check_v_traj(v_traj)
    if v_traj > counts.version:
        raise StalenessError(
            f"V_traj={v_traj} is newer than the trainer's version {counts.version}: "
            "no instance can hold a policy that has not been trained yet"
        )
    if group_id is not None:
        gv = group_version(group_id)
        if gv == CLOSED:
            return False
        if gv is not None:
            return v_traj >= gv or counts.admissible_lowering(gv, v_traj)
    return counts.admissible(v_traj)


class Sketch:
    """Verify/reserve against a copy of the counts; the real manager is never touched.

    Group versions are looked up in the parent (``group_version``) unless this sketch
    reserved the group itself. A sketch is valid until its parent changes.
    """

    __slots__ = ("_counts", "_groups", "_parent_group")

    def __init__(
        self,
        counts: AdmissionCounts,
        parent_group: Callable[[GroupId], int | None],
        groups: dict[GroupId, int] | None = None,
    ) -> None:
        self._counts = counts
        self._parent_group = parent_group
        self._groups: dict[GroupId, int] = {} if groups is None else groups

    @property
    def version(self) -> int:
        return self._counts.version

    @property
    def eta(self) -> int:
        return self._counts.eta

    @property
    def capacity(self) -> int:
        return self._counts.capacity

    @property
    def tracked(self) -> int:
        return sum(self._counts.reserved) + sum(self._counts.pinned)

    def tracks(self, group_id: GroupId) -> bool:
        return self._group_version(group_id) is not None

    def _group_version(self, group_id: GroupId) -> int | None:
        v = self._groups.get(group_id)
        return v if v is not None else self._parent_group(group_id)

    def verify(self, v_traj: int, group_id: GroupId | None = None) -> bool:
        return admits(self._counts, self._group_version, v_traj, group_id)

    def reserve(self, group_id: GroupId, traj_id: TrajId, v_traj: int) -> Outcome:
        if not self.verify(v_traj, group_id):
            raise StalenessViolation(
                f"cannot reserve group {group_id} with V_traj={v_traj} in this sketch"
            )
        gv = self._group_version(group_id)
        if gv is None:
            self._counts.add_reserved(v_traj)
            self._groups[group_id] = v_traj
        elif v_traj < gv:
            self._counts.add_reserved(gv, -1)
            self._counts.add_reserved(v_traj)
            self._groups[group_id] = v_traj
        return _EMPTY

    def sketch(self) -> Sketch:
        return Sketch(self._counts.copy(), self._parent_group, dict(self._groups))
