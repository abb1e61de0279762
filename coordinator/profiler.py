"""Offline profiling of a rollout engine and the fit of k1..k4 (Appendix B).

``L = k1 * kv + max(k2, k3 * n) + k4`` is linear on each side of the knee
``n* = k2 / k3``: memory-bound below it (``k1 * kv + (k2 + k4)``), compute-bound above it
(``k1 * kv + k3 * n + k4``). We try every split of the measured running counts, solve one
joint least-squares problem per split (k1 and k4 shared by both sides), and keep the
split whose ``max``-form model has the smallest relative error. Rows are weighted by
``1 / latency`` so that the fit minimises relative, not absolute, error: the cost model
is used for ratios of throughputs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.cost_model import CostModel


@dataclass(frozen=True, slots=True)
class LatencySample:
    """One measured decode step: ``running`` trajectories, ``kv_cache`` tokens, seconds."""

    running: int
    kv_cache: float
    step_latency: float


@dataclass(frozen=True, slots=True)
class CostModelFit:
    model: CostModel
    mean_relative_error: float  # mean |predicted - measured| / measured over the samples
    max_relative_error: float
    knee: float  # k2 / k3: running count where matmuls turn compute-bound
    samples: int


def profile_grid(
    max_running: int, kv_budget: float, *, running_points: int = 16, kv_points: int = 8
) -> list[tuple[int, float]]:
    """(running, kv tokens) points that span both sides of the knee and the KV range."""
    if max_running < 2 or kv_budget <= 0:
        raise ValueError("profile_grid needs max_running >= 2 and kv_budget > 0")
    ns = np.unique(np.geomspace(1, max_running, running_points).round().astype(int))
    return [
        (int(n), float(kv))
        for n in ns
        for kv in np.linspace(kv_budget / kv_points, kv_budget, kv_points)
    ]


def profile(
    measure: Callable[[int, float], float], grid: Iterable[tuple[int, float]]
) -> list[LatencySample]:
    """Run ``measure(running, kv_tokens) -> seconds per step`` over ``grid``."""
    return [LatencySample(n, kv, measure(n, kv)) for n, kv in grid]


def fit_cost_model(
    samples: Sequence[LatencySample], *, k5: float = 1.0, kv_budget: float
) -> CostModelFit:
    """Least-squares fit of k1..k4 with the ``max(k2, k3 * n)`` knee found by search."""
    if len(samples) < 4:
        raise ValueError(f"fit_cost_model needs at least 4 samples, got {len(samples)}")
    n = np.array([s.running for s in samples], dtype=np.float64)
    kv = np.array([s.kv_cache for s in samples], dtype=np.float64)
    lat = np.array([s.step_latency for s in samples], dtype=np.float64)
    if np.any(lat <= 0) or np.any(n < 1) or np.any(kv < 0):
        raise ValueError("samples need step_latency > 0, running >= 1 and kv_cache >= 0")
    if np.ptp(kv) == 0:
        raise ValueError("profile several KV sizes: k1 cannot be fitted from one kv_cache value")
    weights = 1.0 / lat
    best: tuple[float, tuple[float, float, float, float]] | None = None
    distinct = np.unique(n)
    # split c: samples with n <= c are memory-bound; c = 0 means all compute-bound.
    for c in [0.0, *distinct.tolist()]:
        coeffs = _fit_split(n, kv, lat, weights, c, distinct)
        if coeffs is None:
            continue
        err = _relative_errors(coeffs, n, kv, lat).mean()
        if best is None or err < best[0]:
            best = (err, coeffs)
    if best is None:
        raise ValueError("profile more running counts: no split gave a well-posed fit")
    k1, k2, k3, k4 = best[1]
    model = CostModel(k1=k1, k2=k2, k3=k3, k4=k4, k5=k5, kv_budget=kv_budget)
    rel = _relative_errors(best[1], n, kv, lat)
    return CostModelFit(
        model=model,
        mean_relative_error=float(rel.mean()),
        max_relative_error=float(rel.max()),
        knee=model.knee,
        samples=len(samples),
    )


def _fit_split(
    n: np.ndarray,
    kv: np.ndarray,
    lat: np.ndarray,
    w: np.ndarray,
    c: float,
    distinct: np.ndarray,
) -> tuple[float, float, float, float] | None:
    left = n <= c
    n_right_distinct = int(np.count_nonzero(distinct > c))
    # Unknowns: k1, a = k2 + k4 (left intercept), k3, k4 (right intercept).
    design = np.zeros((len(n), 4))
    design[:, 0] = kv
    design[left, 1] = 1.0
    design[~left, 2] = n[~left]
    design[~left, 3] = 1.0
    used = [0]
    if left.any():
        used.append(1)
    if n_right_distinct >= 2:
        used += [2, 3]
    elif n_right_distinct == 1:
        return None  # k3 and k4 are not separable from one running count
    sol, *_ = np.linalg.lstsq(design[:, used] * w[:, None], lat * w, rcond=None)
    x = dict(zip(used, sol.tolist(), strict=True))
    k1 = max(x[0], 0.0)
    if 2 in x:
        k3, k4 = max(x[2], 0.0), max(x[3], 0.0)
        # All compute-bound: any k2 <= k3 * min(n) fits; take the largest.
        k2 = max(x[1] - k4, 0.0) if 1 in x else k3 * float(n.min())
    else:
        # All memory-bound: k2 and k4 only show up as a sum and k3 not at all. Put the
        # intercept in k2 and the knee just above the largest measured count.
        k4 = 0.0
        k2 = max(x[1], 0.0)
        k3 = k2 / (float(n.max()) + 1.0)
    if k2 + k4 <= 0.0:
        return None
    return k1, k2, k3, k4


def _relative_errors(
    coeffs: tuple[float, float, float, float], n: np.ndarray, kv: np.ndarray, lat: np.ndarray
) -> np.ndarray:
    k1, k2, k3, k4 = coeffs
    pred = k1 * kv + np.maximum(k2, k3 * n) + k4
    out: np.ndarray = np.abs(pred - lat) / lat
    return out
