"""Which data-parallel rank trains which groups of a batch, and where a global rank sits
in the pool (:func:`coordinates`).

Groups are never split: their advantages are group-relative. Groups go to the least
loaded rank, largest first, so the ranks' shares are even (by the sizes given: response
tokens when the batch is at hand, trajectories when only the ids are known).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping

from trajectory_server.types import TrainingBatch


def assign_groups(sizes: Mapping[int, int], dp: int) -> list[list[int]]:
    """Group ids for each of ``dp`` ranks, balancing ``sizes`` (group id -> size).
    Deterministic: ties go to the lower rank and the lower group id."""
    if dp < 1:
        raise ValueError(f"dp={dp}; there is at least one data-parallel rank")
    heap = [(0, r) for r in range(dp)]
    parts: list[list[int]] = [[] for _ in range(dp)]
    for gid in sorted(sizes, key=lambda g: (-sizes[g], g)):
        load, r = heapq.heappop(heap)
        parts[r].append(gid)
        heapq.heappush(heap, (load + sizes[gid], r))
    return [sorted(p) for p in parts]


def split_batch(batch: TrainingBatch, dp: int) -> list[TrainingBatch]:
    """``batch`` cut into ``dp`` parts of whole groups (a part may be empty)."""
    by_id = {g.group_id: g for g in batch.groups}
    sizes = {g.group_id: sum(len(t.tokens) for t in g.trajectories) for g in batch.groups}
    return [
        TrainingBatch(tuple(by_id[g] for g in part), (), batch.temperature)
        for part in assign_groups(sizes, dp)
    ]


def coordinates(rank: int, tp: int, dp: int) -> tuple[int, int, int]:
    """Global rank ``rank``'s (TP rank, DP replica, pipeline stage) in Megatron's default
    ``tp-cp-ep-dp-pp`` order: TP fastest, then data-parallel replicas, stages slowest."""
    return rank % tp, rank // tp % dp, rank // (tp * dp)
