"""Several PS workers holding replicas of one layout (paper App. A.1, A.3).

A Push goes to every replica. A Pull gathers one version from all of them at
once: the communication plan (App. A.2) assigns each slice to the replica
whose accumulated estimated latency stays lowest, the plan is computed once
and reused, and each replica's share is pulled concurrently into disjoint
byte ranges of the destination.

On a cluster (App. A.1) there is one replica on every rollout node: a client
reaches the replica on its own node over shared memory and one on another node
over NIXL or TCP (:class:`ReplicaRoute`, :func:`connect_replica`); the Push plan
(:func:`push_plan`) says which sender sends which slices to which replica over
which link.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from parameter_server.errors import (
    BaseWeightsError,
    LayoutMismatchError,
    PushVersionError,
    TransportUnavailableError,
    VersionNotHeldError,
)
from parameter_server.layout import Layout, Slice
from parameter_server.plan import CommPlan, Link, LinkTable, Planner, build_plan
from parameter_server.store import Weights
from parameter_server.transport import connect, transport_class
from parameter_server.transport.base import ControlClient, Endpoint, Transport, validate_push

logger = logging.getLogger(__name__)

# Used for pairs with no profiled link: all replicas equal, so the plan balances bytes.
DEFAULT_LINK = Link(bandwidth=10e9, latency=50e-6)
# Planning estimates per transport: Pull of 256 MiB into another process on a 2-core CPU
# machine, median GB/s (experiments/bench_parameter_server.py): shm 4.8, NIXL 1.5, socket
# 1.2. Only their ratios steer a plan; RDMA across real nodes is faster than this NIXL.
TRANSPORT_LINKS: dict[str, Link] = {
    "shm": Link(4.8e9, 20e-6),
    "nixl": Link(1.5e9, 50e-6),
    "socket": Link(1.2e9, 100e-6),
}
REMOTE_TRANSPORTS = ("auto", "nixl", "socket")


@dataclass(frozen=True)
class ReplicaRoute:
    """How one client reaches one PS replica: ``transport`` is the one asked for on the
    replica's own node (``auto`` = shared memory) or, when ``same_node`` is false, across
    nodes (``auto`` = NIXL when it starts, else TCP)."""

    replica: str
    endpoint: Endpoint
    same_node: bool
    transport: str = "auto"

    @property
    def intended(self) -> str:
        """The transport a plan assumes for this route (before any fallback)."""
        if self.same_node:
            return "shm" if self.transport == "auto" else self.transport
        return "nixl" if self.transport == "auto" else self.transport


def connect_replica(route: ReplicaRoute) -> Transport:
    """A client of the replica at the end of ``route``.

    Across nodes it is NIXL or TCP, never shared memory, even where the two Ray nodes
    happen to share a host (a test cluster on one machine): the route is decided by Ray
    node, so the bytes take the path they take on a real cluster. A NIXL that cannot start
    falls back to TCP, with a warning when NIXL was asked for by name.
    """
    if route.same_node:
        return connect(route.endpoint, route.intended)
    if route.transport not in REMOTE_TRANSPORTS:
        raise ValueError(
            f"transport {route.transport!r} cannot reach a replica on another node; "
            f"use one of {', '.join(REMOTE_TRANSPORTS)}"
        )
    if route.intended == "nixl":
        try:
            return transport_class("nixl")(route.endpoint)
        except TransportUnavailableError as exc:
            log = logger.warning if route.transport == "nixl" else logger.info
            log("NIXL to %s unavailable (%s); pushing over TCP", route.replica, exc)
    return transport_class("socket")(route.endpoint)


def push_plan(
    layout: Layout,
    senders: Mapping[str, Sequence[Slice]],
    routes: Mapping[str, Sequence[ReplicaRoute]],
) -> CommPlan:
    """The Push plan (App. A.2): every replica needs the whole layout; ``senders`` (trainer
    ranks) hold slices of it; ``routes[sender]`` are that sender's routes to the replicas,
    whose intended transports give the link estimates."""
    links = {
        (sender, r.replica): TRANSPORT_LINKS.get(r.intended, DEFAULT_LINK)
        for sender, rs in routes.items()
        for r in rs
    }
    replicas = dict.fromkeys(r.replica for rs in routes.values() for r in rs)
    needs = {replica: layout.slices() for replica in replicas}
    return build_plan(needs, senders, links, DEFAULT_LINK)


def replica_group(routes: Sequence[ReplicaRoute], receiver: str = "self") -> ReplicaGroup:
    """A :class:`ReplicaGroup` over ``routes``: Push goes to all, a Pull prefers the
    replica on the receiver's own node (its link is the fastest)."""
    transports: dict[str, Transport] = {}
    try:
        for route in routes:
            transports[route.replica] = connect_replica(route)
    except BaseException:
        for t in transports.values():
            t.close()
        raise
    links = {(r.replica, receiver): TRANSPORT_LINKS.get(r.intended, DEFAULT_LINK) for r in routes}
    return ReplicaGroup(transports, receiver=receiver, links=links)


