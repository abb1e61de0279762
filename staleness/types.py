"""Plain data exchanged with the staleness manager (the contract; no logic beyond
:class:`StalenessConfig` refusing settings the protocol cannot hold).

Vocabulary (paper §4):
- ``V_traj``: the oldest policy version tolerated over a trajectory's whole generation.
- A *group* is the unit of a buffer entry. With group size ``G = 1`` a group is one
  trajectory. The group's version is the minimum ``V_traj`` of its members (§4.3).
- Buffer ``V_buf`` holds the groups the trainer consumes when it moves the policy from
  version ``V_buf`` to ``V_buf + 1``. Every entry satisfies
  ``V_traj <= V_buf <= V_traj + eta``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from staleness.bounds import config_problem
from staleness.errors import InvalidConfig

GroupId = int
TrajId = int


class BufferState(enum.StrEnum):
    """The three buffer states of §4.2."""

    WAITING = "waiting"  # has empty entries: Reserve may still land here
    READY = "ready"  # ``batch_size`` occupied entries: the trainer may Consume it
    STUCK = "stuck"  # full, but at least one entry is still reserved (in flight)


class EntryKind(enum.StrEnum):
    RESERVED = "reserved"
    OCCUPIED = "occupied"


@dataclass(frozen=True, slots=True)
class Entry:
    group_id: GroupId
    version: int  # the group's V (min V_traj of its members)
    kind: EntryKind


@dataclass(frozen=True, slots=True)
class BufferView:
    """One virtual staleness buffer as the dashboard draws it."""

    version: int  # V_buf
    state: BufferState
    capacity: int  # entry slots (batch_size x (1 + batch redundancy))
    entries: tuple[Entry, ...]

    @property
    def occupied(self) -> int:
        return sum(1 for e in self.entries if e.kind is EntryKind.OCCUPIED)

    @property
    def reserved(self) -> int:
        return sum(1 for e in self.entries if e.kind is EntryKind.RESERVED)


@dataclass(frozen=True, slots=True)
class ManagerView:
    """Introspection of the whole manager (buffers ``version .. version + eta``)."""

    eta: int
    batch_size: int
    group_size: int
    version: int  # the trainer's version: the next buffer it consumes
    buffers: tuple[BufferView, ...]
    reserved_groups: int
    occupied_groups: int
    consumed_batches: int
    aborted_groups: int
    filtered_groups: int = 0  # occupied groups a filter dropped (dynamic sampling)


@dataclass(frozen=True, slots=True)
class ConsumedGroup:
    group_id: GroupId
    version: int  # the group's V
    trajectories: tuple[TrajId, ...]  # the G trajectories that make up the group

    def staleness(self, buffer_version: int) -> int:
        return buffer_version - self.version


@dataclass(frozen=True, slots=True)
class ConsumedBatch:
    """What the trainer receives from Consume of buffer ``version``."""

    version: int  # V_buf: the trainer moves the policy from this version to version + 1
    groups: tuple[ConsumedGroup, ...]
    # Reserved groups that could not survive this buffer's consumption (batch-level
    # redundancy surplus): their trajectories must be aborted.
    aborted_groups: tuple[GroupId, ...] = ()

    @property
    def staleness(self) -> tuple[int, ...]:
        return tuple(self.version - g.version for g in self.groups)


@dataclass(frozen=True, slots=True)
class Outcome:
    """Side effects a primitive reports so that the caller can act on them.

    ``occupied``: the group became an occupied entry with its ``kept`` trajectories.
    ``abort_trajectories``: trajectories that are surplus and must be aborted on the
    instances and dropped by the trajectory server (group-level redundancy).
    ``abort_groups``: whole groups that were dropped (batch-level redundancy surplus);
    every trajectory of these groups, routed or not, must be aborted.
    ``ready``: the trainer's buffer is Ready after this call.
    ``filtered``: the group was dropped by a filter (dynamic sampling) with its ``kept``
    trajectories, which are completed and must leave the trajectory server; counted apart
    from aborts (``ManagerView.filtered_groups``).
    """

    occupied: bool = False
    kept: tuple[TrajId, ...] = ()
    abort_trajectories: tuple[TrajId, ...] = ()
    abort_groups: tuple[GroupId, ...] = ()
    ready: bool = False
    discarded: bool = False  # the call concerned a group that had already been aborted
    filtered: bool = False


@dataclass(slots=True)
class StalenessConfig:
    """Configuration of the staleness manager.

    eta: the staleness bound; 0 is synchronous on-policy RL.
    batch_size: groups consumed per training step.
    group_size: trajectories per group that training needs (G).
    batch_redundancy: r_b; a buffer admits ``floor(batch_size * (1 + r_b))`` entries and is
        Ready once ``batch_size`` of them are occupied; the surplus is aborted.
    group_redundancy: r_g; a group may run ``floor(G * (1 + r_g))`` trajectories and is
        complete once ``G`` finished; the surplus is aborted.
    """

    eta: int = 1
    batch_size: int = 1
    group_size: int = 1
    batch_redundancy: float = 0.0
    group_redundancy: float = 0.0

    def __post_init__(self) -> None:
        # refused here, with the protocol's own error, before a ring of eta + 1 buffers
        # is allocated (eta=10**20 raised OverflowError there, 2**62 MemoryError)
        self.check()

    def check(self) -> None:
        """Raise ``InvalidConfig`` for settings the protocol cannot hold (checked again by
        the manager: the fields may have been set since construction)."""
        problem = config_problem(
            self.eta,
            self.batch_size,
            self.group_size,
            self.batch_redundancy,
            self.group_redundancy,
        )
        if problem is not None:
            raise InvalidConfig(problem)

    @property
    def buffer_capacity(self) -> int:
        return int(self.batch_size * (1.0 + self.batch_redundancy) + 1e-9)

    @property
    def group_capacity(self) -> int:
        return int(self.group_size * (1.0 + self.group_redundancy) + 1e-9)
