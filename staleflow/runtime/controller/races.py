"""SpecActor's tail race in the real runtime: the decisions of ``coordinator.race.TailRace``
carried out after each cycle, beside the coordinator (as ``staleflow.sim.race`` does in
the simulator, whose docstring says why a race is no coordinator command).

A copy is not a trajectory of its destination: the destination's snapshot does not list
it (its KV is counted), the TS and the staleness manager keep the trajectory ROUTED to
its holder, and the copy, if it finishes first, hands its response to a reward worker *in
the holder's name*, which the TS accepts only while the trajectory is still ROUTED there.
So whichever side finishes first completes it and the other's hand-off is refused as a
late message: the TS is the referee, nothing here decides a winner.

What is kept here is who races where, for the rule (``racing``, ``hosting``) and to end
races: a race is over once the TS no longer has the trajectory ROUTED to its holder
(completed by either side, interrupted, aborted, or its holder lost). Then the copies
still running are dropped, and the holder, if it still runs the trajectory (a copy won),
stops it and counts it as completed (Eq. 1 sees a completion, ``settle_won``).

Unbiasedness needs the copy to sample the same tokens as the original: the same weights
version (the rule's condition), and an engine whose draws are keyed by trajectory and
token index, not by instance or submission (the embedded engine's ``sampling``; an
instance's seed is the run's, ``actors.RolloutActor``). A copy starts from the response
the TS has (the holder's last progress report), so it regenerates the tokens since then;
with identical draws they are the same tokens, and a hand-off whose response does not
extend what the TS holds is refused. The vLLM adapter keys its draws by position too
(``staleflow/engines/vllm/worker.py``). An engine that seeds a request by its resume point
(``samples_by_resume_point``; none of the built-in ones now) samples the same tokens only
from the same point: its holder first resubmits the original where it is and reports that
response (``prepare_race``), and the copy forks exactly there.

Fastest-of-N over draft methods (SpecActor §4.2): with speculation on, a copy drafts with
``copy_method`` (``rollout.speculation.race_method``: by default ``group``, the other
method for an ``own`` run), so the race is between two draft methods as well as two
instances. Every draft method samples the same tokens for the same key
(docs/speculation.md), so this changes only which side is faster. Copy wins are counted
per method (``race/won_<method>``, ``same`` for a copy on the original's method).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from coordinator.race import TailRace
from coordinator.types import InstanceSnapshot, TrajectoryView
from staleflow.control.races import RaceEntry, hosting, select_races
from staleflow.rollout.instance import CopyEnd
from staleness.types import TrajId
from trajectory_server.types import InstanceId

logger = logging.getLogger(__name__)

WON_BY = "race/won_"  # + a copy's draft method: the copies of that method that won


class RacingInstance(Protocol):
    """What an instance handle offers for the race (``InstanceHost``)."""

    def prepare_race(self, traj_id: int) -> bool: ...

    def race(
        self, traj_id: int, holder: InstanceId, draft_method: str | None = None
    ) -> int | None: ...

    def drop_copies(self, traj_ids: Sequence[int]) -> Mapping[int, CopyEnd]: ...

    def settle_won(self, traj_ids: Sequence[int]) -> Mapping[int, int]: ...


class RaceServer(Protocol):
    def routed_to(self, instance_id: InstanceId) -> tuple[int, ...]: ...


@dataclass(frozen=True, slots=True)
class RaceCounters:
    started: int  # copies started
    won: int  # trajectories a copy completed
    wasted_tokens: int  # tokens the losers generated after the fork


class RuntimeRaces:
    """Who is racing where; :meth:`after_cycle` on the control thread after each cycle."""

    def __init__(
        self,
        rule: TailRace,
        ts: RaceServer,
        instances: Callable[[], Mapping[int, RacingInstance]],
        holders: Callable[[], Mapping[int, InstanceId]],
        snapshots: Callable[[], Sequence[InstanceSnapshot]],
        routable: Callable[[], Sequence[TrajectoryView]],
        speeds: Callable[[Sequence[int]], np.ndarray] | None = None,
        totals: Mapping[str, float] | None = None,
        copy_method: str | None = None,
    ) -> None:
        self.rule = rule
        self._ts = ts
        self._instances = instances
        self._holders = holders
        self._snapshots = snapshots
        self._routable = routable
        self._speeds = speeds
        self.active: dict[TrajId, RaceEntry] = {}  # fork: response tokens at the copies' start
        last = totals or {}  # a resumed run's counters go on from its last record
        self._started = int(last.get("race/started", 0))
        self._won = int(last.get("race/won", 0))
        self._wasted = int(last.get("race/wasted_tokens", 0))
        # a copy's draft method (None: the engine's, the original's), and the copies that
        # won per method, so that one can see which method won its races
        self.copy_method = copy_method
        self._won_by = {
            k.removeprefix(WON_BY): int(v) for k, v in last.items() if k.startswith(WON_BY)
        }
        self._methods: dict[tuple[TrajId, int], str] = {}  # (trajectory, dest) -> method

    def counters(self) -> RaceCounters:
        return RaceCounters(self._started, self._won, self._wasted)

    def totals(self) -> dict[str, float]:
        """The counters as a step record carries them (``race/*``)."""
        return {
            "race/started": float(self._started),
            "race/won": float(self._won),
            "race/wasted_tokens": float(self._wasted),
            **{WON_BY + m: float(n) for m, n in sorted(self._won_by.items())},
        }

    def won_by_method(self) -> dict[str, int]:
        """Copies that won their race, by the copy's draft method (``same``: the
        original's)."""
        return dict(self._won_by)

    def hosting(self) -> set[int]:
        return hosting(self.active)

    def after_cycle(self, last: Sequence[InstanceSnapshot]) -> int:
        """End the races that are over, then start the rule's copies; ``last``: the
        cycle's snapshots (taken before its commands). Returns the copies started."""
        self.settle()
        chosen = list(
            select_races(
                self.rule,
                self.active,
                (s.inst for s in last if not s.run_trajs and not s.wait_trajs),
                self._snapshots,  # as this cycle's commands left them
                self._routable,
                self._speeds,  # the coordinator's estimates, as its cycle uses them
            )
        )
        if not chosen:
            return 0  # the common case: no instance was idle (or none to race)
        instances, holders = self._instances(), self._holders()
        started = 0
        for race in chosen:
            tid = race.traj.traj_id
            dest, original = instances.get(race.dest), instances.get(race.holder)
            holder = holders.get(race.holder)
            if dest is None or original is None or holder is None:
                continue
            try:
                if tid not in self.active and not original.prepare_race(tid):
                    continue  # it left its holder meanwhile
                fork = dest.race(tid, holder, self.copy_method)
            except Exception as exc:  # the destination's loss is the supervisor's business
                logger.warning("race copy of %d on instance %d failed: %s", tid, race.dest, exc)
                continue
            if fork is None:
                continue  # no longer ROUTED to its holder: it finished meanwhile
            entry = self.active.setdefault(tid, RaceEntry(race.holder, fork))
            entry.dests.append(race.dest)
            self._methods[tid, race.dest] = self.copy_method or "same"
            started += 1
        self._started += started
        return started

    def settle(self) -> None:
        """End every race whose trajectory the TS no longer has ROUTED to its holder."""
        if not self.active:
            return
        holders = self._holders()
        routed: dict[int, set[int]] = {}
        for race in self.active.values():
            if race.holder not in routed:
                hid = holders.get(race.holder)
                routed[race.holder] = set(self._ts.routed_to(hid)) if hid is not None else set()
        over = [t for t, r in self.active.items() if t not in routed[r.holder]]
        for tid in over:
            self._end(tid, settle_holder=True)

    def drop_all(self) -> None:
        """Drop every copy (the run stops: only the holders' partials are kept); the races
        already over end first as :meth:`settle` ends them (a copy that won counts)."""
        self.settle()
        for tid in list(self.active):
            self._end(tid, settle_holder=False)

    def instance_left(self, inst: int) -> None:
        """``inst`` left the run: its copies are gone; races it held end (the TS requeued
        the trajectory, so the copies are dropped at the next :meth:`settle`)."""
        for tid, race in self.active.items():
            if inst in race.dests:
                race.dests.remove(inst)
                self._methods.pop((tid, inst), None)
        for tid in [t for t, r in self.active.items() if not r.dests and r.holder != inst]:
            del self.active[tid]

    def _end(self, tid: TrajId, *, settle_holder: bool) -> None:
        race = self.active.pop(tid)
        instances = self._instances()
        for d in race.dests:
            method = self._methods.pop((tid, d), "same")
            handle = instances.get(d)
            if handle is None:
                continue
            try:
                for end in handle.drop_copies([tid]).values():
                    if end.won:
                        self._won += 1
                        self._won_by[method] = self._won_by.get(method, 0) + 1
                    else:
                        self._wasted += max(end.tokens - race.fork, 0)
            except Exception as exc:
                logger.warning("dropping the copy of %d on instance %d: %s", tid, d, exc)
        holder = instances.get(race.holder)
        if not settle_holder or holder is None:
            return
        try:
            # still running there if a copy completed it (or it was aborted in the TS)
            stopped = holder.settle_won([tid])
        except Exception as exc:
            logger.warning("settling raced %d on instance %d: %s", tid, race.holder, exc)
            return
        self._wasted += sum(max(n - race.fork, 0) for n in stopped.values())
