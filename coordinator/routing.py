"""The routing strategy (Algorithm 3, with Algorithm 2 as the candidate test).

Why a cycle stays cheap. Instances are grouped by version once per pass, and everything
Algorithm 3 asks per instance is asked per version group instead: for a partial
trajectory the candidates are the groups of version ``>= V_traj`` (a bisection); gains
(Eq. 3) come from a :class:`~coordinator.gains.GainTable`, evaluated as one vector
expression per trajectory length (for a level of partial trajectories, the next lengths
as one matrix: ``GainTable.plan``) and updated in O(1) after a route; Algorithm 2's
``verify`` for an initial trajectory is asked only of a group whose best gain clears the
threshold, and a refusal is remembered for the rest of the group's trajectories. Runs of
interchangeable trajectories (same length, same group) share all of it. A route costs a
few argmaxes over version groups and one Reserve in the sketch, never a loop over
instances in Python.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import numpy as np
import numpy.typing as npt

from coordinator.agentic import ToolWaits, expected_returns, fleet_has_room, stays_home
from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.gains import GainTable
from coordinator.pool import Level, TrajectoryPool, batches
from coordinator.types import TrajectoryView
from staleness.interface import AdmissionSketch
from staleness.types import GroupId

# Placement((pos, ...)) without NamedTuple's Python-level __new__: what its _make does,
# at a fifth of the cost, for the hundreds of routes of a cycle
_placement = tuple.__new__


class Placement(NamedTuple):
    """Route ``traj`` to the instance at position ``pos`` with ``V_traj = v_traj``.

    A named tuple, not a dataclass: a cycle may create thousands and this is cheaper."""

    pos: int
    traj: TrajectoryView
    v_traj: int
    initial: bool  # V_traj is assigned by this decision and must be Reserved


class RoutingStrategy(Protocol):
    def route(
        self,
        fleet: Fleet,
        pool: TrajectoryPool,
        sketch: AdmissionSketch,
        ps_version: int | None = None,
    ) -> list[Placement]:
        """Routes for trajectories of ``pool``, each at most once. Updates ``fleet``'s loads
        and Reserves every initial placement in ``sketch``. ``ps_version``: the PS's
        version this cycle (None: unknown; a strategy may ignore it)."""
        ...


# probe(traj, length, threshold, chosen_version, chosen_gain, chosen_pos) -> stop the pass?
# Called once per decision, before it takes effect; chosen_* are None when the trajectory
# is withheld (routing stops after it).
Probe = Callable[[TrajectoryView, int, float, int | None, float, int | None], bool]


@dataclass(frozen=True, slots=True)
class VersionBuckets:
    """Instance positions sorted by (version, position), cut into equal-version runs."""

    order: list[int]
    versions: list[int]
    starts: list[int]
    ends: list[int]

    @classmethod
    def of(cls, fleet: Fleet) -> VersionBuckets:
        order = np.argsort(fleet.version, kind="stable")
        versions, starts = np.unique(fleet.version[order], return_index=True)
        starts_l = starts.tolist()
        return cls(order.tolist(), versions.tolist(), starts_l, [*starts_l[1:], len(order)])


_ABOVE_ALL_VERSIONS = 1 << 62


class ThroughputRouting:
    """Algorithm 3: MLQ by ``V_traj``, waterfall over version groups against
    ``mu * ΔT_ideal``, withholding (and stopping) when nothing clears the threshold.

    Departures from the paper, each off when its argument is None or False:

    - instances compare by their estimated speed (``Fleet.speed``, coordinator.estimation):
      Eq. 3 on an instance whose steps take ``s`` times the model's is the model's gain
      over ``s``;
    - the fill rule (``fill_steps``): an instance whose KV cache, with a new (initial)
      trajectory, still holds ``fill_steps`` more decode steps of its whole batch takes
      it whatever its gain, the best such instance of the version group first
      (gains.spare). mu exists to keep KV for later decisions and to avoid preemption;
      while the cache has that much to spare, withholding admissible work only leaves the
      batch smaller than it could be (k4 amortised over fewer trajectories) while the
      staleness window ages. Beyond it Eq. 3 and mu decide as in the paper. Partial
      trajectories keep Eq. 3 and mu: a long one brings its whole prefix to re-prefill
      and keeps growing, and routing them by the fill rule too tripled preemptions in the
      simulator (docs/simulator.md). The headroom is the growth each running trajectory
      is still expected to make, so its default (6,000) is about a mean response at a
      20K cap: with 2,000 the rule filled caches that the batch then outgrew, and
      StaleFlow without the rule beat StaleFlow with it on every skewed workload.
    - fresh admission (``fresh``): a new trajectory starts only on an instance at the PS's
      version. Algorithm 3's waterfall visits the oldest versions first, so a lagging
      instance takes new work at its old version: the trajectory's data is staler, and
      its deadline (it must be consumed by buffer ``V_traj + eta``) is nearer although it
      has only just started. With deferred Pulls a whole fleet can lag for minutes;
      the simulator measured 100 groups started at version 0 after the PS had moved on,
      every one of them then in the last version-0 buffer, which waited for them
      (docs/simulator.md). A lagging instance still resumes partial trajectories
      (Algorithm 2 as written) and otherwise drains until synchronisation Pulls it.
    - whole groups (``whole_groups``): once a pass has placed one member of a group, it
      places the rest of that group in the same pass, on the best instance with room for
      it, even below ``mu``'s threshold. Algorithm 3 withholds trajectory by trajectory,
      so a pass could stop in the middle of a group. The group's version is set by its
      first members, so the rest it left in the TS had the same deadline but started
      when a later cycle found room, with fresh admission only after a Pull, at a newer
      version: a GRPO group of mixed policies, and the last buffer of its version
      waiting for it. The simulator measured six members of a version-0 group left in
      the TS at t = 0, started at t = 530 s, gating buffer 3 until 1,167 s on
      `heavy-tail` (docs/simulator.md).
    - multi-turn work (``waits``, a :class:`~coordinator.agentic.ToolWaits`): with
      ``locality`` a next turn goes back to the instance caching its prefix, whatever the
      threshold, unless the cost model says moving it is faster
      (:func:`~coordinator.agentic.stays_home`); with ``returns`` new trajectories are
      admitted on each instance as if the trajectories expected back from their
      environments within a turn's time were running there already
      (:func:`~coordinator.agentic.expected_returns`), so that a return finds its cache
      and a batch it fits in. Next turns that stay with their cache are placed before
      the waterfall: Algorithm 3 stops at the first trajectory it withholds, and a next
      turn kept in the TS behind one without a cache loses its own to eviction meanwhile.
    """

    def __init__(
        self,
        cost: CostModel,
        mu: float,
        fill_steps: int | None = None,
        *,
        fresh: bool = False,
        whole_groups: bool = False,
        waits: ToolWaits | None = None,
        locality: bool = False,
        home_below: float = 0.0,
        returns: bool = False,
    ) -> None:
        if not 0.0 < mu <= 1.0:
            raise ValueError(f"mu must be in (0, 1] (got {mu})")
        if fill_steps is not None and fill_steps < 0:
            raise ValueError(f"fill_steps must be >= 0 (got {fill_steps})")
        self.cost = cost
        self.mu = mu
        self.fill_steps = fill_steps
        self.fresh = fresh
        self.whole_groups = whole_groups
        if (locality or returns) and waits is None:
            raise ValueError("KV locality and expected returns need the ToolWaits estimate")
        self.waits = waits
        self.locality = locality
        self.home_below = home_below  # KV share under which next turns stay home
        self.returns = returns

    def route(
        self,
        fleet: Fleet,
        pool: TrajectoryPool,
        sketch: AdmissionSketch,
        ps_version: int | None = None,
    ) -> list[Placement]:
        """Decide routes; updates ``fleet``'s loads and reserves in ``sketch`` as it goes."""
        return self.run(fleet, pool.levels(), sketch, fresh_from=self.fresh_from(ps_version))

    def fresh_from(self, ps_version: int | None) -> int | None:
        """The lowest instance version that may start new trajectories (None: any)."""
        return ps_version if self.fresh else None

    def run(
        self,
        fleet: Fleet,
        levels: list[Level],
        sketch: AdmissionSketch,
        probe: Probe | None = None,
        fresh_from: int | None = None,
    ) -> list[Placement]:
        """Algorithm 3 over an already built MLQ; ``probe`` watches every decision;
        ``fresh_from``: new trajectories go only to instances of at least this version."""
        mu, ideal_gain = self.mu, _ideal_gain(self.cost)
        bk = VersionBuckets.of(fleet)
        order, bver = bk.order, bk.versions
        nb = len(bver)
        table = GainTable(
            self.cost,
            fleet.n_run[order],
            fleet.kv[order],
            fleet.n_wait[order] > 0,
            bk.starts,
            bk.ends,
            1.0 / fleet.speed[order],
            self.fill_steps,
        )
        best, place = table.best, table.place
        verify, reserve = sketch.verify, sketch.reserve
        out: list[Placement] = []
        started: set[GroupId] = set()  # groups with a member placed in this pass
        home_of = _Homes(fleet, order, bk) if self.locality and fleet.held else None
        reserved: tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]] | None = None
        try:
            if home_of is not None:
                # Next turns that stay with their cache go first, whatever the MLQ order
                # below would withhold: Algorithm 3 stops at the first trajectory it
                # withholds, and a next turn kept waiting in the TS behind one that has
                # no cache loses its own cache to eviction meanwhile.
                rest: list[Level] = []
                table.fill_for(False)  # the fill rule admits new trajectories only
                roomy = fleet_has_room(fleet, self.cost, self.home_below)
                for v_level, trajs in levels:
                    if v_level is None:
                        rest.append((v_level, trajs))
                        continue
                    first = bisect_left(bver, v_level)
                    left = []
                    holders = home_of.holders(trajs)
                    lengths = [
                        t.length for t, h in zip(trajs, holders, strict=True) if h is not None
                    ]
                    table.plan(lengths, first)
                    for t, held in zip(trajs, holders, strict=True):
                        if held is None:
                            left.append(t)
                            continue
                        length = t.length
                        thr = mu * ideal_gain(length)
                        home = home_of.choose(held, length, table, thr, first, self, roomy)
                        if home is None:
                            left.append(t)
                            continue
                        j, b_home, g_home = home
                        if probe is not None and probe(
                            t, length, thr, bver[b_home], g_home, order[j]
                        ):
                            return out
                        out.append(_placement(Placement, (order[j], t, v_level, False)))
                        place(j, length)
                    if left:
                        rest.append((v_level, left))
                levels = rest
            for v_level, trajs in levels:
                initial = v_level is None
                if initial and self.returns and reserved is None and self.waits is not None:
                    n_ret, kv_ret = expected_returns(fleet, self.waits, self.cost)
                    if n_ret.any():
                        reserved = (n_ret[order], kv_ret[order])
                        table.load(*reserved)
                # Algorithm 2 for partial trajectories: instances of version >= V_traj.
                if v_level is not None:
                    first = bisect_left(bver, v_level)
                else:
                    first = 0 if fresh_from is None else bisect_left(bver, fresh_from)
                table.fill_for(initial)  # the fill rule admits new trajectories only
                # New trajectories come in groups of one length, a group's routes between
                # two lengths: they would dirty every row computed ahead (GainTable.plan)
                table.plan([] if initial else _runs(trajs), first)
                if not initial:
                    assert v_level is not None
                    if self._partials(table, trajs, v_level, first, bver, order, probe, out):
                        return out
                    continue
                for batch in batches(trajs, initial):
                    length = batch[0].length
                    thr = mu * ideal_gain(length)
                    # A Reserve never makes room for anything else, so verify(v, group) stays
                    # "no" for the rest of the run, unless the group's own version moves
                    # down (its first Reserve, or one lower), which changes what it checks.
                    refused: set[int] = set()
                    floor = _ABOVE_ALL_VERSIONS  # lowest version placed in this run
                    for t in batch:
                        sel, sel_b, gain = -1, -1, 0.0
                        for b in range(first, nb):  # waterfall: oldest version group first
                            j, gain = best(b, length)
                            if gain < thr:
                                continue
                            # Algorithm 2, asked only where the gain would do (it is dearer).
                            if initial and (b in refused or not verify(bver[b], t.group_id)):
                                refused.add(b)
                                continue
                            sel, sel_b = j, b
                            break
                        if sel < 0 and initial and self.whole_groups and t.group_id in started:
                            sel, sel_b, gain = _with_room(best, verify, bver, first, t, refused)
                        if probe is not None:
                            if sel < 0:
                                probe(t, length, thr, None, 0.0, None)
                                return out
                            if probe(t, length, thr, bver[sel_b], gain, order[sel]):
                                return out
                        if sel < 0:
                            return out  # withheld: stop, lower priorities wait (Alg. 3 l. 41)
                        v = bver[sel_b] if v_level is None else v_level
                        if initial:
                            started.add(t.group_id)
                            reserve(t.group_id, t.traj_id, v)
                            if v < floor:  # the group's version may have moved down
                                floor = v
                                refused.clear()
                        out.append(Placement(order[sel], t, v, initial))
                        place(sel, length)
            return out
        finally:
            if reserved is not None:  # the expected returns were no routes
                table.load(-reserved[0], -reserved[1])
            fleet.n_run[order] = table.n
            fleet.kv[order] = table.kv

    def _partials(
        self,
        table: GainTable,
        trajs: list[TrajectoryView],
        v_level: int,
        first: int,
        bver: list[int],
        order: list[int],
        probe: Probe | None,
        out: list[Placement],
    ) -> bool:
        """The waterfall of :meth:`run` for a level of partial trajectories (no Reserve,
        so none of what admission asks of initial ones); True if it stopped the pass."""
        best, place = table.best, table.place
        mu, ideal_gain = self.mu, _ideal_gain(self.cost)
        buckets = range(first, len(bver))
        last, thr = -1, 0.0
        for t in trajs:
            length = t.length
            if length != last:  # a run of equal lengths shares its threshold
                last, thr = length, mu * ideal_gain(length)
            for b in buckets:  # waterfall: oldest version group first
                j, gain = best(b, length)
                if gain >= thr:
                    break
            else:  # withheld: stop, lower priorities wait (Alg. 3 l. 41)
                if probe is not None:
                    probe(t, length, thr, None, 0.0, None)
                return True
            if probe is not None and probe(t, length, thr, bver[b], gain, order[j]):
                return True
            out.append(_placement(Placement, (order[j], t, v_level, False)))
            place(j, length)
        return False


