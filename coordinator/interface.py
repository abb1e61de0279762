"""Contracts between the coordinator and the rest of the system (no logic).

The coordinator reads four things each cycle and writes commands to one executor:

- :class:`SnapshotSource`: the five fields of every instance (§5.2).
- :class:`TrajectorySource`: the TS's routing view, trajectories waiting in the TS.
- :class:`ParameterVersionSource`: the PS's latest version.
- :class:`AdmissionSource`: the staleness manager, of which it takes a sketch per cycle
  (``staleness.manager.StalenessManager`` satisfies it).
- :class:`CommandExecutor`: carries commands out over the data planes below.

Executors keep the concurrency rules of §5.2 / Figure 12(b): commands to different data
planes run concurrently; a Route waits until every trajectory it names that an earlier
Interrupt is returning has reached the TS; trajectories routed to an instance with an
earlier Pull still running are held until the Pull has finished; commands to one
instance take effect in issue order.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

from coordinator.commands import Command, CommandDone
from coordinator.types import InstanceId, Snapshot, TrajectoryView
from staleness.interface import AdmissionSketch
from staleness.types import TrajId


class SnapshotSource(Protocol):
    def snapshot(self) -> Snapshot: ...


class TrajectorySource(Protocol):
    def routable(self) -> Sequence[TrajectoryView]:
        """Trajectories waiting in the TS, in enqueue order (members of a group together)."""
        ...


class ParameterVersionSource(Protocol):
    def latest_version(self) -> int: ...


class AdmissionSource(Protocol):
    def sketch(self) -> AdmissionSketch: ...


class CommandExecutor(Protocol):
    def issue(self, commands: Sequence[Command]) -> None:
        """Start carrying out ``commands`` (in order where they depend on each other)."""
        ...

    def poll(self) -> list[CommandDone]:
        """Commands that have taken effect since the last poll, with any shortfall."""
        ...


# -- data planes an executor drives ------------------------------------------------------
# Payloads (token arrays, logprobs, sampling state) are opaque to the coordinator.


class EnginePlane(Protocol):
    """The rollout instances."""

    def interrupt(self, inst: InstanceId, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        """Stop ``trajs``; return the partial payload of each one that was still running or
        queued (a trajectory that already completed is absent from the result)."""
        ...

    def abort(self, inst: InstanceId, trajs: Sequence[TrajId]) -> Collection[TrajId]:
        """Drop ``trajs``; return those that were still running or queued."""
        ...

    def submit(
        self, inst: InstanceId, payloads: Mapping[TrajId, object], v_traj: Mapping[TrajId, int]
    ) -> Collection[TrajId]:
        """Start generating the given trajectories (queueing them if the KV cache is full).

        ``v_traj`` holds the ``V_traj`` just assigned to the initial ones among them; the
        instance reports it in its snapshots and hands it back with the partial payload
        when the trajectory is interrupted. Returns the trajectories that could not start,
        empty when all started (a plane that only claims at ``take`` time learns at
        delivery that one finished or left the TS meanwhile).
        """
        ...


class TrajectoryPlane(Protocol):
    """The trajectory server."""

    def take(self, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        """Hand out ``trajs`` for generation; absent from the result if no longer held."""
        ...

    def give_back(self, partials: Mapping[TrajId, object]) -> None:
        """Take back interrupted trajectories (or routed ones that could not start)."""
        ...


class ParameterPlane(Protocol):
    """The parameter server."""

    def pull(self, inst: InstanceId, at_least: int) -> int:
        """Load the latest weights (version >= ``at_least``) into ``inst``; return the version
        loaded. The instance drops its running and queued trajectories and its completed
        list."""
        ...
