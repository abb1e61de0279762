"""Seer's context-aware scheduling on divided rollout (seer.md §4.2-4.3, Algorithm 1),
inside StaleFlow's staleness protocol.

Divided rollout. A route hands a trajectory out for one *chunk*: the engine generates at
most ``chunk_tokens`` more tokens (:func:`chunk_cap`, Algorithm 1 lines 19-20), then the
instance returns the trajectory to the TS as a partial, exactly as an Interrupt would: it
keeps ``V_traj``, its Reserve and its per-token versions, and the next cycle re-places it
(the MLQ level ``V_traj``, so only on instances of version ``>= V_traj``). The instance
lists it among the trajectories that left it since its last Pull (``complete_trajs``), so
the coordinator's speculative state (Eq. 1) stays exact without a command.

Context-aware scheduling. :class:`LengthContext` keeps, per group, its probe (the
*speculative request*: the group's first member, its lowest trajectory id when the
coordinator first sees the group) and its length estimate ``L_g`` (the longest finished
response; unknown, i.e. the cap, while none has finished). :func:`seer_order` is
Algorithm 1's choice applied repeatedly: probes shortest-generated-first (SFS), then the
other members longest-estimated-first (LFS), ties in the TS's order. :class:`SeerRouting`
applies it *within* each level of the MLQ and leaves the levels in version order: the
oldest ``V_traj`` still routes first, because that is the order in which buffers must
fill for the trainer to advance within the bound (Algorithm 3). The instance is still
chosen by the configured routing strategy (Algorithm 1's SELECTINSTANCE): least-loaded for
Seer's own, the cost model for StaleFlow's.

Departures from the paper, both because it cannot run here: no global KV-cache pool (a
re-placed chunk re-prefills its prefix, which the simulator charges), and ties are broken
by queue order instead of at random.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.fleet import Fleet
from coordinator.pool import TrajectoryPool
from coordinator.routing import Placement, RoutingStrategy
from coordinator.types import TrajectoryView
from staleness.interface import AdmissionSketch
from staleness.types import GroupId, TrajId


def chunk_cap(response_len: int, max_response: int, chunk_tokens: int | None) -> int:
    """The response length this route may reach (Algorithm 1 l. 19-20: ``max_tokens =
    min(chunk_size, ori_max_tokens - generated_tokens)``, as an absolute length)."""
    if chunk_tokens is None:
        return max_response
    return min(max_response, response_len + chunk_tokens)


@dataclass(frozen=True, slots=True)
class ProbeAccuracy:
    """How well the first finished member predicted its group's longest response.

    ``groups``: groups with at least two finished members; ``mean_error``: mean over them
    of ``(longest - first) / longest`` (the estimate only ever grows, so it is the share
    the first estimate fell short by); ``exact``: groups whose first estimate was already
    the longest."""

    groups: int = 0
    mean_error: float = 0.0
    exact: int = 0


class LengthContext:
    """Seer's Context Manager: probes and length estimates per group (pure, one thread).

    Groups are forgotten once they have left the coordinator's view for a while (their
    accuracy figures are kept as running sums), so a long run holds only live groups."""

    def __init__(self) -> None:
        self._probe: dict[GroupId, TrajId] = {}
        self._estimate: dict[GroupId, int] = {}  # longest finished response so far
        self._first: dict[GroupId, int] = {}  # the estimate after the first finish
        self._finished: dict[GroupId, int] = {}  # members finished
        self._started: set[GroupId] = set()  # a member was routed (seen with a V_traj)
        self._folded = (0, 0.0, 0)  # accuracy sums of forgotten groups

    # -- what the control loop and the routing tell it ----------------------------------

    def finished(self, group_id: GroupId, traj_id: TrajId, response_len: int) -> None:
        """UPDATEESTIMATE (Algorithm 1 l. 3): a member finished with this response."""
        best = self._estimate.get(group_id)
        if best is None:
            self._first[group_id] = response_len
        if best is None or response_len > best:
            self._estimate[group_id] = response_len
        self._finished[group_id] = self._finished.get(group_id, 0) + 1

    def observe(self, trajs: Iterable[TrajectoryView]) -> None:
        """Name the probe of every group seen for the first time: its lowest id here (the
        TS enqueues a group's members together, so the first sighting holds them all)."""
        fresh: dict[GroupId, TrajId] = {}
        probes = self._probe
        for t in trajs:
            g = t.group_id
            if g in probes:
                continue
            seen = fresh.get(g)
            if seen is None or t.traj_id < seen:
                fresh[g] = t.traj_id
        probes.update(fresh)

    def started(self, groups: Iterable[GroupId]) -> None:
        """These groups have a member routed (on an instance, or partial in the TS)."""
        self._started.update(groups)

    # -- what the scheduling reads ------------------------------------------------------

    def has_started(self, group_id: GroupId) -> bool:
        return group_id in self._started or group_id in self._finished

    def estimate(self, group_id: GroupId) -> int | None:
        """``L_g``: the longest finished response, None (the cap) while none finished."""
        return self._estimate.get(group_id)

    def is_probe(self, t: TrajectoryView) -> bool:
        return self._probe.get(t.group_id) == t.traj_id

    def accuracy(self) -> ProbeAccuracy:
        n, err, exact = self._folded
        for g, count in self._finished.items():
            if count >= 2:
                dn, de, dx = _accuracy(self._first[g], self._estimate[g])
                n, err, exact = n + dn, err + de, exact + dx
        return ProbeAccuracy(n, err / n if n else 0.0, exact)

    def retain(self, live: set[GroupId]) -> None:
        """Forget groups outside ``live`` once the context holds far more than them."""
        if len(self._probe) + len(self._estimate) <= 8 * len(live) + 2048:
            return
        n, err, exact = self._folded
        for g in [g for g in self._estimate if g not in live]:
            if self._finished[g] >= 2:
                dn, de, dx = _accuracy(self._first[g], self._estimate[g])
                n, err, exact = n + dn, err + de, exact + dx
            del self._estimate[g], self._first[g], self._finished[g]
        self._folded = (n, err, exact)
        self._probe = {g: t for g, t in self._probe.items() if g in live}
        self._started &= live


def _accuracy(first: int, longest: int) -> tuple[int, float, int]:
    if longest <= 0:
        return 1, 0.0, 1
    return 1, (longest - first) / longest, int(first >= longest)


def seer_order(trajs: Sequence[TrajectoryView], context: LengthContext) -> list[TrajectoryView]:
    """The order in which Algorithm 1 picks ``trajs`` (l. 12-15), decision after decision:
    every probe before any other member, probes by fewest generated tokens (SFS), the
    others by largest ``L_g`` first (LFS, an unknown estimate being the cap, so above every
    known one). Both sorts are stable: ties keep the given order."""
    probes, rest = [], []
    for t in trajs:
        (probes if context.is_probe(t) else rest).append(t)
    probes.sort(key=lambda t: t.length - t.prompt_len)
    estimate = context.estimate
    rest.sort(key=lambda t: _lfs_key(estimate(t.group_id)))
    return probes + rest


def _lfs_key(estimate: int | None) -> float:
    return float("-inf") if estimate is None else -float(estimate)


class SeerRouting:
    """A routing strategy that orders each MLQ level as Algorithm 1 does, then lets
    ``inner`` (the configured routing) place the trajectories in that order."""

    def __init__(self, inner: RoutingStrategy, context: LengthContext) -> None:
        self.inner = inner
        self.context = context

    def route(
        self,
        fleet: Fleet,
        pool: TrajectoryPool,
        sketch: AdmissionSketch,
        ps_version: int | None = None,
    ) -> list[Placement]:
        levels = pool.levels()
        ctx = self.context
        on_instances = [t for pos in range(len(fleet)) for t in fleet.trajectories(pos)]
        for _, trajs in levels:
            ctx.observe(trajs)
        ctx.started(t.group_id for t in on_instances)
        ctx.started(t.group_id for v, trajs in levels if v is not None for t in trajs)
        live = {t.group_id for _, trajs in levels for t in trajs}
        live.update(t.group_id for t in on_instances)
        ctx.retain(live)
        ordered = []
        for v, trajs in levels:
            if v is None:
                ordered += initial_order(trajs, ctx)
            else:
                ordered += seer_order(trajs, ctx)
        return self.inner.route(fleet, TrajectoryPool(ordered), sketch, ps_version)


def initial_order(trajs: Sequence[TrajectoryView], context: LengthContext) -> list[TrajectoryView]:
    """The MLQ's initial level: members of groups that have started (a member routed, so
    the group holds a Reserve and a version) before fresh groups, each part in Algorithm 1's
    order. A started group's members are as much the oldest buffers' work as a partial
    level (what the version order is for), and its admission is already settled; a fresh
    probe the staleness manager refuses would otherwise stop routing in front of them."""
    old, new = [], []
    for t in trajs:
        (old if context.has_started(t.group_id) else new).append(t)
    return seer_order(old, context) + seer_order(new, context)
