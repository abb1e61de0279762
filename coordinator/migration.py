"""Migration strategies: Algorithm 5 and the vanilla counterpart (no proactive migration)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from coordinator.cost_model import CostModel
from coordinator.fleet import Fleet
from coordinator.types import TrajectoryView
from staleness.types import TrajId

Migration = tuple[int, tuple[TrajectoryView, ...]]  # (instance position, trajectories)
FloatArray = npt.NDArray[np.float64]
# per instance, the trajectories and KV tokens expected back from their tools soon
# (coordinator.agentic.expected_returns bound to the run's waits and cost model)
Returns = Callable[[Fleet], tuple[FloatArray, FloatArray]]


class ThroughputMigration:
    """Algorithm 5.

    Case 1: an instance with more than ``phi_wait`` queued trajectories gives back the
    excess, taken from the tail of its queue (the ones that would wait longest), when
    another instance could start them: one with an empty queue and KV cache to spare, at
    a version that admits them. Where every instance queues, giving the excess back only
    makes routing queue it again somewhere (the least-loaded router puts it straight back:
    thousands of Interrupts and Routes a cycle in the simulator at a 40K cap, none of
    them moving work forward).

    Case 2: ``phi_throughput`` bounds the *ratio* of cost-model throughputs (Eq. 2)
    ``T_max / T_min``, as in Algorithm 5 line 14. When exceeded, every trajectory on the
    highest-throughput instance returns to the TS to be spread out by routing. Two guards
    keep it from churning where the paper's text is silent:

    - ``T_min`` is taken over the instances that could receive every trajectory of the
      highest-throughput instance (version >= their largest ``V_traj``). An idle instance
      too old to take them would otherwise make the ratio infinite in every cycle and send
      the same trajectories back where they came from.
    - An instance holding a single trajectory is never emptied: moving one trajectory
      cannot balance anything.
    - A trajectory moved by either case is not moved again until it has generated
      tokens since: near the end of a step some instance is idle, the ratio is infinite
      every cycle, and long trajectories whose re-prefill outlasts the cycle period would
      otherwise bounce between instances without ever decoding; and a queue given back by
      case 1 and queued again elsewhere by a least-loaded router would be given back again
      every cycle (both found by the simulator). The record is shared with the
      critical-path rule (``moved_at``): it moved six tail trajectories a cycle onto the
      fastest instance and case 2 moved them off again in the next, each move a
      re-prefill of 9-11K tokens, until that instance owed 335 s of prefill and stalled
      (`hetero-0.2`, docs/simulator.md).

    With ``min_gain`` set, case 2 moves only the trajectories whose move pays (the
    *improving moves*): taken shortest first (the cheapest to re-prefill), a trajectory
    leaves the highest-throughput instance when the best instance that admits it gains
    more throughput by taking it (Eq. 3 with the instances' speeds) than its instance
    loses by letting it go, by at least ``min_gain`` times an idle instance's gain
    (Eq. 4); each move updates both instances for the next, and the first move that does
    not pay ends the list. The paper's rule returns every
    trajectory of the instance, which re-prefills all of them to balance a ratio that
    one idle instance at the end of a step makes infinite: with per-instance speeds the
    ratio exceeds ``phi_throughput`` far more often, and the simulator measured 17,000
    such re-routed trajectories in a 12-step run at sigma = 0.2 (docs/simulator.md).

    With ``returns`` (multi-turn work, ``coordinator.agentic.expected_returns``), both
    cases count, as each instance's load, the trajectories expected back from their tools
    within a turn's time where their prefix is cached: an instance whose batch emptied
    while its trajectories are at their tools is not idle. Case 1 gives a queue back
    only if another instance has room with its returns counted; case 2 still starts from
    what decodes now (the returns are expected, not there: they never start a move), but
    takes ``T_min`` and the improving moves on the loads with them. Without it, the
    instances that look idle at a turn's end draw moves (each a re-prefill) that the
    returning turns then find in their way. The returns are computed only once a case
    has a move to weigh.
    """

    def __init__(
        self,
        cost: CostModel,
        phi_wait: int,
        phi_throughput: float,
        min_gain: float | None = None,
        moved_at: dict[TrajId, int] | None = None,
        returns: Returns | None = None,
    ) -> None:
        if phi_wait < 0:
            raise ValueError(f"phi_wait must be >= 0 (got {phi_wait})")
        if not phi_throughput >= 1.0:
            raise ValueError(f"phi_throughput must be a ratio >= 1 (got {phi_throughput})")
        if min_gain is not None and not min_gain >= 0.0:
            raise ValueError(f"min_gain must be >= 0 (got {min_gain})")
        self.cost = cost
        self.phi_wait = phi_wait
        self.phi_throughput = phi_throughput
        self.min_gain = min_gain
        self.returns = returns
        # traj_id -> its length when it was last moved; shared with the critical-path rule
        # (build_strategies), so neither moves what the other has just moved
        self._moved_at: dict[TrajId, int] = {} if moved_at is None else moved_at

    def select(self, fleet: Fleet) -> list[Migration]:
        out: list[Migration] = []
        excess_of: dict[int, int] = {}
        over = np.flatnonzero(fleet.n_wait > self.phi_wait).tolist()
        loads = self._loads(fleet) if over else None
        room = (fleet.n_wait == 0) & (
            (fleet.kv if loads is None else loads[1]) < self.cost.kv_budget
        )
        for pos in over:  # room: could start more
            excess = int(fleet.n_wait[pos]) - self.phi_wait
            tail = self._unmoved(fleet.wait[pos][-excess:])
            need = min((t.v_traj for t in tail if t.v_traj is not None), default=0)
            hosts = room & (fleet.version >= need)
            hosts[pos] = False
            if tail and hosts.any():
                excess_of[pos] = excess
                self._mark(tail)
                out.append((pos, tail))
        if len(fleet) >= 2:
            imbalance = self._imbalance(fleet, excess_of, loads)
            if imbalance is not None:
                out.append(imbalance)
        return out

    def _loads(self, fleet: Fleet) -> tuple[FloatArray, FloatArray]:
        """Each instance's decoding trajectories and KV, with the returns expected soon
        counted where ``returns`` is on (class docstring)."""
        if self.returns is None or not fleet.n_env.any():
            return fleet.n_run, fleet.kv
        n_ret, kv_ret = self.returns(fleet)
        return fleet.n_run + n_ret, fleet.kv + kv_ret

    def _imbalance(
        self,
        fleet: Fleet,
        excess_of: dict[int, int],
        loads: tuple[FloatArray, FloatArray] | None,
    ) -> Migration | None:
        """Case 2. What decodes now decides whether the fleet is out of balance (the
        returns never start a move: they are expected, not there); the returns count in
        the hosts' throughputs (an instance whose trajectories are at their tools is not
        as idle as it looks) and in the improving moves."""
        tput = fleet.throughputs(self.cost)  # with each instance's estimated speed
        top = int(tput.argmax())
        if tput[top] <= 0.0:
            return None
        # Cheap exact pre-check: T_min over every other instance is the lowest it can be
        # (the hosts below are a subset); within phi there, within phi below.
        others = np.delete(tput, top)
        if others.min() > 0.0 and tput[top] / others.min() <= self.phi_throughput:
            return None
        wait = fleet.wait[top]
        trajs = self._unmoved(fleet.run[top] + wait[: len(wait) - excess_of.get(top, 0)])
        if len(trajs) < 2:
            return None
        need = max((t.v_traj for t in trajs if t.v_traj is not None), default=0)
        hosts = fleet.version >= need
        hosts[top] = False
        if not hosts.any():
            return None
        n, kv = self._loads(fleet) if loads is None else loads
        if n is not fleet.n_run:  # the returns are counted
            low = float((self.cost.throughputs(n, kv) / fleet.speed)[hosts].min())
        else:
            low = float(tput[hosts].min())
        if low > 0.0 and tput[top] / low <= self.phi_throughput:
            return None
        if self.min_gain is not None:
            trajs = self._improving(fleet, top, trajs, n, kv)
            if not trajs:
                return None
        self._mark(trajs)
        return top, trajs

    def _improving(
        self,
        fleet: Fleet,
        top: int,
        trajs: tuple[TrajectoryView, ...],
        n: FloatArray,
        kv: FloatArray,
    ) -> tuple[TrajectoryView, ...]:
        """The improving moves out of ``top`` (class docstring), shortest first, from the
        loads ``n`` and ``kv`` (:meth:`_loads`)."""
        c = self.cost
        queued = {t.traj_id for t in fleet.wait[top]}
        n, kv = n.copy(), kv.copy()
        busy = fleet.n_wait > 0
        weight = 1.0 / fleet.speed
        out = []
        for t in sorted(trajs, key=lambda t: (t.length, t.traj_id)):
            length = float(t.length)
            if t.traj_id in queued:
                loss = 0.0  # a queued trajectory adds nothing where it is
            else:
                before = c.throughput(n[top], kv[top])
                after = c.throughput(n[top] - 1.0, max(0.0, kv[top] - c.k5 * length))
                loss = (before - after) * weight[top]
            gains = c.marginal_gains(n, kv, busy, length) * weight
            gains[top] = -np.inf
            if t.v_traj is not None:
                gains[fleet.version < t.v_traj] = -np.inf
            best = int(gains.argmax())
            if gains[best] - loss < self.min_gain * c.ideal_gain(length):
                break  # greedy: stop at the first move that does not pay
            out.append(t)
            if t.traj_id not in queued:
                n[top] -= 1.0
                kv[top] = max(0.0, kv[top] - c.k5 * length)
            n[best] += 1.0
            kv[best] += c.k5 * length
        return tuple(out)

    def _unmoved(self, trajs: tuple[TrajectoryView, ...]) -> tuple[TrajectoryView, ...]:
        """Those not moved by this strategy since they last generated a token."""
        moved_at = self._moved_at
        return tuple(t for t in trajs if moved_at.get(t.traj_id, -1) < t.length)

    def _mark(self, trajs: tuple[TrajectoryView, ...]) -> None:
        if len(self._moved_at) > 1 << 16:  # forget trajectories long gone
            self._moved_at.clear()
        for t in trajs:
            self._moved_at[t.traj_id] = t.length


class NoMigration:
    """Vanilla migration (§6.5): trajectories move only when a Pull interrupts them."""

    def select(self, fleet: Fleet) -> list[Migration]:
        del fleet
        return []
