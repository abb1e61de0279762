"""The multi-level queue of §5.3, kept incrementally so that the routing view is cheap.

Levels are keyed by ``V_traj``; smaller versions are staler and come first, initial
trajectories (``None``) come last, and each level is first-in first-out. Every level
keeps a cached tuple of its records, rebuilt only when that level changed, so producing
the whole view costs one concatenation of a few tuples.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from itertools import chain

from trajectory_server.types import RoutableTrajectory

Level = int | None


class MultiLevelQueue:
    def __init__(self) -> None:
        # dicts keep insertion order, which is the FIFO order of a level
        self._levels: dict[Level, dict[int, RoutableTrajectory]] = {None: {}}
        self._versions: list[int] = []  # sorted keys of the non-initial levels
        self._level_views: dict[Level, tuple[RoutableTrajectory, ...]] = {}
        self._view: tuple[RoutableTrajectory, ...] | None = ()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(self, record: RoutableTrajectory) -> None:
        """Append at the back of the record's level."""
        v = record.v_traj
        level = self._levels.get(v)
        if level is None:
            level = self._levels[v] = {}
            bisect.insort(self._versions, v)  # type: ignore[arg-type]  # None always exists
        level[record.traj_id] = record
        self._touch(v)
        self._size += 1

    def remove(self, traj_id: int, v_traj: Level) -> RoutableTrajectory:
        """Take a record out of level ``v_traj``; KeyError if it is not there."""
        level = self._levels[v_traj]
        record = level.pop(traj_id)
        if not level and v_traj is not None:
            del self._levels[v_traj]
            del self._versions[bisect.bisect_left(self._versions, v_traj)]
        self._touch(v_traj)
        self._size -= 1
        return record

    def view(self) -> tuple[RoutableTrajectory, ...]:
        """All records in routing order."""
        if self._view is None:
            parts = [self._level_view(v) for v in self._versions]
            parts.append(self._level_view(None))
            # a handful of levels (about eta + 2): concatenating tuples is a few memcpys
            self._view = sum(parts, ()) if len(parts) <= 8 else tuple(chain.from_iterable(parts))
        return self._view

    def counts(self) -> dict[Level, int]:
        return {v: len(level) for v, level in self._levels.items() if level}

    def __iter__(self) -> Iterator[RoutableTrajectory]:
        return iter(self.view())

    def _level_view(self, v: Level) -> tuple[RoutableTrajectory, ...]:
        cached = self._level_views.get(v)
        if cached is None:
            cached = self._level_views[v] = tuple(self._levels[v].values())
        return cached

    def _touch(self, v: Level) -> None:
        self._level_views.pop(v, None)
        self._view = None
