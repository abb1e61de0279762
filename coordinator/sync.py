"""Synchronisation strategies: Algorithm 4 and the greedy (vanilla) counterpart."""

from __future__ import annotations

from operator import attrgetter

import numpy as np
import numpy.typing as npt

from coordinator.agentic import expected_returns
from coordinator.critical import oldest_in_flight, oldest_tail
from coordinator.fleet import Fleet
from coordinator.gains import routing_gains
from coordinator.pool import Level, TrajectoryPool
from coordinator.routing import ThroughputRouting
from coordinator.types import TrajectoryView
from staleness.interface import AdmissionSketch

_GROUP_ID = attrgetter("group_id")


class ThroughputSync:
    """Algorithm 4: Pull only where it unlocks routing.

    An instance behind the PS is a candidate when no TS trajectory is routable to it at its
    current version. Algorithm 4 then re-runs the routing strategy once per candidate on a
    snapshot where only that candidate is upgraded. We get the same answers from a single
    tentative pass: upgrading candidate ``i`` changes nothing in Algorithm 3 until the first
    trajectory that would pick ``i``, because ``i`` (empty-handed so far: nothing was
    routable to it) joins the highest version group, which the waterfall visits last. So
    we run routing once on a throwaway sketch and, at every decision, ask for each
    remaining candidate whether it would have won that decision.

    Queue release (beyond Algorithm 4, only with ``phi_wait`` set). Algorithm 4 looks only
    at the TS. It assumes that what sits on an instance is running: the throughput routing
    never routes into a queue (Eq. 3 gives a queued route no gain), so queues come only
    from preemption, and migration case 1 returns any excess beyond ``phi_wait`` to the
    TS. A routing strategy without a threshold (vanilla, least-loaded) breaks the first
    half: when one instance is the only one of the version a batch of groups needs, it
    receives all of them and queues most. Without proactive migration the second half is
    gone too: once the PS moves on, Algorithm 4 never Pulls that instance (nothing in the
    TS is for it, and a queued instance wins no tentative decision) and nothing else moves
    its queue, so the buffer those groups belong to waits for one instance to work
    through hundreds of trajectories while the rest of the fleet idles (R0S1M0 stalled).
    With ``phi_wait`` set, an instance behind the PS is therefore also Pulled when its
    queue exceeds ``phi_wait`` (the paper's own tolerance for queued trajectories) and a
    tentative routing pass, on the fleet as Algorithm 1 will see it after this cycle's
    other Pulls, would route at least one of the queued trajectories to another instance
    with a gain above the threshold. The Pull interrupts the instance and returns its
    trajectories to the TS for re-routing: the passive migration of §6.5's vanilla
    migration. ``build_strategies`` sets ``phi_wait`` only when migration is vanilla;
    with throughput migration, case 1 releases the same queue without interrupting the
    running trajectories, and Algorithm 4 stays exactly as the paper writes it.

    Deferred Pulls (beyond Algorithm 4, only with ``pull_kv`` set). A Pull interrupts
    everything the instance runs: each of those trajectories is re-prefilled elsewhere,
    and they are typically the oldest in flight, the ones the trainer's next buffer waits
    for. Algorithm 4 weighs only what a Pull lets in. An instance that nothing in the TS
    can reach at its version still decodes what it holds, in a batch that shrinks as
    those finish: the oldest trajectories then run in a light batch, the fastest place
    for them. So a candidate is Pulled only once the KV cache of what it runs has
    drained to ``pull_kv`` of the budget; until then it finishes its work: each instance
    synchronises "following its own pace" (§6.5). ``build_strategies`` sets ``pull_kv``
    only behind the throughput routing: least-loaded routing queues work on the instances,
    so their KV would not drain and the Pull would not come. The simulator measured a single
    Algorithm 4 decision interrupting 1,300 version-0 trajectories mid-ramp-up; deferring
    only the instances that ran the oldest trajectories did worse than deferring every
    busy candidate (docs/simulator.md). Deferral applies only while the fleet is loaded
    (``loaded``): its mean running batch is at least ``k2 / k3``, where Eq. 11's
    ``max(k2, k3 * n)`` turns to ``k3 * n``, or its mean KV is at least ``pull_kv`` of the
    budget. In a fleet light on both terms a refilled batch steps no slower than a drained
    one, and the trajectories a Pull returns find room in light batches, so a deferred
    Pull only idles the instance while new groups wait: at 512 GPUs (batches of 5-19, the
    caches at most 0.37 full) it made StaleFlow 0.95x `vanilla` at eta = 3.

    Critical holds (beyond Algorithm 4, only with ``hold_tail`` set, which
    ``build_strategies`` sets with ``pull_kv``). Once the oldest version in flight is the
    tail of its buffers (``critical.oldest_tail``, at most ``hold_tail`` per instance), an
    instance running one of those trajectories is not Pulled: those are what the trainer
    waits for, and a lagging instance is where they run fastest. It admits nothing new (fresh
    admission), so its batch only shrinks, while a Pull would re-prefill them elsewhere, in
    a batch that routing then refills with the PS's newest groups. In the simulator the
    last version-0 trajectories of `heavy-tail`'s warm-up ran in batches of 60-100 that way
    (docs/simulator.md, "The critical tail"). The hold applies only while the oldest
    version is at least two behind the PS. One behind (always so at eta = 1, where every
    instance runs some of the previous version's last trajectories at the end of every
    step) it held most of the fleet away from the new groups the next buffer needs:
    -13% on `heavy-tail` at eta = 1, trainer busy 0.64 instead of 0.79. Like every
    deferral it applies only while the fleet is loaded: at 512 GPUs it held all 256
    instances in the warm-up, and no new group could start.

    Fresh admission (the routing's ``fresh``): new trajectories start only at the PS's
    version, so an initial trajectory is no reason to keep a lagging instance at its
    version; only a partial trajectory it could resume is. The tentative pass routes the
    same way.
    """

    def __init__(
        self,
        routing: ThroughputRouting,
        phi_wait: int | None = None,
        pull_kv: float | None = None,
        hold_tail: int | None = None,
        tail_waiting: bool = False,
        returns: bool = False,
    ) -> None:
        if phi_wait is not None and phi_wait < 0:
            raise ValueError(f"phi_wait must be >= 0 or None (got {phi_wait})")
        if pull_kv is not None and not 0.0 <= pull_kv <= 1.0:
            raise ValueError(
                f"pull_kv must be a fraction of the KV budget in [0, 1] (got {pull_kv})"
            )
        self.routing = routing
        self.phi_wait = phi_wait  # None: Algorithm 4 alone, no queue release
        # Deferred Pulls (pull_kv): a candidate is Pulled only once the KV of what it runs
        # is at most this share of the budget. None: Algorithm 4 as written.
        self.max_kv = None if pull_kv is None else pull_kv * routing.cost.kv_budget
        if hold_tail is not None and hold_tail < 1:
            raise ValueError(f"hold_tail must be >= 1 trajectory per instance (got {hold_tail})")
        self.hold_tail = hold_tail  # None: no critical holds
        self.tail_waiting = tail_waiting  # the critical tail counts tool waits (critical.py)
        if returns and routing.waits is None:
            raise ValueError("counting expected returns needs the routing's ToolWaits")
        # Deferred Pulls count, as KV in use, the cached prefixes expected back from
        # their tools within a turn's time (coordinator/agentic.py expected_returns)
        self.returns = returns

    def select(
        self, fleet: Fleet, pool: TrajectoryPool, ps_version: int, sketch: AdmissionSketch
    ) -> list[int]:
        lagging = np.flatnonzero(fleet.version < ps_version).tolist()
        if not lagging:
            return []
        levels = pool.ts_levels()
        kv = self.kv_in_use(fleet)
        max_kv = self.max_kv if self.max_kv is not None and self.loaded(fleet, kv) else None
        # Algorithm 4 keeps these; the queue release below may still Pull one.
        held: set[int] = set()
        if max_kv is not None and self.hold_tail is not None:
            held = _running_tail(fleet, pool, self.hold_tail, ps_version, self.tail_waiting)
        candidates = [p for p in lagging if p not in held]
        cheap: list[int] = []
        if self.returns and self.max_kv is not None and fleet.n_env.any():
            cheap = self._cheap_pulls(fleet, levels, candidates, ps_version, sketch, kv)
        if cheap:
            # Pulled whatever Algorithm 4 says of them: its tentative pass decides each
            # candidate on its own, so it need not ask about these
            taken = set(cheap)
            candidates = [p for p in candidates if p not in taken]
        chosen = self._algorithm4(fleet, levels, candidates, ps_version, sketch, max_kv, kv)
        if cheap:
            chosen = sorted(chosen + cheap)
        if self.phi_wait is None:
            return chosen
        taken = set(chosen)
        queued = [p for p in lagging if fleet.n_wait[p] > self.phi_wait and p not in taken]
        if queued:
            chosen = sorted(
                chosen + self._release(fleet, levels, chosen, queued, ps_version, sketch)
            )
        return chosen

    def _cheap_pulls(
        self,
        fleet: Fleet,
        levels: list[Level],
        candidates: list[int],
        ps_version: int,
        sketch: AdmissionSketch,
        kv: npt.NDArray[np.float64],
    ) -> list[int]:
        """Multi-turn work: also Pull the lagging instances that a Pull costs little, when
        new trajectories wait for an instance at the PS's version. Algorithm 4 Pulls an
        instance only once nothing in the TS is routable at its version, and with
        multi-turn work the TS always holds next turns of old trajectories (routable to
        any instance of their version or newer), so no lagging instance qualified: the
        fleet stayed behind the PS until it drained, while fresh admission kept new groups
        off every lagging instance (73% of `swe-agent`'s steady state at eta = 3 with no
        instance at the PS's version, its groups a version late: docs/simulator_agentic.md).
        Cheap is what the deferral asks (``pull_kv``), on the KV a Pull discards and the
        fleet needs again soon (:meth:`kv_in_use`): an instance whose trajectories wait
        on long tool calls is cheap, one whose caches are about to be used is not; and an
        instance holding a trajectory of the oldest version in flight is never cheap."""
        assert self.max_kv is not None
        initial = [ts for v, ts in levels if v is None]
        groups = dict.fromkeys(map(_GROUP_ID, initial[0])) if initial else {}
        if not any(sketch.verify(ps_version, g) for g in groups):
            return []
        # Never at the cost of the oldest trajectories in flight: they gate the trainer's
        # next buffer, and the Pull would interrupt them to re-prefill elsewhere (at
        # eta = 1 the simulator lost 5.7% on a seed of `search-agent` to such Pulls).
        cheap = [p for p in candidates if kv[p] <= self.max_kv]
        if cheap:
            oldest, versions = oldest_in_flight(fleet, levels), fleet.versions()
            cheap = [p for p in cheap if oldest not in versions[p]]
        return cheap

    def kv_in_use(self, fleet: Fleet) -> npt.NDArray[np.float64]:
        """Per instance, the KV a Pull would discard and the fleet needs again soon: what
        decodes, and (``returns``) the cached prefixes of the trajectories expected back
        from their tools within a turn's time. A Pull empties the prefix cache, so each of
        those is prefilled again on its next turn; one that waits on a long tool call,
        likely to outlast the cache's eviction anyway, counts little (heavy tails make a
        long wait likelier to go on)."""
        if not self.returns or not fleet.held:
            return fleet.kv
        assert self.routing.waits is not None
        _, back = expected_returns(fleet, self.routing.waits, self.routing.cost)
        out: npt.NDArray[np.float64] = fleet.kv + back
        return out

    def loaded(self, fleet: Fleet, kv: npt.NDArray[np.float64] | None = None) -> bool:
        """Does a drained instance step faster than the fleet's, and would a Pull's
        trajectories land in heavy batches? Only then are Pulls deferred (class doc).
        ``kv``: the KV in use per instance (:meth:`kv_in_use`; default the fleet's)."""
        kv = fleet.kv if kv is None else kv
        kv_loaded = self.max_kv is not None and float(kv.mean()) >= self.max_kv
        cost = self.routing.cost
        return kv_loaded or cost.verified(float(fleet.n_run.mean())) >= cost.knee

    def _algorithm4(
        self,
        fleet: Fleet,
        levels: list[Level],
        lagging: list[int],
        ps_version: int,
        sketch: AdmissionSketch,
        max_kv: float | None,
        kv: npt.NDArray[np.float64],
    ) -> list[int]:
        partial = [v for v, _ in levels if v is not None]
        initial = [ts for v, ts in levels if v is None]
        groups = list(dict.fromkeys(map(_GROUP_ID, initial[0]))) if initial else []
        routable: dict[int, bool] = {}
        candidates = []
        for pos in lagging:
            v = int(fleet.version[pos])
            if v not in routable:  # Algorithm 4 lines 5-9, once per version (Algorithm 2)
                # With fresh admission a lagging instance starts nothing new: only a
                # partial trajectory is a reason to keep its version.
                routable[v] = (bool(partial) and partial[0] <= v) or (
                    not self.routing.fresh and any(sketch.verify(v, g) for g in groups)
                )
            if not routable[v] and (max_kv is None or kv[pos] <= max_kv):
                candidates.append(pos)
        candidates = self._could_win(fleet, levels, candidates)
        if not candidates:
            return []
        return self._tentative(fleet, levels, ps_version, sketch, candidates)

    def _release(
        self,
        fleet: Fleet,
        levels: list[Level],
        chosen: list[int],
        queued: list[int],
        ps_version: int,
        sketch: AdmissionSketch,
    ) -> list[int]:
        """Which of the ``queued`` instances hold a queued trajectory that another instance
        would run (see the class docstring). One tentative routing pass for all of them."""
        after = fleet.copy()
        pool = TrajectoryPool([t for _, ts in levels for t in ts])
        for pos in chosen:  # Algorithm 1 lines 4-8 for this cycle's other Pulls
            pool.add(after.discard_all(pos))
            after.set_version(pos, ps_version)
        owner: dict[int, int] = {}
        for pos in queued:
            # Only the queue: it holds no KV, so moving it costs nothing it would not cost
            # where it is. The running trajectories would come back too, but they are
            # running, so they are no reason to Pull.
            waiting = [t for t in fleet.wait[pos] if t.v_traj is not None]
            owner.update((t.traj_id, pos) for t in waiting)
            pool.add(waiting)
        released: set[int] = set()

        def probe(
            t: TrajectoryView,
            length: int,
            thr: float,
            sel_version: int | None,
            sel_gain: float,
            sel_pos: int | None,
        ) -> bool:
            del length, thr, sel_version, sel_gain
            pos = owner.get(t.traj_id)
            # A queued instance keeps its queue in ``after``, so its gain is -inf and it is
            # never ``sel_pos``; the check only guards that reading.
            if pos is not None and sel_pos is not None and sel_pos != pos:
                released.add(pos)
            return len(released) == len(queued)

        fresh = self.routing.fresh_from(ps_version)
        self.routing.run(after, pool.levels(), sketch.sketch(), probe, fresh)
        return sorted(released)

    def _could_win(self, fleet: Fleet, levels: list[Level], candidates: list[int]) -> list[int]:
        """Drop candidates whose gain clears the threshold for no length in the TS.

        Nothing is routed to a candidate during the tentative pass, so its gain for a
        given length is fixed; clearing the threshold for some trajectory's length is
        necessary to win that trajectory. This spares the pass when no candidate can win.
        """
        if not candidates:
            return []
        lengths = np.unique(np.array([t.length for _, ts in levels for t in ts], np.float64))
        cost, pos = self.routing.cost, np.array(candidates)
        gains = routing_gains(  # candidates x lengths
            cost,
            fleet.n_run[pos][:, None],
            fleet.kv[pos][:, None],
            (fleet.n_wait[pos] > 0)[:, None],
            (1.0 / fleet.speed[pos])[:, None],
            lengths,
            self.routing.fill_steps,
        )
        threshold = self.routing.mu * cost.ideal_gain(lengths)
        out: list[int] = pos[(gains >= threshold).any(axis=1)].tolist()
        return out

    def _tentative(
        self,
        fleet: Fleet,
        levels: list[Level],
        ps_version: int,
        sketch: AdmissionSketch,
        candidates: list[int],
    ) -> list[int]:
        scratch = sketch.sketch()
        probe = _UpgradeProbe(self.routing, fleet, candidates, ps_version, scratch)
        fresh = self.routing.fresh_from(ps_version)
        self.routing.run(fleet.copy(), levels, scratch, probe, fresh)
        return sorted(probe.chosen)


