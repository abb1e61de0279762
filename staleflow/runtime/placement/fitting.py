"""Fitting a placement plan to a cluster's nodes, before anything is reserved. Pure.

:func:`fit` assigns every bundle of the plan to a node with room for it, first fit in the
order the nodes are given (the driver's node first), and adds one PS replica on each node
that got a rollout instance (App. A.1): a rollout instance only goes to a node that
already has a replica, or that has room for one too. When something does not fit,
:class:`PlacementError` lists every gang that found no room, what it needed, and where
the most room was, and sums up what the plan asks against what the cluster has free, so
the launch is refused at once instead of Ray waiting for resources that never come.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from staleflow.runtime.errors import PlacementError
from staleflow.runtime.placement.plan import NODE_RESOURCE_SHARE, Bundle, Gang, PlacementPlan

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Node:
    """One Ray node as the fit sees it."""

    node_id: str
    address: str
    free: Mapping[str, float]  # available now
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def short(self) -> str:
        return f"{self.node_id[:8]} ({self.address})" if self.address else self.node_id[:8]


@dataclass(frozen=True, slots=True)
class PlacedGang:
    gang: Gang
    nodes: tuple[str, ...]  # the node of each bundle, in ``gang.roles`` order

    def node_of(self, role: str) -> str:
        return self.nodes[self.gang.roles.index(role)]


@dataclass(frozen=True, slots=True)
class Placement:
    """Where every member goes; PS replicas included (gangs ``ps/<k>``)."""

    gangs: tuple[PlacedGang, ...]
    nodes: tuple[Node, ...]  # the nodes that host something, in fit order

    def gang(self, name: str) -> PlacedGang:
        for placed in self.gangs:
            if placed.gang.name == name:
                return placed
        raise KeyError(name)

    def pool(self, pool: str) -> tuple[PlacedGang, ...]:
        return tuple(p for p in self.gangs if p.gang.pool == pool)

    def gang_of(self, role: str) -> PlacedGang:
        for placed in self.gangs:
            if role in placed.gang.roles:
                return placed
        raise KeyError(f"no member {role!r} in this placement")

    def node_of(self, role: str) -> str:
        return self.gang_of(role).node_of(role)

    def replica_on(self, node_id: str) -> str:
        """The role of the PS replica on ``node_id`` (``ps/<k>``)."""
        for placed in self.pool("parameter_server"):
            if placed.nodes[0] == node_id:
                return placed.gang.roles[0]
        raise KeyError(f"no PS replica on node {node_id}")

    def describe(self) -> list[str]:
        """One line per node: who runs there."""
        lines = []
        for node in self.nodes:
            roles = [
                role
                for placed in self.gangs
                for role, where in zip(placed.gang.roles, placed.nodes, strict=True)
                if where == node.node_id
            ]
            lines.append(f"node {node.short}: {', '.join(roles)}")
        return lines

    def as_dict(self) -> dict[str, Any]:
        """Plain data for the dashboard and the run folder."""
        return {
            "nodes": [
                {"node_id": n.node_id, "address": n.address, "labels": dict(n.labels)}
                for n in self.nodes
            ],
            "gangs": [
                {
                    "name": p.gang.name,
                    "pool": p.gang.pool,
                    "bundle": p.gang.bundle.resources(),
                    "members": dict(zip(p.gang.roles, p.nodes, strict=True)),
                }
                for p in self.gangs
            ],
        }


def _fits(free: Mapping[str, float], need: Mapping[str, float]) -> bool:
    return all(free.get(k, 0.0) + _EPS >= v for k, v in need.items() if v > 0)


def _take(free: dict[str, float], need: Mapping[str, float]) -> None:
    for key, value in need.items():
        free[key] = free.get(key, 0.0) - value


def _sum(*parts: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            out[key] = out.get(key, 0.0) + value
    return out


def _fmt(resources: Mapping[str, float], zeros: bool = False) -> str:
    """CPU and GPU counts and the like; a node group's marker resource (asked for in a
    token share) is named by the group's description instead."""
    return ", ".join(
        f"{k} {v:g}"
        for k, v in sorted(resources.items())
        if (zeros or v > 0) and (k in ("CPU", "GPU") or v != NODE_RESOURCE_SHARE)
    )


