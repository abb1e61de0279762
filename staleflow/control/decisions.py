"""The decisions a control loop takes, as plain values (no logic).

A driver can pass ``on_decision`` to :class:`~staleflow.control.loop.ControlLoop` to see
them; the runtime and the simulator must take the same ones for the same events. ``at``
is the driver's clock (wall or virtual seconds).
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.commands import Command
from staleness.types import ConsumedBatch, GroupId, Outcome, TrajId


@dataclass(frozen=True, slots=True)
class Issued:
    """One snapshot-command cycle ran and issued ``commands`` (none when its snapshot was
    discarded)."""

    at: float
    commands: tuple[Command, ...]


@dataclass(frozen=True, slots=True)
class Occupied:
    """A rewarded trajectory was reported to the staleness manager, with the outcome."""

    at: float
    group_id: GroupId
    traj_id: TrajId
    outcome: Outcome


@dataclass(frozen=True, slots=True)
class Consumed:
    """The trainer's buffer was consumed."""

    at: float
    batch: ConsumedBatch


@dataclass(frozen=True, slots=True)
class Dropped:
    """Trajectories and whole groups dropped (redundancy surplus, groups that no longer
    fit, late arrivals, what the TS dropped itself): out of the TS, Aborts requested."""

    at: float
    trajs: tuple[TrajId, ...]
    groups: tuple[GroupId, ...]


Decision = Issued | Occupied | Consumed | Dropped