def _running_tail(
    fleet: Fleet, pool: TrajectoryPool, per_instance: int, ps_version: int, waiting: bool
) -> set[int]:
    """Positions running a trajectory of the oldest version's tail (a queued one makes no
    progress where it is: no reason to keep its instance's version)."""
    oldest, on = oldest_tail(fleet, pool, per_instance, waiting)
    if oldest >= ps_version - 1:
        return set()  # one version behind: the hold would starve the next buffer (class doc)
    return {pos for pos, t in on if t not in fleet.wait[pos]}  # queues are short; runs not


class _UpgradeProbe:
    """Watches a tentative routing pass: would candidate ``i``, upgraded to ``ps_version``,
    have won a decision? Candidates are evaluated together, as numpy arrays."""

    def __init__(
        self,
        routing: ThroughputRouting,
        fleet: Fleet,
        candidates: list[int],
        ps_version: int,
        sketch: AdmissionSketch,
    ) -> None:
        self.cost, self.ps_version, self.sketch = routing.cost, ps_version, sketch
        self.fill_steps = routing.fill_steps
        self.pos = np.array(candidates, dtype=np.int64)
        self.n, self.kv = fleet.n_run[self.pos], fleet.kv[self.pos]
        self.queued = fleet.n_wait[self.pos] > 0
        self.weight = 1.0 / fleet.speed[self.pos]
        self.chosen: list[int] = []
        self._key: tuple[int, bool] | None = None  # (length, initial) of the cached gains
        self._gains = np.empty(0)

    def __call__(
        self,
        t: TrajectoryView,
        length: int,
        thr: float,
        sel_version: int | None,
        sel_gain: float,
        sel_pos: int | None,
    ) -> bool:
        keep = self.pos != sel_pos  # routed at its old version after all: no Pull needed
        # The waterfall stops in an older group before it reaches ps_version; otherwise the
        # upgraded instance competes if Algorithm 2 admits it at ps_version. A decision
        # below the threshold placed the rest of a group (routing's whole_groups) after
        # the waterfall had found nothing: the upgraded instance would have been found.
        reaches = sel_version is None or sel_version >= self.ps_version or sel_gain < thr
        if reaches and (t.v_traj is not None or self.sketch.verify(self.ps_version, t.group_id)):
            key = (length, t.v_traj is None)
            if key != self._key:
                self._key = key
                fill = self.fill_steps if t.v_traj is None else None  # as routing does
                self._gains = routing_gains(
                    self.cost, self.n, self.kv, self.queued, self.weight, length, fill
                )
            g = self._gains
            wins = (g >= thr) & keep
            if sel_pos is not None:
                wins &= (g > sel_gain) | ((g == sel_gain) & (self.pos < sel_pos))
            self.chosen.extend(self.pos[wins].tolist())
            keep &= ~wins
        if not keep.all():
            self.pos, self.n, self.kv = self.pos[keep], self.n[keep], self.kv[keep]
            self.queued, self.weight = self.queued[keep], self.weight[keep]
            self._key = None
        return len(self.pos) == 0


class GreedySync:
    """Vanilla synchronisation (§6.5): every instance behind the PS Pulls at once."""

    def select(
        self, fleet: Fleet, pool: TrajectoryPool, ps_version: int, sketch: AdmissionSketch
    ) -> list[int]:
        del pool, sketch
        out: list[int] = np.flatnonzero(fleet.version < ps_version).tolist()
        return out
