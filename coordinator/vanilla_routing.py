"""Vanilla routing (§6.5): every routable trajectory goes to the admissible instance holding
the fewest trajectories. It ignores throughput but stays staleness-safe (Algorithm 2).

With ``sticky`` it is the routing of the in-flight-limited systems themselves (VeRL-Async,
AReaL, ROLL Flash; §2.4: "a single model version on the rollout side and fixed trajectory
assignment"): a trajectory keeps the instance it was first routed to, so a partial
trajectory interrupted by a weight update resumes where it ran (AReaL's
``RemoteSGLangEngine.agenerate`` re-sends an interrupted request to the same server, "a
single rid shares the same server"; verl's ``AsyncLLMServerManager._choose_server`` keeps a
request id on its server). New trajectories still go to the least-loaded instance, which
is kinder than those systems' own choice (round-robin in AReaL, a cumulative request count
in verl): the baseline is not made weaker than the systems it stands for.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left

from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.pool import Level, TrajectoryPool
from coordinator.routing import Placement, VersionBuckets
from coordinator.types import InstanceId
from staleness.interface import AdmissionSketch
from staleness.types import TrajId


class LeastLoadedRouting:
    """One min-heap of (trajectory count, position) per version bucket; a trajectory with no
    admissible instance is skipped (not withheld: vanilla routing has no threshold).

    ``sticky``: a partial trajectory goes back to the instance it was first routed to when
    that instance's version admits it (Algorithm 2), else to the least-loaded one, which
    becomes its instance. The strategy remembers every placement it made; entries of
    trajectories no longer in flight are dropped as the map grows.
    """

    def __init__(self, cost: CostModel, *, sticky: bool = False) -> None:
        self.cost = cost  # only to keep the fleet's loads consistent (Eq. 3)
        self.sticky = sticky
        self.home: dict[TrajId, InstanceId] = {}

    def route(
        self,
        fleet: Fleet,
        pool: TrajectoryPool,
        sketch: AdmissionSketch,
        ps_version: int | None = None,
    ) -> list[Placement]:
        del ps_version  # the vanilla counterpart admits wherever Algorithm 2 allows
        bk = VersionBuckets.of(fleet)
        count = (fleet.n_run + fleet.n_wait).tolist()
        bucket_of = [0] * len(fleet)
        heaps = []
        for b, (s, e) in enumerate(zip(bk.starts, bk.ends, strict=True)):
            heap = [(count[p], p) for p in bk.order[s:e]]
            heapq.heapify(heap)
            heaps.append(heap)
            for p in bk.order[s:e]:
                bucket_of[p] = b
        pos_of = {inst: p for p, inst in enumerate(fleet.ids)}
        nb = len(heaps)
        out: list[Placement] = []
        levels = pool.levels()
        if self.sticky:
            self._forget_gone(fleet, levels)
        for v_level, trajs in levels:
            first = 0 if v_level is None else bisect_left(bk.versions, v_level)
            for t in trajs:
                pos = -1
                if self.sticky and v_level is not None:
                    home = pos_of.get(self.home.get(t.traj_id, -1), -1)
                    if home >= 0 and fleet.version[home] >= v_level:
                        pos = home
                        count[pos] += 1  # its heap entry is now stale: see _settle
                if pos < 0:
                    best = -1
                    for b in range(first, nb):
                        _settle(heaps[b], count)
                        if (best < 0 or heaps[b][0] < heaps[best][0]) and (
                            v_level is not None or sketch.verify(bk.versions[b], t.group_id)
                        ):
                            best = b
                    if best < 0:
                        continue
                    c, pos = heaps[best][0]
                    count[pos] = c + 1
                    heapq.heapreplace(heaps[best], (c + 1, pos))
                v = bk.versions[bucket_of[pos]] if v_level is None else v_level
                if v_level is None:
                    sketch.reserve(t.group_id, t.traj_id, v)
                out.append(Placement(pos, t, v, v_level is None))
                if self.sticky:
                    self.home[t.traj_id] = fleet.ids[pos]
                self._place(fleet, pos, t.length)
        return out

    def _place(self, fleet: Fleet, pos: int, length: int) -> None:
        if self.cost.runnable(float(fleet.kv[pos]), int(fleet.n_wait[pos]), length):
            fleet.n_run[pos] += 1
            fleet.kv[pos] += self.cost.k5 * length
        else:
            fleet.n_wait[pos] += 1

    def _forget_gone(self, fleet: Fleet, levels: list[Level]) -> None:
        """Keep the map from growing without bound: once it holds four times what is in
        flight (on instances or in the TS), rebuild it from what is."""
        in_flight = sum(len(ts) for _, ts in levels) + int((fleet.n_run + fleet.n_wait).sum())
        if len(self.home) <= 4 * in_flight + 1024:
            return
        alive = {t.traj_id for _, ts in levels for t in ts}
        for pos in range(len(fleet)):
            alive.update(t.traj_id for t in fleet.trajectories(pos))
        self.home = {t: i for t, i in self.home.items() if t in alive}


def _settle(heap: list[tuple[int, int]], count: list[int]) -> None:
    """Bring the heap's top up to date: counts only grow (sticky placements raise them
    without touching the heap), so a stale top is re-pushed with its real count."""
    while heap[0][0] != count[heap[0][1]]:
        heapq.heapreplace(heap, (count[heap[0][1]], heap[0][1]))