class _Fitter:
    def __init__(self, plan: PlacementPlan, nodes: Iterable[Node]) -> None:
        self.plan = plan
        self.nodes = list(nodes)
        self.free = {n.node_id: dict(n.free) for n in self.nodes}
        self.replicas: dict[str, int] = {}  # node id -> replica index
        self.missing: list[str] = []

    def _admitting(self, bundle: Bundle) -> list[Node]:
        return [n for n in self.nodes if bundle.group.admits(n.free, n.labels)]

    def _shortfall(self, gang: Gang, need: Mapping[str, float], extra: str = "") -> None:
        nodes = self._admitting(gang.bundle)
        if not nodes:
            where = f"the cluster has no {gang.bundle.group.describe()}"
        else:
            most = max(
                nodes,
                key=lambda n: sum(
                    min(self.free[n.node_id].get(k, 0), v) / v for k, v in need.items() if v > 0
                ),
            )
            left = {k: max(self.free[most.node_id].get(k, 0.0), 0.0) for k in need}
            where = f"the most room on {gang.bundle.group.describe()} is {_fmt(left, zeros=True)} on node {most.short}"
        self.missing.append(f"{gang.name} needs {_fmt(need)} on one node{extra}, but {where}")

    def rollout(self, gang: Gang) -> PlacedGang | None:
        need = gang.total()
        ps = self.plan.ps_replica
        # nodes that already host a replica first: fewer replicas, fewer Pushes
        order = sorted(self._admitting(gang.bundle), key=lambda n: n.node_id not in self.replicas)
        for node in order:
            free = self.free[node.node_id]
            fresh = node.node_id not in self.replicas
            if fresh and not ps.group.admits(node.free, node.labels):
                continue
            if _fits(free, _sum(need, ps.resources()) if fresh else need):
                _take(free, need)
                if fresh:
                    _take(free, ps.resources())
                    self.replicas[node.node_id] = len(self.replicas)
                return PlacedGang(gang, (node.node_id,) * len(gang.roles))
        self._shortfall(
            gang, need, f" (and {_fmt(ps.resources())} for a PS replica where there is none yet)"
        )
        return None

    def packed(self, gang: Gang) -> PlacedGang | None:
        need = gang.total()
        for node in self._admitting(gang.bundle):
            if _fits(self.free[node.node_id], need):
                _take(self.free[node.node_id], need)
                return PlacedGang(gang, (node.node_id,) * len(gang.roles))
        self._shortfall(gang, need)
        return None

    def spread(self, gang: Gang) -> PlacedGang | None:
        need = gang.bundle.resources()
        chosen: list[str] = []
        for _ in gang.roles:
            node = next(
                (n for n in self._admitting(gang.bundle) if _fits(self.free[n.node_id], need)),
                None,
            )
            if node is None:
                for node_id in chosen:  # give back what this gang took
                    _take(self.free[node_id], {k: -v for k, v in need.items()})
                each = f" for each of its {len(gang.roles)} members" if len(gang.roles) > 1 else ""
                self._shortfall(gang, need, each)
                return None
            _take(self.free[node.node_id], need)
            chosen.append(node.node_id)
        return PlacedGang(gang, tuple(chosen))

    def replica_gangs(self) -> list[PlacedGang]:
        ps = self.plan.ps_replica
        return [
            PlacedGang(Gang(f"ps/{k}", "parameter_server", (f"ps/{k}",), ps, True), (node_id,))
            for node_id, k in sorted(self.replicas.items(), key=lambda item: item[1])
        ]


def fit(plan: PlacementPlan, nodes: Iterable[Node]) -> Placement:
    """Assign every member of ``plan`` to one of ``nodes`` or raise :class:`PlacementError`."""
    fitter = _Fitter(plan, nodes)
    placed: list[PlacedGang] = []
    for gang in plan.gangs:
        if gang.pool == "rollout":
            result = fitter.rollout(gang)
        elif gang.same_node:
            result = fitter.packed(gang)
        else:
            result = fitter.spread(gang)
        if result is not None:
            placed.append(result)
    if fitter.missing:
        free = _sum(*(n.free for n in fitter.nodes))
        asked = plan.totals(rollout_nodes=max(1, len(fitter.replicas)))
        bundles = [g.bundle for g in plan.gangs] + [plan.ps_replica]
        markers = {b.group.resource for b in bundles}  # each named with its gang above
        short = {k: v for k, v in asked.items() if v > free.get(k, 0.0) + _EPS and k not in markers}
        if short:
            fitter.missing.append(
                f"in all the plan asks {_fmt(short)}, the cluster has "
                f"{_fmt({k: free.get(k, 0.0) for k in short}, zeros=True)} free"
            )
        raise PlacementError(fitter.missing)
    placed[:0] = fitter.replica_gangs()
    used = {node for p in placed for node in p.nodes}
    return Placement(tuple(placed), tuple(n for n in fitter.nodes if n.node_id in used))
