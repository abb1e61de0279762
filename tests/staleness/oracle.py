"""Independent oracles for the staleness protocol (brute force and max-flow).

They know nothing of ``staleness.feasibility``: they build the groups -> buffer-slots
assignment problem literally. A group is ``(lo, hi, occupied)``: the buffers it may sit
in, as absolute versions.
"""

from __future__ import annotations

import itertools

import networkx as nx

Group = tuple[int, int, bool]


def flow_feasible(groups: list[Group], first: int, n: int, batch: int, capacity: int) -> bool:
    """Max-flow over groups -> (buffer, kind) -> buffer -> sink, buffers first..first+n-1."""
    if not groups:
        return True
    g = nx.DiGraph()
    g.add_node("t")
    for i, (lo, hi, occ) in enumerate(groups):
        g.add_edge("s", ("g", i), capacity=1)
        for b in range(max(lo, first), min(hi, first + n - 1) + 1):
            g.add_edge(("g", i), ("bo", b) if occ else ("b", b), capacity=1)
    for b in range(first, first + n):
        g.add_edge(("bo", b), ("b", b), capacity=batch)
        g.add_edge(("b", b), "t", capacity=capacity)
    value, _ = nx.maximum_flow(g, "s", "t")
    return value == len(groups)


def brute_lexmax_occupied(
    groups: list[Group], first: int, n: int, batch: int, capacity: int
) -> tuple[int, ...] | None:
    """The lexicographically largest occupied-count vector over all valid placements."""
    choices = [range(max(lo, first), min(hi, first + n - 1) + 1) for lo, hi, _ in groups]
    best = None
    for placement in itertools.product(*choices):
        total = [0] * n
        occ = [0] * n
        for (_, _, is_occ), b in zip(groups, placement, strict=True):
            total[b - first] += 1
            occ[b - first] += is_occ
        if max(total, default=0) <= capacity and max(occ, default=0) <= batch:
            vec = tuple(occ)
            if best is None or vec > best:
                best = vec
    return best
