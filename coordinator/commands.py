"""The rollout commands of §5.1 / Table 1 as typed values, and their completion reports."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from coordinator.types import InstanceId
from staleness.types import GroupId, TrajId


class Reservation(NamedTuple):
    """``V_traj`` assigned to an initial trajectory by a Route; the executor Reserves it.

    A named tuple rather than a frozen dataclass: a cold-start cycle creates thousands."""

    group_id: GroupId
    traj_id: TrajId
    v_traj: int


@dataclass(frozen=True, slots=True)
class Pull:
    """Instance ``inst`` loads the PS's latest weights.

    ``version`` is the PS version the decision saw; the instance may end up with a newer
    one if the PS moved meanwhile (reported in :class:`CommandDone`).
    """

    inst: InstanceId
    version: int


@dataclass(frozen=True, slots=True)
class Route:
    """Hand trajectories ``trajs`` from the TS to instance ``inst``, in this order.

    ``reservations`` covers the initial trajectories among ``trajs``: their ``V_traj`` is
    fixed by this decision and must be Reserved with the staleness manager. Partial
    trajectories keep the ``V_traj`` they were reserved with.
    """

    inst: InstanceId
    trajs: tuple[TrajId, ...]
    reservations: tuple[Reservation, ...] = ()


@dataclass(frozen=True, slots=True)
class Interrupt:
    """Stop ``trajs`` on ``inst`` and return their partial state to the TS."""

    inst: InstanceId
    trajs: tuple[TrajId, ...]


@dataclass(frozen=True, slots=True)
class Abort:
    """Stop ``trajs`` on ``inst`` and drop them for good (they do not return to the TS)."""

    inst: InstanceId
    trajs: tuple[TrajId, ...]


Command = Pull | Route | Interrupt | Abort


@dataclass(frozen=True, slots=True)
class CommandDone:
    """An executor's report that ``command`` has taken effect, and how far.

    ``missed``: trajectories the command could not act on (an Interrupt or Abort of a
    trajectory that had already completed; a Route of a trajectory the TS no longer had
    or whose Reserve the staleness manager refused by then). ``loaded_version``: for a
    Pull, the version actually loaded.
    """

    command: Command
    missed: tuple[TrajId, ...] = ()
    loaded_version: int | None = None
