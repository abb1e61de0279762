"""The mutable working copy of a validated snapshot, updated as Algorithm 1 decides.

Instances are addressed by *position* (0..n-1, in ascending instance id); ``ids`` maps
positions back to instance ids. Per-instance numbers live in numpy arrays so that the
strategies can evaluate the cost model for all instances at once.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import numpy.typing as npt

from coordinator.cost_model import CostModel
from coordinator.types import InstanceId, Snapshot, TrajectoryView

_V_TRAJ = attrgetter("v_traj")
# Fleet.at_home: positions, lengths and ids of the trajectories at their tools whose
# prefix the instance of their last turn still caches
AtHome = tuple[npt.NDArray[np.int64], list[int], list[int]]


class Fleet:
    """``S`` of Algorithm 1 for one cycle: versions, loads and the trajectories on each
    instance. The snapshot itself is never modified."""

    __slots__ = (
        "_at_home",
        "_at_home_kept",
        "_env_versions",
        "_versions",
        "cleared",
        "env",
        "held",
        "ids",
        "kv",
        "n_env",
        "n_run",
        "n_wait",
        "run",
        "speed",
        "version",
        "wait",
    )

    ids: list[InstanceId]
    version: npt.NDArray[np.int64]
    n_run: npt.NDArray[np.float64]
    kv: npt.NDArray[np.float64]  # tokens
    n_wait: npt.NDArray[np.int64]
    run: list[tuple[TrajectoryView, ...]]
    wait: list[tuple[TrajectoryView, ...]]
    # Step-latency multiplier per instance (coordinator.estimation): the instance's cost
    # model is the profiled one times this. Ones unless an estimator sets it.
    speed: npt.NDArray[np.float64]
    # Multi-turn work (types.InstanceSnapshot): trajectories waiting on an environment
    # after a turn that ended on each instance, and the prefixes each instance caches,
    # as trajectory -> (position, KV tokens). Neither is decoding work.
    env: list[tuple[TrajectoryView, ...]]
    n_env: npt.NDArray[np.int64]
    held: dict[int, tuple[int, int]]
    # positions Pulled in this cycle's decisions: their entries of ``held`` are gone
    # (kept in the dict, shared with copies, and skipped: a Pull costs O(1), not O(held))
    cleared: frozenset[int]

    def __init__(self, snapshot: Snapshot | None = None) -> None:
        insts = sorted(snapshot.instances, key=lambda s: s.inst) if snapshot else []
        self.ids = [s.inst for s in insts]
        self.version = np.array([s.inst_version for s in insts], dtype=np.int64)
        self.n_run = np.array([len(s.run_trajs) for s in insts], dtype=np.float64)
        self.kv = np.array([s.kv_cache for s in insts], dtype=np.float64)
        self.n_wait = np.array([len(s.wait_trajs) for s in insts], dtype=np.int64)
        self.run = [s.run_trajs for s in insts]
        self.wait = [s.wait_trajs for s in insts]
        self.speed = np.ones(len(insts))
        self.env = [s.env_trajs for s in insts]
        self.n_env = np.array([len(s.env_trajs) for s in insts], dtype=np.int64)
        self._env_versions: list[int] | None = None
        self._at_home: AtHome | None = None
        # at_home() with the Pulls of ``cleared`` applied, for that ``cleared``
        self._at_home_kept: tuple[frozenset[int], AtHome] | None = None
        self._versions: list[list[int]] | None = None
        self.cleared = frozenset()
        # thousands of prefixes per snapshot with multi-turn work, each cached once but
        # where an instance left behind caches a shorter, older one too
        self.held = {t: (pos, n) for pos, s in enumerate(insts) for t, n in s.held}
        if len(self.held) < sum(len(s.held) for s in insts):
            held: dict[int, tuple[int, int]] = {}
            get = held.get
            for pos, s in enumerate(insts):
                for t, n in s.held:  # the longest prefix wins, the first of equal ones
                    old = get(t)
                    if n > (-1 if old is None else old[1]):
                        held[t] = (pos, n)
            self.held = held

    def __len__(self) -> int:
        return len(self.ids)

    def copy(self) -> Fleet:
        """An independent copy for tentative decisions (trajectory tuples are shared)."""
        out = Fleet()
        out.ids = self.ids
        out.version = self.version.copy()
        out.n_run = self.n_run.copy()
        out.kv = self.kv.copy()
        out.n_wait = self.n_wait.copy()
        out.run = list(self.run)
        out.wait = list(self.wait)
        out.speed = self.speed
        out.env = self.env
        out.n_env = self.n_env
        out._env_versions = self._env_versions
        out._at_home = self._at_home
        out._at_home_kept = self._at_home_kept
        # entries are replaced, never changed in place, so a shallow copy is independent
        out._versions = None if self._versions is None else list(self._versions)
        out.held = self.held  # never written after construction
        out.cleared = self.cleared
        return out

    def env_versions(self) -> list[int]:
        """``V_traj`` of every trajectory waiting on its environment (computed once: the
        waits are the snapshot's, never changed by a decision, and asked by both the
        synchronisation and the critical-path rule)."""
        if self._env_versions is None:
            self._env_versions = [v for trajs in self.env for v in map(_V_TRAJ, trajs)]
        return self._env_versions

    def at_home(self) -> AtHome:
        """The trajectories at their tools whose prefix the instance of their last turn
        still caches: (positions, lengths, ids), in snapshot order. The scan is made once
        (the synchronisation and routing both ask, a third of those in flight each
        time); a Pull since only filters it, as it clears its instance's cache."""
        if self._at_home is None:
            pos_l, len_l, tid_l = [], [], []
            get, nowhere = self.held.get, (-1, 0)
            for pos, trajs in enumerate(self.env):
                for t in trajs:
                    if get(t.traj_id, nowhere)[0] == pos:
                        pos_l.append(pos)
                        len_l.append(t.length)
                        tid_l.append(t.traj_id)
            self._at_home = (np.array(pos_l, dtype=np.int64), len_l, tid_l)
        where, lengths, ids = self._at_home
        if self.cleared and len(where):
            # the synchronisation's Pulls are made before migration and routing ask
            kept = self._at_home_kept
            if kept is not None and kept[0] == self.cleared:
                return kept[1]
            keep = np.flatnonzero(~np.isin(where, list(self.cleared))).tolist()
            out = where[keep], [lengths[i] for i in keep], [ids[i] for i in keep]
            self._at_home_kept = (self.cleared, out)
            return out
        return where, lengths, ids

    def versions(self) -> list[list[int]]:
        """``V_traj`` of run + wait, per instance, in that order (computed once and kept
        current by :meth:`discard` and :meth:`discard_all`: the synchronisation and the
        critical-path rule both ask it of every trajectory on an instance)."""
        if self._versions is None:
            self._versions = [
                [*map(_V_TRAJ, run), *map(_V_TRAJ, wait)]
                for run, wait in zip(self.run, self.wait, strict=True)
            ]
        return self._versions

    def latencies(self, cost: CostModel) -> npt.NDArray[np.float64]:
        """Seconds per token of each running trajectory, per instance, with each
        instance's speed factor (Eq. 11's step; over the tokens a step keeps with
        speculation: ``CostModel.token_latencies``)."""
        out: npt.NDArray[np.float64] = cost.token_latencies(self.n_run, self.kv) * self.speed
        return out

    def throughputs(self, cost: CostModel) -> npt.NDArray[np.float64]:
        """Eq. 2 per instance with each instance's speed factor."""
        out: npt.NDArray[np.float64] = cost.throughputs(self.n_run, self.kv) / self.speed
        return out

    def trajectories(self, pos: int) -> tuple[TrajectoryView, ...]:
        """run + wait of instance ``pos``."""
        return self.run[pos] + self.wait[pos]

    def discard_all(self, pos: int) -> tuple[TrajectoryView, ...]:
        """``S[inst].discard(run + wait)``: the instance is left empty (its KV released)."""
        out = self.run[pos] + self.wait[pos]
        self.run[pos] = self.wait[pos] = ()
        if self._versions is not None:
            self._versions[pos] = []
        self.n_run[pos] = 0.0
        self.kv[pos] = 0.0
        self.n_wait[pos] = 0
        return out

    def discard(self, pos: int, trajs: tuple[TrajectoryView, ...], k5: float) -> None:
        """``S[inst].discard(trajs)`` for any subset of run + wait."""
        gone = {t.traj_id for t in trajs}
        run = tuple(t for t in self.run[pos] if t.traj_id not in gone)
        wait = tuple(t for t in self.wait[pos] if t.traj_id not in gone)
        if run:
            freed = sum(t.length for t in self.run[pos] if t.traj_id in gone)
            self.kv[pos] = max(0.0, float(self.kv[pos]) - k5 * freed)
        else:
            self.kv[pos] = 0.0  # nothing left running: no KV, whatever the page rounding
        self.run[pos], self.wait[pos] = run, wait
        if self._versions is not None:
            self._versions[pos] = [*map(_V_TRAJ, run), *map(_V_TRAJ, wait)]
        self.n_run[pos] = len(run)
        self.n_wait[pos] = len(wait)

    def set_version(self, pos: int, version: int) -> None:
        """A Pull: new weights, so the prefixes the instance cached are gone."""
        if version != self.version[pos] and self.held:
            self.cleared = self.cleared | {pos}
        self.version[pos] = version

    def held_by(self, traj_id: int) -> tuple[int, int] | None:
        """(position, KV tokens) of the instance caching ``traj_id``'s prefix, if any."""
        h = self.held.get(traj_id)
        return None if h is None or h[0] in self.cleared else h

    def holder(self, traj_id: int) -> int:
        """Position of the instance caching ``traj_id``'s prefix, -1 if none does."""
        h = self.held_by(traj_id)
        return -1 if h is None else h[0]
