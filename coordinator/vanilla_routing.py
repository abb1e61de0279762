"""Vanilla routing (§6.5): every routable trajectory goes to the admissible instance holding
the fewest trajectories. It ignores throughput but stays staleness-safe (Algorithm 2)."""

from __future__ import annotations

import heapq
from bisect import bisect_left

from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.routing import Placement, VersionBuckets
from staleness.interface import AdmissionSketch


class LeastLoadedRouting:
    """One min-heap of (trajectory count, position) per version bucket; a trajectory with no
    admissible instance is skipped (not withheld: vanilla routing has no threshold)."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost  # only to keep the fleet's loads consistent (Eq. 3)

    def route(self, fleet: Fleet, pool: TrajectoryPool, sketch: AdmissionSketch) -> list[Placement]:
        bk = VersionBuckets.of(fleet)
        count = (fleet.n_run + fleet.n_wait).tolist()
        heaps = []
        for s, e in zip(bk.starts, bk.ends, strict=True):
            heap = [(count[p], p) for p in bk.order[s:e]]
            heapq.heapify(heap)
            heaps.append(heap)
        nb = len(heaps)
        out: list[Placement] = []
        for v_level, trajs in pool.levels():
            first = 0 if v_level is None else bisect_left(bk.versions, v_level)
            for t in trajs:
                best = -1
                for b in range(first, nb):
                    if (best < 0 or heaps[b][0] < heaps[best][0]) and (
                        v_level is not None or sketch.verify(bk.versions[b], t.group_id)
                    ):
                        best = b
                if best < 0:
                    continue
                c, pos = heaps[best][0]
                heapq.heapreplace(heaps[best], (c + 1, pos))
                v = bk.versions[best] if v_level is None else v_level
                if v_level is None:
                    sketch.reserve(t.group_id, t.traj_id, v)
                out.append(Placement(pos, t, v, v_level is None))
                self._place(fleet, pos, t.length)
        return out

    def _place(self, fleet: Fleet, pos: int, length: int) -> None:
        if self.cost.runnable(float(fleet.kv[pos]), int(fleet.n_wait[pos]), length):
            fleet.n_run[pos] += 1
            fleet.kv[pos] += self.cost.k5 * length
        else:
            fleet.n_wait[pos] += 1
