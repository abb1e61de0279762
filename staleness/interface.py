"""The staleness manager's contract as its callers see it (no logic).

The coordinator only needs :class:`AdmissionControl`; the reward path and the trainer
use the rest of :class:`StalenessManager` (``staleness.manager``).

Invariants every implementation keeps:
- every tracked group ``g`` can be placed in a buffer ``b`` with
  ``max(V_g, version) <= b <= V_g + eta``, with at most ``buffer_capacity`` entries and
  at most ``batch_size`` occupied entries per buffer;
- ``verify`` never changes state, and ``reserve`` succeeds exactly when ``verify`` said so;
- a failed call raises a :class:`staleness.errors.StalenessError` and changes nothing.
"""

from __future__ import annotations

from typing import Protocol

from staleness.types import GroupId, Outcome, TrajId


class AdmissionControl(Protocol):
    """What routing needs: may a trajectory start with this ``V_traj``, and record it."""

    @property
    def version(self) -> int:
        """The trainer's version: the buffer it consumes next."""
        ...

    def verify(self, v_traj: int, group_id: GroupId | None = None) -> bool:
        """Would ``reserve(group_id, _, v_traj)`` succeed? Pure; O(1) amortised.

        A ``v_traj`` that is not an int >= 0 raises ``StalenessError``, as in ``reserve``.
        """
        ...

    def reserve(self, group_id: GroupId, traj_id: TrajId, v_traj: int) -> Outcome:
        """Record that trajectory ``traj_id`` of ``group_id`` starts with ``V_traj = v_traj``.

        The first trajectory of a group creates its reserved entry; later ones lower the
        group's version to ``min(V_group, v_traj)``. Raises ``StalenessViolation`` when
        ``verify`` would have returned False.
        """
        ...


class AdmissionSketch(AdmissionControl, Protocol):
    """A scratch copy of the admission state for one decision cycle.

    Strategies route against a sketch (``StalenessManager.sketch()``): its ``reserve``
    updates only the sketch, so later decisions in the same cycle see earlier ones, and
    tentative routing (the synchronisation strategy) can run on a throwaway sketch. The
    executor then applies the chosen Routes to the real manager with ``reserve``.
    Creating a sketch costs O(eta), not O(tracked groups).
    """

    def sketch(self) -> AdmissionSketch:
        """A further copy of this sketch (for tentative decisions)."""
        ...

    # What pacing admission needs (``coordinator.freshness``): how far ahead of the trainer
    # the tracked groups already reach, and whether a group is new.

    @property
    def eta(self) -> int:
        """The staleness bound."""
        ...

    @property
    def capacity(self) -> int:
        """Entries per buffer (``batch_size`` x (1 + batch redundancy))."""
        ...

    @property
    def tracked(self) -> int:
        """Groups in the window (occupied and reserved, this sketch's reserves included):
        they fill buffers from the trainer's on, so a new group goes to buffer
        ``version + tracked // capacity`` or later."""
        ...

    def tracks(self, group_id: GroupId) -> bool:
        """Has ``group_id`` a reserved or occupied entry (or has it left for good)? False
        for a group no member of which was ever admitted."""
        ...
