"""Several PS workers holding replicas of one layout (paper App. A.1, A.3).

A Push goes to every replica. A Pull gathers one version from all of them at
once: the communication plan (App. A.2) assigns each slice to the replica
whose accumulated estimated latency stays lowest, the plan is computed once
and reused, and each replica's share is pulled concurrently into disjoint
byte ranges of the destination.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from parameter_server.errors import LayoutMismatchError, PushVersionError, VersionNotHeldError
from parameter_server.layout import Layout, Slice
from parameter_server.plan import CommPlan, Link, LinkTable, Planner
from parameter_server.store import Weights
from parameter_server.transport.base import Transport, validate_push

logger = logging.getLogger(__name__)

# Used for pairs with no profiled link: all replicas equal, so the plan balances bytes.
DEFAULT_LINK = Link(bandwidth=10e9, latency=50e-6)


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
        self.receiver = receiver
        self._planner = Planner(links or {}, default_link)
        self._pool = ThreadPoolExecutor(len(self._replicas), thread_name_prefix="ps-replica")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._replicas)

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

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for t in self._replicas.values():
            t.close()

    def __enter__(self) -> ReplicaGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
