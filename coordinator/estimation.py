"""Online per-instance speed: what each instance really does, learned from its snapshots.

The cost model (Eq. 2, Appendix B) is profiled once, offline, for one kind of instance.
Real instances differ from it and from each other, persistently (slow nodes, MoE expert
imbalance, mixed hardware) and over time (throttling, a noisy neighbour); Appendix B.2
measures a 10.5% mean error on one instance. Routing, synchronisation and migration all
compare instances through the model, so an instance 30% slower than the rest receives as
much work as the others and holds back every group it touches.

The estimator measures each instance's decode step latency between two valid snapshots
and keeps, per instance, a factor ``s_i`` by which the model's latency is multiplied to
match it: the instance's cost model is the profiled one scaled by ``s_i`` (Eq. 11 with
``k1..k4`` times ``s_i``), refitted at every clean observation. Strategies then use
``T_i = n / (s_i * L(n, kv))``; for Eq. 3 that scales the marginal gain by ``1 / s_i``.
When every instance is slower than the profile they take the factors relative to the
fastest one (``plan_cycle``): mu compares a gain with the model's ideal gain, and a fleet
slower than its profile throughout must not withhold its work.

How a step latency is measured. Every snapshot lists the running trajectories with their
lengths. A trajectory running at both snapshots gained exactly one token per decode step,
so ``(t1 - t0) / (length1 - length0)`` is the instance's mean step latency over the
interval, to be compared with the model's latency at the interval's mean ``(n, kv)``.
One anchor trajectory per instance suffices (the oldest running one, the last to be
preempted). An interval is *disturbed*, and skipped, when the coordinator sent the
instance a command in it (a Route or Interrupt costs prefill or stalls, a Pull blocks) or
the instance queued trajectories at either end (preemption re-prefills): that time is
not decoding, and the model does not describe it.

Factors are smoothed in log space with an exponential half-life in seconds, so they track
time-varying slowdowns while ignoring one noisy interval; an instance never observed takes
the median of the observed ones (1.0 before any observation). Cost: O(instances) per
cycle, plus a scan of a run list only when its anchor is not at its head.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from coordinator.commands import Command
from coordinator.cost_model import CostModel
from coordinator.types import InstanceId, InstanceSnapshot, Snapshot
from staleness.types import TrajId


@dataclass(slots=True)
class _Anchor:
    traj_id: TrajId
    length: int
    t: float
    n: int
    kv: float


class SpeedEstimator:
    """Per-instance step-latency factors (module docstring). Pure: fed snapshots and the
    commands issued, it returns numbers; no clock of its own."""

    def __init__(
        self,
        cost: CostModel,
        *,
        halflife_s: float = 30.0,
        min_steps: int = 8,
        bounds: tuple[float, float] = (0.2, 5.0),
    ) -> None:
        if not halflife_s > 0:
            raise ValueError(f"halflife_s must be > 0 (got {halflife_s})")
        if min_steps < 1:
            raise ValueError(f"min_steps must be >= 1 (got {min_steps})")
        if not 0 < bounds[0] <= 1.0 <= bounds[1]:
            raise ValueError(f"bounds must bracket 1.0 (got {bounds})")
        self.cost = cost
        self.halflife_s = halflife_s
        self.min_steps = min_steps
        self._log_bounds = (math.log(bounds[0]), math.log(bounds[1]))
        self._anchors: dict[InstanceId, _Anchor] = {}
        self._log_factor: dict[InstanceId, float] = {}
        self._touched: set[InstanceId] = set()
        self.observations = 0  # clean intervals used so far

    def note(self, commands: Iterable[Command]) -> None:
        """The commands just issued: the next interval of their instances is disturbed."""
        self._touched.update(c.inst for c in commands)

    def observe(self, snapshot: Snapshot) -> None:
        """Update the factors from a validated snapshot (see the module docstring)."""
        now = snapshot.taken_at
        touched, self._touched = self._touched, set()
        for s in snapshot.instances:
            anchor = self._anchors.get(s.inst)
            if anchor is not None and s.inst not in touched and not s.wait_trajs:
                self._measure(s, anchor, now)
            run = s.run_trajs
            if run and not s.wait_trajs:
                head = run[0]
                self._anchors[s.inst] = _Anchor(
                    head.traj_id, head.length, now, len(run), float(s.kv_cache)
                )
            else:
                self._anchors.pop(s.inst, None)

    def _measure(self, s: InstanceSnapshot, a: _Anchor, now: float) -> None:
        dt = now - a.t
        if dt <= 0.0:
            return
        run = s.run_trajs
        length = -1
        if run and run[0].traj_id == a.traj_id:
            length = run[0].length
        else:
            for t in run:
                if t.traj_id == a.traj_id:
                    length = t.length
                    break
        steps = length - a.length
        if steps < self.min_steps:
            return  # gone, preempted and back, or too few steps to time
        # per token the anchor gained (a step's worth without speculation)
        predicted = self.cost.token_latency((a.n + len(run)) / 2.0, (a.kv + s.kv_cache) / 2.0)
        observed = math.log(dt / steps / predicted)
        lo, hi = self._log_bounds
        observed = min(max(observed, lo), hi)
        old = self._log_factor.get(s.inst)
        if old is None:
            self._log_factor[s.inst] = observed
        else:
            w = 1.0 - 0.5 ** (dt / self.halflife_s)
            self._log_factor[s.inst] = old + w * (observed - old)
        self.observations += 1

    def set_factor(self, inst: InstanceId, factor: float) -> None:
        """Start ``inst`` from a known factor (e.g. one profiled per instance); later
        observations refine it."""
        if not factor > 0:
            raise ValueError(f"factor must be > 0 (got {factor})")
        lo, hi = self._log_bounds
        self._log_factor[inst] = min(max(math.log(factor), lo), hi)

    def factor(self, inst: InstanceId) -> float:
        """Latency multiplier of ``inst`` (> 1: slower than the model)."""
        log = self._log_factor.get(inst)
        return math.exp(log) if log is not None else self._prior()

    def factors(self, ids: Iterable[InstanceId]) -> npt.NDArray[np.float64]:
        """Latency multipliers for ``ids``, in order."""
        prior = self._prior()
        get = self._log_factor.get
        return np.array(
            [math.exp(v) if (v := get(i)) is not None else prior for i in ids], dtype=np.float64
        )

    def relative(self, ids: Iterable[InstanceId]) -> npt.NDArray[np.float64]:
        """``factors`` as the fleet's cycle uses them. mu compares a gain with the model's
        ideal one, so the fastest instance, idle, must always clear it: a fleet slower than
        its profile throughout (a loaded machine) is taken relative to its fastest
        instance. In absolute terms a fleet measured 5x slower withheld every trajectory,
        its idle instances measured nothing new, and the run stalled for good."""
        factors = self.factors(ids)
        if len(factors) and factors.min() > 1.0:
            factors = factors / factors.min()
        return factors

    def _prior(self) -> float:
        if not self._log_factor:
            return 1.0
        return math.exp(float(np.median(list(self._log_factor.values()))))
