"""SpecActor's tail race: which copies to start after a cycle, the one selection both
the real control plane (``staleflow.runtime.controller.races``) and the simulator
(``staleflow.sim.race``) carry out. Pure Python, like the rest of this package.

Each backend keeps its own record of the races running (:class:`RaceEntry`) and starts
the copies its own way; this module only decides: when no instance outside the races'
destinations is idle it decides nothing (the common case, without building a fleet),
otherwise it hands ``coordinator.race.TailRace`` the fleet as the cycle left it, the
routable trajectories (the tail counts the queued ones too) and who already races where.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.race import Race, TailRace
from coordinator.types import InstanceSnapshot, Snapshot, TrajectoryView
from staleness.types import TrajId


@dataclass(slots=True)
class RaceEntry:
    """One trajectory's race: its holder, where its copies run, and the fork point."""

    holder: int
    fork: int  # the backend's count of tokens when the copies started
    dests: list[int] = field(default_factory=list)


def hosting(active: Mapping[TrajId, RaceEntry]) -> set[int]:
    """The instances that run a copy."""
    return {d for r in active.values() for d in r.dests}


def select_races(
    rule: TailRace,
    active: Mapping[TrajId, RaceEntry],
    idle: Iterable[int],
    snapshots: Callable[[], Sequence[InstanceSnapshot]],
    routable: Callable[[], Sequence[TrajectoryView]],
    speeds: Callable[[Sequence[int]], np.ndarray] | None = None,
) -> Iterable[Race]:
    """The copies to start: ``idle`` names the instances with nothing running or waiting
    (read lazily, so the first one outside the races ends the scan); ``snapshots`` and
    ``routable`` are called only when one is, and ``speeds`` gives the coordinator's speed estimates of
    the fleet's instances, as its cycle uses them."""
    busy = hosting(active)
    if not any(inst not in busy for inst in idle):
        return ()
    fleet = Fleet(Snapshot(tuple(snapshots())))
    if speeds is not None:
        fleet.speed = speeds(fleet.ids)
    racing = {tid: len(r.dests) for tid, r in active.items()}
    return rule.select(fleet, TrajectoryPool(routable()), racing, busy)
