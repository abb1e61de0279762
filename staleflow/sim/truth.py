"""What the simulated engines really do, kept apart from what the coordinator estimates.

The coordinator decides with a cost model (``coordinator.cost_model``, Table 4). Real
engines differ from it in ways that matter to placement:

- **persistent per-instance speed** (``speed_sigma``): slow nodes, MoE expert imbalance,
  mixed hardware. Each instance's step latency is multiplied by ``exp(N(0, speed_sigma))``,
  drawn once per instance from the seed;
- **estimate error** (``coef_sigma``): the profiled k1..k4 are off. The engines' true
  coefficients are the estimate's, each multiplied by ``exp(N(0, coef_sigma))`` drawn once
  per run (one profile serves the whole cluster, so the error is shared);
- **time-varying slowdowns** (``slowdowns``): episodes (throttling, a noisy neighbour, a
  straggling collective) during which an instance's steps take ``factor`` times longer;
  they start as a Poisson process per instance and last an exponential time;
- **a measured profile** (``model``): the engines follow fitted coefficients (e.g.
  ``staleflow profile``'s output) while the coordinator keeps its own;
- **a trace of step times** (``step_trace``): measured ``(running, kv_cache, seconds)``
  decode steps; the engines interpolate them (linear in the KV cache at each measured
  running count, linear across running counts) instead of following any formula.

The per-chunk noise of :class:`~staleflow.sim.engine.EngineCosts` comes on top. None of
this is visible to the coordinator: it sees only snapshots. Every draw comes from its own
seeded generator, so turning a feature on does not change the other features' draws, and
with every feature off the engines follow the coordinator's model exactly as before.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import numpy as np

from coordinator.cost_model import CostModel
from coordinator.profiler import LatencySample

# Independent generator streams per seed (numpy SeedSequence entropy lists).
_SPEED, _SLOW, _COEF = 1, 2, 1 << 20


class StepModel(Protocol):
    """One decode step of ``n`` running trajectories over ``kv`` cached tokens."""

    def latency(self, n: int, kv: float) -> float:
        """Seconds of the step."""
        ...

    def kv_slope(self, n: int) -> float:
        """Seconds added to the step per cached token (at ``n`` running)."""
        ...


@dataclass(frozen=True, slots=True)
class ScaledCost:
    """The cost-model formula (Eq. 11) times a constant ``factor``."""

    cost: CostModel
    factor: float = 1.0

    def latency(self, n: int, kv: float) -> float:
        c = self.cost
        return self.factor * (c.k1 * kv + max(c.k2, c.k3 * n) + c.k4)

    def kv_slope(self, n: int) -> float:
        return self.factor * self.cost.k1


class StepTable:
    """Step latencies interpolated from measured decode steps.

    At every measured running count a least-squares line ``a + b * kv`` is fitted (one KV
    size gives a flat line); between running counts ``a`` and ``b`` are interpolated
    linearly, and beyond the measured range they are held at the nearest count's values
    (``numpy.interp``). The chunked engine needs exactly this shape: latency linear in
    the KV cache at a fixed running count.
    """

    __slots__ = ("_a", "_b", "_n", "factor")

    def __init__(self, samples: Sequence[LatencySample], factor: float = 1.0) -> None:
        if not samples:
            raise ValueError("a step trace needs at least one measured step")
        by_n: dict[int, list[LatencySample]] = {}
        for s in samples:
            if s.running < 1 or s.kv_cache < 0 or not s.step_latency > 0:
                raise ValueError(
                    f"measured step {s}: need running >= 1, kv_cache >= 0, step_latency > 0"
                )
            by_n.setdefault(s.running, []).append(s)
        ns, a, b = [], [], []
        for n in sorted(by_n):
            kv = np.array([s.kv_cache for s in by_n[n]])
            lat = np.array([s.step_latency for s in by_n[n]])
            if np.ptp(kv) > 0:
                slope, intercept = np.polyfit(kv, lat, 1)
                slope = max(float(slope), 0.0)  # latency never falls as the cache grows
                intercept = float(lat.mean() - slope * kv.mean())
            else:
                slope, intercept = 0.0, float(lat.mean())
            ns.append(float(n))
            a.append(intercept)
            b.append(slope)
        self._n, self._a, self._b = np.array(ns), np.array(a), np.array(b)
        self.factor = factor

    def scaled(self, factor: float) -> StepTable:
        out = StepTable.__new__(StepTable)
        out._n, out._a, out._b, out.factor = self._n, self._a, self._b, self.factor * factor
        return out

    def latency(self, n: int, kv: float) -> float:
        a = float(np.interp(n, self._n, self._a))
        b = float(np.interp(n, self._n, self._b))
        return self.factor * max(a + b * kv, 1e-9)

    def kv_slope(self, n: int) -> float:
        return self.factor * float(np.interp(n, self._n, self._b))


@dataclass(frozen=True, slots=True)
class Slowdowns:
    """Episodes during which an instance's steps take ``factor`` times longer.

    ``per_hour``: mean episodes per instance per hour of virtual time (0: none);
    ``mean_s``: mean episode length (exponential).
    """

    per_hour: float = 0.0
    factor: float = 2.0
    mean_s: float = 300.0

    def __post_init__(self) -> None:
        if self.per_hour < 0 or not self.factor >= 1.0 or not self.mean_s > 0:
            raise ValueError(f"Slowdowns({self}): need per_hour >= 0, factor >= 1 and mean_s > 0")


@dataclass(frozen=True, slots=True)
class EngineTruth:
    """How the engines differ from the coordinator's cost model (module docstring).

    The defaults change nothing: the engines follow the coordinator's model.
    """

    speed_sigma: float = 0.0
    coef_sigma: float = 0.0
    slowdowns: Slowdowns = field(default_factory=Slowdowns)
    model: CostModel | None = None
    step_trace: tuple[LatencySample, ...] = ()

    def __post_init__(self) -> None:
        for name in ("speed_sigma", "coef_sigma"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"EngineTruth.{name} must be >= 0 (got {getattr(self, name)})")
        if self.model is not None and self.step_trace:
            raise ValueError("EngineTruth: give a measured model or a step trace, not both")

    @property
    def exact(self) -> bool:
        """The engines follow the coordinator's model (no error, no speed differences)."""
        return (
            self.speed_sigma == 0.0
            and self.coef_sigma == 0.0
            and self.slowdowns.per_hour == 0.0
            and self.model is None
            and not self.step_trace
        )