class _Homes:
    """KV locality for one routing pass: where each cached prefix is, in the pass's
    bucket order (module-level, not a closure: it runs once per next turn)."""

    __slots__ = ("bucket", "fleet", "index")

    def __init__(self, fleet: Fleet, order: list[int], bk: VersionBuckets) -> None:
        self.fleet = fleet
        self.index = np.empty(len(order), dtype=np.int64)
        self.index[order] = np.arange(len(order))
        self.bucket = np.empty(len(order), dtype=np.int64)
        for b, (s, e) in enumerate(zip(bk.starts, bk.ends, strict=True)):
            self.bucket[s:e] = b

    def holders(self, trajs: list[TrajectoryView]) -> list[tuple[int, int] | None]:
        """Per trajectory of ``trajs``, (position, KV tokens) of the instance caching its
        prefix, None if none does."""
        held_by = self.fleet.held_by
        return [held_by(t.traj_id) for t in trajs]

    def choose(
        self,
        held: tuple[int, int],
        length: int,
        table: GainTable,
        thr: float,
        first: int,
        routing: ThroughputRouting,
        roomy: bool = False,
    ) -> tuple[int, int, float] | None:
        """(index, bucket, gain) of the instance caching a trajectory's prefix (``held``,
        from :meth:`holders`) when it stays there (coordinator.agentic.stays_home), None
        to route it as any other."""
        j = int(self.index[held[0]])
        b_home = int(self.bucket[j])
        if b_home < first:
            return None  # older than V_traj: its cache is of other weights (not reported)
        g_home = table.gain_at(j, length)
        if g_home == -np.inf:
            return None
        if roomy:  # the fleet has room everywhere: no move gains (fleet_has_room)
            return j, b_home, g_home
        # the best elsewhere, as the waterfall would see it (clearing the threshold)
        sel, g_best = -1, -np.inf
        for b in range(first, len(table.starts)):
            k, g = table.best(b, length)
            if g >= thr and g > g_best:
                sel, g_best = k, g
        if sel < 0 or sel == j:
            return j, b_home, g_home
        assert routing.waits is not None
        if stays_home(
            routing.cost,
            gain_home=g_home,
            gain_best=g_best,
            length=length,
            cached=held[1],
            n_best=table.n_at(sel),
            latency_best=table.latency_with(sel, length),
            turn_tokens=routing.waits.turn_tokens(),
        ):
            return j, b_home, g_home
        return None


