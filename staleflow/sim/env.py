"""The simulated cluster's environment pool: where a model turn that ended at a tool call
waits for the tool's answer, off every instance.

It follows the real environment stage (``staleflow.runtime.workers.env_stage``) through
the real trajectory server: at the turn's end the instance's response is handed over
(``hand_to_reward``: the TS holds it REWARDING with the pool, so it holds no decode slot
and no Pull, Interrupt or stop waits for it); after the tool's latency (the trajectory's
:class:`~staleflow.sim.agentic.TurnPlan`, retries included) the observation is appended,
with mask False, logprob 0 and the version of the model token before it, and the
trajectory is queued for its next turn (``next_turn``) with its ``V_traj``. A trajectory
dropped meanwhile (redundancy) makes both late messages, which the TS refuses and the
pool drops. The instance where the turn ended lists the trajectory in its snapshots'
``env_trajs`` until the answer comes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from staleflow.control.late import hand_live, next_turn_live
from staleflow.sim.agentic import AgenticWorkload
from staleflow.sim.engine import SimInstance, SimTrajectory, constant, is_constant
from trajectory_server import TrajectoryServer
from trajectory_server.types import FinishedTrajectory, NextTurn

WORKER = "env"  # the pool's worker id in the TS


@dataclass(slots=True)
class _Call:
    traj: SimTrajectory
    inst: SimInstance
    call: int  # index of the tool call in the trajectory's plan
    tokens: int  # response tokens at the turn's end
    versions: np.ndarray
    mask: np.ndarray | None
    since: float


@dataclass(slots=True)
class EnvStats:
    calls: int = 0  # tool calls answered
    attempts: int = 0  # tool attempts, retries included
    wait_s: float = 0.0  # seconds trajectories waited on tools (answered calls)
    late: int = 0  # answers for trajectories dropped meanwhile


class SimEnvironments:
    """See the module docstring. ``schedule(when, call)`` puts an answer on the cluster's
    event heap; the cluster hands it back to :meth:`answer` at that time."""

    def __init__(
        self,
        ts: TrajectoryServer,
        workload: AgenticWorkload,
        schedule: Callable[[float, object], None],
    ) -> None:
        self.ts, self.workload, self._schedule = ts, workload, schedule
        self.waiting: dict[int, _Call] = {}
        self.stats = EnvStats()

    def turned(self, now: float, inst: SimInstance, traj: SimTrajectory) -> None:
        """``traj``'s model turn ended at a tool call on ``inst`` (the engine's callback)."""
        tokens, logprobs, versions = traj.response(inst.version)
        mask = traj.mask()
        done = FinishedTrajectory(traj.traj_id, tokens, logprobs, versions, "stop", mask)
        if not hand_live(self.ts, [done], WORKER, instance_id=inst.inst_id):
            self.stats.late += 1  # dropped while it decoded its turn
            return
        plan = self.workload.plan(traj.payload.sample_id, traj.traj_id)
        k = plan.call_after(len(tokens))
        if k is None:
            raise RuntimeError(
                f"trajectory {traj.traj_id}: a turn ended at {len(tokens)} response tokens, "
                f"where its plan has no tool call (ends {plan.ends[:8]}...)"
            )
        self.waiting[traj.traj_id] = _Call(traj, inst, k, len(tokens), versions, mask, now)
        inst.env[traj.traj_id] = traj
        self._schedule(now + plan.latency[k], traj.traj_id)

    def answer(self, now: float, traj_id: int) -> None:
        """The tool answered: append the observation and queue the next turn."""
        c = self.waiting.pop(traj_id)
        c.inst.env.pop(traj_id, None)
        plan = self.workload.plan(c.traj.payload.sample_id, traj_id)
        obs = plan.obs[c.call]
        n = c.tokens + obs
        last = c.versions[-1]
        if is_constant(c.versions, np.int32, int(last)):
            versions = constant(np.int32, int(last), n)
        else:
            versions = np.concatenate([c.versions, np.full(obs, last, np.int32)])
            versions.flags.writeable = False
        mask = np.zeros(n, dtype=np.bool_)
        if c.mask is None:
            mask[: c.tokens] = True
        else:
            mask[: c.tokens] = c.mask
        turn = NextTurn(
            traj_id,
            constant(np.int32, 1, n),
            constant(np.float32, 0.0, n),
            versions,
            mask,
            b"",
        )
        if next_turn_live(self.ts, [turn], WORKER):
            self.stats.calls += 1
            self.stats.attempts += plan.attempts[c.call]
            self.stats.wait_s += now - c.since
        else:
            self.stats.late += 1