class ReplicaVersions:
    """The newest version every replica holds, asked over control connections only (no
    shared-memory mapping or NIXL agent: what the control plane needs each cycle)."""

    def __init__(self, endpoints: Mapping[str, Endpoint], client: str = "versions") -> None:
        self._clients: dict[str, ControlClient] = {}
        try:
            for name, endpoint in endpoints.items():
                self._clients[name] = ControlClient(endpoint, f"{client}-{name}")
        except BaseException:
            self.close()
            raise

    def latest(self) -> int | None:
        """The version a Pull from any replica gets at least; None before the first Push."""
        versions = [c.info().latest for c in self._clients.values()]
        return None if any(v is None for v in versions) else min(versions)  # type: ignore[type-var]

    def close(self) -> None:
        for c in self._clients.values():
            c.close()


class ReplicaGroup:
    """Clients of the PS workers that each hold the whole parameter set."""

    def __init__(
        self,
        replicas: Mapping[str, Transport],
        receiver: str = "self",
        links: LinkTable | None = None,
        default_link: Link = DEFAULT_LINK,
    ) -> None:
        if not replicas:
            raise ValueError("a ReplicaGroup needs at least one replica")
        self._replicas = dict(replicas)
        layouts = {name: t.layout for name, t in self._replicas.items()}
        first = next(iter(layouts.values()))
        odd = [name for name, layout in layouts.items() if layout != first]
        if odd:
            raise LayoutMismatchError(
                f"replicas {odd} hold a different layout than {next(iter(layouts))}; "
                "start every worker with the same layout"
            )
        self.layout: Layout = first
        bases = {name: t.base_layout for name, t in self._replicas.items()}
        if len({None if b is None else b.fingerprint for b in bases.values()}) != 1:
            raise LayoutMismatchError(
                f"replicas disagree on the base of adapter versions ({sorted(bases)}); start "
                "every worker with the same base layout"
            )
        self.base_layout: Layout | None = next(iter(bases.values()))
        self.receiver = receiver
        self._links = dict(links or {})
        self._default_link = default_link
        self._planner = Planner(links or {}, default_link)
        self._pool = ThreadPoolExecutor(len(self._replicas), thread_name_prefix="ps-replica")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._replicas)

    def replica(self, name: str) -> Transport:
        """The client of one replica (to push to it alone, e.g. to refill a restarted one)."""
        return self._replicas[name]

    def transports(self) -> dict[str, str]:
        """The transport that reaches each replica (after any fallback)."""
        return {name: t.name for name, t in self._replicas.items()}

    def plan(self, slices: Sequence[Slice] | None = None) -> CommPlan:
        """The (cached) plan for pulling ``slices`` (default: everything) to this receiver."""
        wanted = list(slices) if slices is not None else self.layout.slices()
        holdings = {name: self.layout.slices() for name in self._replicas}
        return self._planner.plan({self.receiver: wanted}, holdings)

    def common_version(self) -> int:
        """The newest version every replica holds."""
        held = {name: set(t.info().held) for name, t in self._replicas.items()}
        common = set.intersection(*held.values())
        if not common:
            listing = {name: sorted(v) for name, v in held.items()}
            raise VersionNotHeldError(
                None,
                (),
                f"no version is held by every replica ({listing}); Push to the whole group",
            )
        return max(common)

    def push(self, weights: Weights, version: int | None = None) -> int:
        """Publish ``weights`` on every replica concurrently; all must agree on the version.

        Everything checkable is checked before any replica changes: the weights
        against the layout, and that every replica is at the same latest version.
        """
        validate_push(self.layout, weights)
        latest = {name: t.info().latest for name, t in self._replicas.items()}
        if len(set(latest.values())) != 1:
            raise PushVersionError(
                f"replicas are at different versions {latest}; a group Push needs them in step "
                "(push the missing versions to the lagging replicas first)"
            )
        futures = [self._pool.submit(t.push, weights, version) for t in self._replicas.values()]
        versions = {f.result() for f in futures}
        return versions.pop()

    def pull(
        self,
        dest: np.ndarray,
        version: int | None = None,
        slices: Sequence[Slice] | None = None,
    ) -> int:
        """Gather ``version`` (default: the newest all replicas hold) into ``dest``."""
        self.layout.check_buffer(dest, "Pull destination")
        target = self.common_version() if version is None else version
        by_sender: dict[str, list[Slice]] = {}
        for transfer in self.plan(slices).transfers:
            by_sender.setdefault(transfer.sender, []).append(transfer.slice)
        futures = [
            self._pool.submit(self._replicas[name].pull_slices, dest, part, target)
            for name, part in by_sender.items()
        ]
        for future in futures:
            future.result()
        return target

    def push_base(self, weights: Weights) -> int:
        """Publish the base of adapter versions on every replica that lacks it (a replica
        holds it once; one restarted empty gets it again); returns how many took it."""
        if self.base_layout is None:
            raise BaseWeightsError("these replicas hold full-weight versions, no base")
        validate_push(self.base_layout, weights)
        lacking = [t for t in self._replicas.values() if not t.info().base_ready]
        for future in [self._pool.submit(t.push_base, weights) for t in lacking]:
            future.result()
        return len(lacking)

    def pull_base(self, dest: np.ndarray) -> None:
        """Copy the base from the replica with the fastest link to this receiver (it moves
        once: no plan splits it)."""

        def cost(name: str) -> float:
            link = self._links.get((name, self.receiver), self._default_link)
            return link.estimate(dest.nbytes)

        self._replicas[min(self._replicas, key=cost)].pull_base(dest)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for t in self._replicas.values():
            t.close()

    def __enter__(self) -> ReplicaGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
