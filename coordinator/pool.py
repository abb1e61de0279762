"""``ts_trajs`` of Algorithm 1 and its multi-level queue (MLQ) of Algorithm 3."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from itertools import compress, repeat
from operator import attrgetter, is_, is_not

from coordinator.types import TrajectoryView
from staleness.types import GroupId, TrajId

Level = tuple[int | None, list[TrajectoryView]]
_V_TRAJ = attrgetter("v_traj")


class TrajectoryPool:
    """The TS's routable trajectories plus those interrupted earlier in this cycle.

    Within a level the TS's order is kept (its enqueue order: members of a group stay
    together and the oldest go first), and trajectories interrupted in this cycle come
    after the TS's own. The TS view lists each trajectory once and none that is on an
    instance (a validated snapshot has no command in flight); were it to break that, the
    TS would hand the trajectory out once and the executor report the other Route short.
    """

    __slots__ = ("_base", "_excluded_groups", "_excluded_trajs", "_extra", "_levels", "_ts")

    def __init__(
        self,
        ts_trajs: Sequence[TrajectoryView],
        *,
        excluded_trajs: Collection[TrajId] = (),
        excluded_groups: Collection[GroupId] = (),
    ) -> None:
        self._ts = ts_trajs
        self._extra: list[TrajectoryView] = []
        self._base: dict[int | None, list[TrajectoryView]] | None = None
        self._levels: list[Level] | None = None  # levels(), until the next add()
        self._excluded_trajs = excluded_trajs
        self._excluded_groups = excluded_groups

    def add(self, trajs: Sequence[TrajectoryView]) -> None:
        """``ts_trajs <- ts_trajs + trajs`` (trajectories just interrupted)."""
        self._extra.extend(trajs)
        self._levels = None

    def __len__(self) -> int:
        return len(self._ts) + len(self._extra)

    def _index(self) -> dict[int | None, list[TrajectoryView]]:
        if self._base is None:
            xt, xg = self._excluded_trajs, self._excluded_groups
            ts = self._ts
            if xt or xg:
                ts = [t for t in ts if t.traj_id not in xt and t.group_id not in xg]
            # Per-trajectory work in C (map / compress over the TS's list): this runs every
            # cycle over every trajectory waiting in the TS, most of them initial.
            versions = list(map(_V_TRAJ, ts))
            levels: dict[int | None, list[TrajectoryView]] = {}
            initial = list(compress(ts, map(is_, versions, repeat(None))))
            if len(initial) < len(ts):
                for t in compress(ts, map(is_not, versions, repeat(None))):
                    level = levels.get(t.v_traj)
                    if level is None:
                        levels[t.v_traj] = [t]
                    else:
                        level.append(t)
            if initial:
                levels[None] = initial
            self._base = levels
        return self._base

    def levels(self) -> list[Level]:
        """The MLQ: levels by ascending ``V_traj``, initial trajectories (None) last.

        Kept until the next :meth:`add` (a cycle asks it several times, with hundreds of
        trajectories interrupted by its Pulls to merge in), so the lists are shared:
        read them, never change them."""
        if self._levels is None:
            self._levels = self._merged()
        return self._levels

    def _merged(self) -> list[Level]:
        levels = self._index()
        if self._extra:
            levels = dict(levels)
            copied: set[int | None] = set()
            for t in self._extra:
                v = t.v_traj
                if v not in copied:  # never append to the cached TS levels
                    levels[v] = list(levels.get(v, ()))
                    copied.add(v)
                levels[v].append(t)
        return _ordered(levels)

    def ts_levels(self) -> list[Level]:
        """The MLQ of the TS's trajectories alone (what the synchronisation strategy sees)."""
        return _ordered(self._index())


def _ordered(levels: dict[int | None, list[TrajectoryView]]) -> list[Level]:
    out: list[Level] = [(v, levels[v]) for v in sorted(v for v in levels if v is not None)]
    if None in levels:
        out.append((None, levels[None]))
    return out


def batches(trajs: list[TrajectoryView], initial: bool) -> Iterator[list[TrajectoryView]]:
    """Runs of consecutive interchangeable trajectories, in order.

    Interchangeable = same length and, for initial trajectories, same group (admission is
    decided per group). Routing evaluates the cost model once per run, not per trajectory.
    """
    i, n = 0, len(trajs)
    while i < n:
        first = trajs[i]
        length, group = first.length, first.group_id
        j = i + 1
        if initial:
            while j < n and trajs[j].length == length and trajs[j].group_id == group:
                j += 1
        else:
            while j < n and trajs[j].length == length:
                j += 1
        yield trajs[i:j]
        i = j
