"""Load-balancing communication plan (paper App. A.2, Fig. 22). Pure Python.

Given which slices each receiver needs and which slices each sender holds,
assign every needed slice to one sender. Each sender carries an accumulated
estimate of the time its assigned slices take (``bytes / bandwidth +
latency`` over its link to the receiver); a slice goes to the candidate whose
accumulated time *including this slice* is smallest. With identical links
that is the paper's "smallest current accumulated latency"; with mixed links
(a PS worker on the receiver's node vs. one across the network) it also
prefers the faster link, which is what App. A.1's co-located deployment is
for. Ties go to the sender listed first, so plans are deterministic.

A plan is computed once per (needs, holdings, links) and reused for every
later Push or Pull; :class:`Planner` caches it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from parameter_server.layout import Slice


class PlanError(ValueError):
    """The inputs admit no plan (a slice nobody holds, a link nobody described)."""


@dataclass(frozen=True)
class Link:
    """A profiled sender -> receiver path."""

    bandwidth: float
    """Bytes per second."""
    latency: float = 0.0
    """Constant per-transfer cost in seconds."""

    def __post_init__(self) -> None:
        if self.bandwidth <= 0 or self.latency < 0:
            raise PlanError(f"link needs bandwidth > 0 and latency >= 0, got {self}")

    def estimate(self, nbytes: int) -> float:
        return nbytes / self.bandwidth + self.latency


@dataclass(frozen=True)
class Transfer:
    slice: Slice
    sender: str
    receiver: str
    estimate_s: float


@dataclass(frozen=True)
class CommPlan:
    """Static sender -> receiver assignment of every needed slice."""

    transfers: tuple[Transfer, ...]
    load_s: tuple[tuple[str, float], ...]
    """Accumulated estimated seconds per sender, in sender order."""

    @property
    def makespan_s(self) -> float:
        """Estimated duration if senders work in parallel: the busiest sender's load."""
        return max((load for _, load in self.load_s), default=0.0)

    def load(self, sender: str) -> float:
        return dict(self.load_s).get(sender, 0.0)

    def for_receiver(self, receiver: str) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.receiver == receiver)

    def for_sender(self, sender: str) -> tuple[Transfer, ...]:
        return tuple(t for t in self.transfers if t.sender == sender)


LinkTable = Mapping[tuple[str, str], Link]


def _holds(held: Slice, piece: Slice) -> bool:
    return held.name == piece.name and held.start <= piece.start and piece.stop <= held.stop


def _cut(need: Slice, points: Sequence[int]) -> list[Slice]:
    """Split ``need`` at byte ``points`` strictly inside it (row boundaries only)."""
    inner = sorted({p for p in points if need.start < p < need.stop})
    if not inner:
        return [need]
    rows = need.shape[0] if need.shape else 1
    row_bytes = need.nbytes // rows if rows else need.nbytes
    bounds = [need.start, *inner, need.stop]
    pieces = []
    for lo, hi in itertools.pairwise(bounds):
        if row_bytes == 0 or (lo - need.start) % row_bytes or (hi - need.start) % row_bytes:
            raise PlanError(
                f"a holder's slice boundary cuts {need.name!r} inside a row; "
                "shard parameters along dimension 0 only"
            )
        shape = ((hi - lo) // row_bytes, *need.shape[1:])
        pieces.append(Slice(need.name, shape, need.dtype, lo, hi))
    return pieces


def build_plan(
    needs: Mapping[str, Sequence[Slice]],
    holdings: Mapping[str, Sequence[Slice]],
    links: LinkTable,
    default_link: Link | None = None,
) -> CommPlan:
    """Greedy load-balanced plan.

    ``needs``: receiver -> slices it must get, processed in mapping order.
    ``holdings``: sender -> slices it holds; a sender can serve any piece that
    lies inside one of its slices. A needed slice that no single sender holds
    whole is first cut at the senders' slice boundaries (the common
    granularity of App. A.2).
    ``links``: (sender, receiver) -> Link; ``default_link`` for pairs not listed.
    """
    senders = list(holdings)
    cut_points: dict[str, list[int]] = {}
    for held in holdings.values():
        for s in held:
            cut_points.setdefault(s.name, []).extend((s.start, s.stop))
    load = dict.fromkeys(senders, 0.0)
    transfers: list[Transfer] = []
    for receiver, wanted in needs.items():
        for need in wanted:
            for piece in _cut(need, cut_points.get(need.name, ())):
                best: tuple[float, str, float] | None = None
                for sender in senders:
                    if not any(_holds(h, piece) for h in holdings[sender]):
                        continue
                    link = links.get((sender, receiver), default_link)
                    if link is None:
                        raise PlanError(
                            f"no link from {sender!r} to {receiver!r}; profile it or pass "
                            "default_link"
                        )
                    cost = link.estimate(piece.nbytes)
                    if best is None or load[sender] + cost < best[0]:
                        best = (load[sender] + cost, sender, cost)
                if best is None:
                    raise PlanError(
                        f"receiver {receiver!r} needs {piece.name!r} bytes "
                        f"[{piece.start}, {piece.stop}) but no sender holds them"
                    )
                total, sender, cost = best
                load[sender] = total
                transfers.append(Transfer(piece, sender, receiver, cost))
    return CommPlan(tuple(transfers), tuple(load.items()))


def _freeze(table: Mapping[str, Sequence[Slice]]) -> tuple[tuple[str, tuple[Slice, ...]], ...]:
    return tuple((k, tuple(v)) for k, v in table.items())


class Planner:
    """Builds a plan once per distinct input and hands back the same plan after."""

    def __init__(self, links: LinkTable, default_link: Link | None = None) -> None:
        self._links = dict(links)
        self._default = default_link
        self._cache: dict[object, CommPlan] = {}

    def plan(
        self, needs: Mapping[str, Sequence[Slice]], holdings: Mapping[str, Sequence[Slice]]
    ) -> CommPlan:
        key = (_freeze(needs), _freeze(holdings))
        plan = self._cache.get(key)
        if plan is None:
            plan = build_plan(needs, holdings, self._links, self._default)
            self._cache[key] = plan
        return plan

    @property
    def cached(self) -> int:
        return len(self._cache)
