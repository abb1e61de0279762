"""SpecActor's tail race in the simulator: the decisions of ``coordinator.race.TailRace``
applied after each cycle, outside the coordinator.

A copy is *not* a trajectory of its destination. It runs there in the batch (its KV and
its step cost are real: the snapshot's ``kv_cache`` counts it) but no snapshot lists it,
so the speculative state (Eq. 1), the TS and the staleness manager see exactly what they
would without racing: the trajectory is Reserved and ROUTED once, to its holder, and
completes as the holder's. That is why this is an observer and not a ``Race`` command: a
command would have to teach Table 1, the executor and every plane a trajectory on two
instances, for a mechanism the real engines cannot run yet (they need per-request seeded
sampling).

The copy starts from the holder's current prefix (its destination pays the prefill of
prompt + generated tokens) and stops at the same target as the original: the simulator's
model of seeded sampling, where both produce the same tokens. The first to finish, by
virtual time, completes the trajectory; if the copy wins, the holder records the
trajectory as completed there (its count in Eq. 1 is that of a completion). The loser's
tokens since the fork are race-wasted. A copy is dropped, wasted, when its original
leaves the holder (Interrupt, Abort) and when its destination Pulls.

Instances advance one after the other through a period, so both sides of a race can
finish in the same period; finishes of raced trajectories are held until every instance
has advanced and then settled by time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from coordinator.race import TailRace
from coordinator.types import TrajectoryView
from staleflow.control.races import RaceEntry, hosting, select_races
from staleflow.sim.engine import SimInstance, SimTrajectory
from staleness.types import TrajId

Finish = tuple[float, SimInstance, SimTrajectory]


class SimRaces:
    """Who is racing where, and the counters the summary reports."""

    def __init__(self, rule: TailRace, instances: Mapping[int, SimInstance]) -> None:
        self.rule = rule
        self.instances = instances
        self.active: dict[TrajId, RaceEntry] = {}  # fork: prompt + tokens at the copies' start
        self.started = 0  # copies started
        self.won = 0  # trajectories a copy completed
        self.wasted_tokens = 0  # tokens the losers generated after the fork
        self.raced: set[TrajId] = set()  # every trajectory that had a copy
        self._finishes: dict[TrajId, list[Finish]] = {}

    def hosting(self) -> set[int]:
        return hosting(self.active)

    def start(
        self,
        routable: Sequence[TrajectoryView],
        now: float,
        speed: np.ndarray | None = None,
    ) -> int:
        """Apply the rule to the instances as the cycle left them; copies started."""
        insts = self.instances
        chosen = select_races(
            self.rule,
            self.active,
            (k for k, i in insts.items() if not i.running and not i.waiting),
            lambda: [i.snapshot() for i in insts.values()],
            lambda: routable,
            None if speed is None else lambda ids: speed,
        )
        n = 0
        for race in chosen:
            original = race.traj
            assert isinstance(original, SimTrajectory)
            if original.end < original.target:
                continue  # a chunk (divided rollout) returns to the TS before its end
            dest = insts[race.dest]
            copy = SimTrajectory(original.payload, original.target, dest)
            copy.base = original.length
            entry = self.active.setdefault(original.traj_id, RaceEntry(race.holder, copy.base))
            entry.dests.append(race.dest)
            dest.start_copy(copy, now)
            self.raced.add(original.traj_id)
            self.started += 1
            n += 1
        return n

    # -- the end of a race --------------------------------------------------------------

    def hold_finish(self, t: float, inst: SimInstance, traj: SimTrajectory) -> bool:
        """Keep a raced trajectory's finish for :meth:`settle` (True), or not raced."""
        if traj.traj_id not in self.active:
            return False
        self._finishes.setdefault(traj.traj_id, []).append((t, inst, traj))
        return True

    def settle(self, now: float) -> list[Finish]:
        """The winner of each race with a finish this period (earliest, then holder
        first); the others stop, their tokens since the fork wasted."""
        out = []
        for tid, finishes in self._finishes.items():
            race = self.active.pop(tid)
            finishes.sort(key=lambda f: (f[0], f[1].inst_id != race.holder, f[1].inst_id))
            winner = finishes[0]
            done = {f[1].inst_id: f[2] for f in finishes[1:]}
            if winner[1].inst_id != race.holder:
                self.won += 1
            for inst_id in (race.holder, *race.dests):
                if inst_id == winner[1].inst_id:
                    continue
                loser = done.get(inst_id)
                if loser is not None:  # finished too, later in the period
                    length = loser.length
                else:  # still running: the holder records a completion, a copy vanishes
                    length = self.instances[inst_id].settle(tid, now, inst_id == race.holder)
                self.wasted_tokens += length - race.fork
            out.append(winner)
        self._finishes.clear()
        return out

    def holder_left(self, inst: int, tids: Iterable[TrajId], now: float) -> None:
        """``tids`` left ``inst`` (Interrupt, Abort): their copies are dropped."""
        for tid in tids:
            race = self.active.get(tid)
            if race is None or race.holder != inst:
                continue
            del self.active[tid]
            for d in race.dests:
                self.wasted_tokens += self.instances[d].settle(tid, now, False) - race.fork

    def host_pulls(self, inst: int, now: float) -> None:
        """``inst`` loads new weights: the copies on it are dropped first."""
        for tid, race in list(self.active.items()):
            if inst in race.dests:
                race.dests.remove(inst)
                self.wasted_tokens += self.instances[inst].settle(tid, now, False) - race.fork
                if not race.dests:
                    del self.active[tid]

    def check(self) -> list[str]:
        """Every race has its original on its holder and each copy on its destination."""
        problems = []
        for tid, race in self.active.items():
            if tid not in self.instances[race.holder].holds():
                problems.append(f"raced trajectory {tid} is not on its holder {race.holder}")
            for d in race.dests:
                if tid not in self.instances[d].copies:
                    problems.append(f"copy of {tid} is missing on instance {d}")
        return problems