class SlowdownClock:
    """The slowdown factor of one instance over its (non-decreasing) virtual clock.

    Episodes are drawn lazily, so the schedule is infinite and costs nothing when off.
    """

    __slots__ = ("_end", "_factor", "_mean_s", "_rate", "_rng", "_start")

    def __init__(self, slowdowns: Slowdowns, rng: np.random.Generator) -> None:
        self._rate = slowdowns.per_hour / 3600.0
        self._factor, self._mean_s, self._rng = slowdowns.factor, slowdowns.mean_s, rng
        self._start = self._end = math.inf
        if self._rate > 0:
            self._start = float(rng.exponential(1.0 / self._rate))
            self._end = self._start + float(rng.exponential(self._mean_s))

    def factor(self, t: float) -> float:
        while t >= self._end:  # draw the next episode after the one that ended
            self._start = self._end + float(self._rng.exponential(1.0 / self._rate))
            self._end = self._start + float(self._rng.exponential(self._mean_s))
        return self._factor if t >= self._start else 1.0


@dataclass(frozen=True, slots=True)
class InstanceTruth:
    """One instance's real step model and its slowdown episodes (None: none)."""

    step: StepModel
    slowdowns: SlowdownClock | None = None
    speed: float = 1.0  # the persistent speed factor drawn for it (for reports)


def true_cost(estimate: CostModel, truth: EngineTruth, seed: int) -> CostModel:
    """The coefficients the engines follow before per-instance speed: a measured model,
    or the estimate with its error applied."""
    if truth.model is not None:
        return truth.model
    if truth.coef_sigma == 0.0:
        return estimate
    z = np.random.default_rng([seed, _COEF]).standard_normal(4)
    f = np.exp(truth.coef_sigma * z)
    return replace(
        estimate,
        k1=estimate.k1 * f[0],
        k2=estimate.k2 * f[1],
        k3=estimate.k3 * f[2],
        k4=estimate.k4 * f[3],
    )


def instance_truths(
    estimate: CostModel, truth: EngineTruth, instances: int, seed: int
) -> list[InstanceTruth]:
    """What each of ``instances`` engines really does, deterministic for ``seed``."""
    base = true_cost(estimate, truth, seed)
    table = StepTable(truth.step_trace) if truth.step_trace else None
    out = []
    for i in range(instances):
        speed = 1.0
        if truth.speed_sigma > 0:
            speed = math.exp(truth.speed_sigma * np.random.default_rng([seed, i, _SPEED]).normal())
        step: StepModel = table.scaled(speed) if table is not None else ScaledCost(base, speed)
        slow = None
        if truth.slowdowns.per_hour > 0:
            slow = SlowdownClock(truth.slowdowns, np.random.default_rng([seed, i, _SLOW]))
        out.append(InstanceTruth(step, slow, speed))
    return out


def read_step_trace(path: str | Path) -> tuple[LatencySample, ...]:
    """Measured decode steps from CSV (header ``running,kv_cache,step_latency``) or JSONL
    (one ``{"running": 64, "kv_cache": 81920, "step_latency": 0.021}`` per line)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such step trace")
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[int, dict[str, object]]]
    if path.suffix.lower() == ".csv":
        reader = csv.DictReader(text.splitlines())
        rows = list(enumerate(reader, start=1))
    else:
        rows = []
        for i, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append((i, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: row {i}: not valid JSON ({e.msg})") from None
    out = []
    for i, row in rows:
        try:
            out.append(
                LatencySample(
                    int(str(row["running"])),
                    float(str(row["kv_cache"])),
                    float(str(row["step_latency"])),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"{path}: row {i}: need integer 'running' and numbers 'kv_cache', "
                f"'step_latency' ({e})"
            ) from None
    if not out:
        raise ValueError(f"{path}: the step trace holds no rows")
    StepTable(out)  # validate now: a bad row names itself here, not mid-run
    return tuple(out)
