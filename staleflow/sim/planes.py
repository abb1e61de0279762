"""The coordinator's data planes (``coordinator.interface``) over simulated instances and
the real trajectory server.

The executor takes trajectories from the TS before it Reserves them, but the real TS
assigns ``V_traj`` only when it routes. So ``take`` only *claims* QUEUED trajectories; the
TS routes them when the executor delivers them (``submit``), with the ``V_traj`` just
Reserved; like the runtime's planes, ``submit`` returns the claimed trajectories the TS
no longer held. A claimed trajectory the manager refused is released by ``give_back``,
which also takes interrupted partials back into the TS (those it still holds).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from coordinator.seer import chunk_cap
from staleflow.control.late import return_live
from staleflow.sim.engine import SimInstance, SimTrajectory
from staleflow.sim.race import SimRaces
from staleness.types import TrajId
from trajectory_server import TrajectoryServer, TrajState
from trajectory_server.errors import TrajectoryServerError
from trajectory_server.types import PartialTrajectory


class Claim:
    """A TS trajectory claimed for a Route that has not been delivered yet."""

    __slots__ = ("traj_id",)

    def __init__(self, traj_id: TrajId) -> None:
        self.traj_id = traj_id


class SimPlanes:
    """``EnginePlane``, ``TrajectoryPlane`` and ``ParameterPlane`` at once."""

    def __init__(
        self,
        instances: Mapping[int, SimInstance],
        ts: TrajectoryServer,
        target_length: Callable[[int, int], int],
        ps_version: Callable[[], int],
        clock: Callable[[], float],
        chunk_tokens: int | None = None,
    ) -> None:
        self.instances, self.ts = instances, ts
        self.chunk_tokens = chunk_tokens  # divided rollout (coordinator/seer.py); None: off
        self._target, self._ps_version, self._now = target_length, ps_version, clock
        self.claimed: set[TrajId] = set()
        self.commands = {"route": 0, "interrupt": 0, "abort": 0, "pull": 0}
        self.races: SimRaces | None = None  # the tail race's copies (sim/race.py), if on
        # multi-turn work: (sample, trajectory, response tokens) -> the response length at
        # which its current model turn ends (sim/agentic.py); None: single-turn work
        self.turn_end: Callable[[int, int, int], int] | None = None

    # -- TrajectoryPlane --------------------------------------------------------------

    def take(self, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        out: dict[TrajId, object] = {}
        for tid in trajs:
            if tid in self.claimed:
                continue
            try:
                if self.ts.state_of(tid) is not TrajState.QUEUED:
                    continue
            except TrajectoryServerError:
                continue  # consumed or aborted meanwhile
            self.claimed.add(tid)
            out[tid] = Claim(tid)
        return out

    def give_back(self, partials: Mapping[TrajId, object]) -> None:
        returned = []
        for tid, payload in partials.items():
            if isinstance(payload, Claim):
                self.claimed.discard(tid)
            elif isinstance(payload, PartialTrajectory):
                returned.append(payload)
            else:
                raise TypeError(f"trajectory {tid}: unexpected payload {type(payload).__name__}")
        if returned:
            return_live(self.ts, returned)

    # -- EnginePlane ------------------------------------------------------------------

    def submit(
        self, inst: int, payloads: Mapping[TrajId, object], v_traj: Mapping[TrajId, int]
    ) -> list[TrajId]:
        ids = list(payloads)
        self.claimed.difference_update(ids)
        routed = self.ts.route(
            ids, {t: v_traj[t] for t in ids if t in v_traj}, inst, skip_unavailable=True
        )
        target = self.instances[inst]
        sims = []
        for r in routed:
            response = self._target(r.sample_id, r.traj_id)
            end = len(r.prompt) + chunk_cap(len(r.tokens), response, self.chunk_tokens)
            turn = False
            if self.turn_end is not None:  # the route stops where the model calls a tool
                stop = len(r.prompt) + self.turn_end(r.sample_id, r.traj_id, len(r.tokens))
                if stop <= end:
                    end, turn = stop, True
            sims.append(SimTrajectory(r, len(r.prompt) + response, target, end, turn))
        target.submit(sims, self._now())
        self.commands["route"] += 1
        if len(routed) == len(ids):
            return []
        started = {r.traj_id for r in routed}
        return [t for t in ids if t not in started]

    def interrupt(self, inst: int, trajs: Sequence[TrajId]) -> Mapping[TrajId, object]:
        self.commands["interrupt"] += 1
        out = self.instances[inst].remove(trajs, self._now())
        if self.races is not None:
            self.races.holder_left(inst, out, self._now())
        return out

    def abort(self, inst: int, trajs: Sequence[TrajId]) -> Collection[TrajId]:
        self.commands["abort"] += 1
        out = self.instances[inst].abort(trajs, self._now())
        if self.races is not None:
            self.races.holder_left(inst, out, self._now())
        return out

    # -- ParameterPlane ---------------------------------------------------------------

    def pull(self, inst: int, at_least: int) -> int:
        version = self._ps_version()
        if version < at_least:
            raise RuntimeError(f"Pull of version {at_least} but the PS holds {version}")
        if self.races is not None:
            self.races.host_pulls(inst, self._now())
        self.instances[inst].pull(version, self._now())
        self.commands["pull"] += 1
        return version