def _ideal_gain(cost: CostModel) -> Callable[[float], float]:
    """``cost.ideal_gain`` with its constants bound once per pass (the same operations in
    the same order, so the same floats): routing asks it once per trajectory."""
    k1k5, k4 = cost.k1 * cost.k5, cost.k4
    top, kept = cost.decode_term(1.0)
    return lambda length: kept / (k1k5 * length + top + k4)


def _runs(trajs: list[TrajectoryView]) -> list[float]:
    """The lengths of ``trajs`` in order, one per run of equal lengths (the lengths the
    waterfall asks the gain table about)."""
    out: list[float] = []
    last = -1
    for t in trajs:
        if t.length != last:
            last = t.length
            out.append(last)
    return out


def _with_room(
    best: Callable[[int, float], tuple[int, float]],
    verify: Callable[[int, GroupId | None], bool],
    bver: list[int],
    first: int,
    t: TrajectoryView,
    refused: set[int],
) -> tuple[int, int, float]:
    """(index, bucket, gain) of the best instance, from bucket ``first`` on, that has room
    for ``t`` and whose version Algorithm 2 admits its group at, whatever the gain;
    (-1, -1, 0.0) if none has room."""
    sel, sel_b, gain = -1, -1, -np.inf
    for b in range(first, len(bver)):
        j, g = best(b, t.length)
        if g == -np.inf or g <= gain:
            continue
        if b in refused or not verify(bver[b], t.group_id):
            refused.add(b)
            continue
        sel, sel_b, gain = j, b, g
    return (sel, sel_b, gain) if sel >= 0 else (-1, -1, 0.0)
