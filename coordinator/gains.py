"""Eq. 3 marginal gains for the routing loop, computed lazily and updated incrementally.

Routing asks, for one trajectory length at a time, "which instance of version group ``b``
gains most?". The parts of Eq. 3 that do not depend on the length (``T(S)``, and the
latency of ``S'`` without the new tokens) are kept per instance and change only for the
instance that receives a route, so a new length costs one short vector expression per
version group actually visited, and a route costs O(1).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from coordinator.cost_model import CostModel

FloatArray = npt.NDArray[np.float64]


class GainTable:
    """Gains of instances laid out in version-bucket order (``starts``/``ends``)."""

    __slots__ = (
        "_a1",
        "_coeffs",
        "_fresh",
        "_g",
        "_headroom",
        "_k1k5",
        "_length",
        "_np1",
        "_t0",
        "cost",
        "ends",
        "kv",
        "n",
        "starts",
    )

    def __init__(
        self,
        cost: CostModel,
        n: FloatArray,
        kv: FloatArray,
        queued: npt.NDArray[np.bool_],
        starts: list[int],
        ends: list[int],
    ) -> None:
        k1, k2, k3, k4 = cost.k1, cost.k2, cost.k3, cost.k4
        self.cost, self.starts, self.ends = cost, starts, ends
        self.n, self.kv = n, kv
        self._k1k5 = k1 * cost.k5  # the operation order matches CostModel.marginal_gains
        self._coeffs = (k1, k2, k3, k4, cost.k5, cost.kv_budget)
        self._np1 = n + 1.0
        self._a1 = k1 * kv + np.maximum(k2, k3 * self._np1) + k4  # latency of S' minus new KV
        self._t0 = n / (k1 * kv + np.maximum(k2, k3 * n) + k4)  # T(S)
        self._headroom = cost.kv_budget - kv
        self._headroom[queued] = -np.inf  # Eq. 3: a queued engine takes nothing at once
        self._g = np.empty(len(n))
        self._length = -1.0
        self._fresh = len(starts)  # buckets >= this one hold gains for self._length

    def best(self, b: int, length: float) -> tuple[int, float]:
        """(index, gain) of the best instance of bucket ``b`` for a trajectory of ``length``;
        the gain is ``-inf`` where the trajectory would have to queue."""
        if length != self._length:
            self._length = length
            self._fresh = len(self.starts)
        s, e = self.starts[b], self.ends[b]
        g = self._g
        if b < self._fresh:
            # The waterfall only moves to newer buckets, so compute every bucket from b on
            # at once: one vector expression costs about the same as a bucket's.
            stop = self.starts[self._fresh] if self._fresh < len(self.starts) else len(g)
            view = g[s:stop]
            np.divide(self._np1[s:stop], self._a1[s:stop] + self._k1k5 * length, out=view)
            view -= self._t0[s:stop]
            np.copyto(view, -np.inf, where=self._headroom[s:stop] < self.cost.k5 * length)
            self._fresh = b
        j = s if e - s == 1 else s + int(g[s:e].argmax())
        return j, float(g[j])

    def place(self, j: int, length: float) -> None:
        """Eq. 3's update of ``S`` after routing a trajectory of ``length`` to ``j``."""
        k1, k2, k3, k4, k5, budget = self._coeffs
        n = float(self.n[j]) + 1.0
        kv = float(self.kv[j]) + k5 * length
        self.n[j], self.kv[j], self._np1[j] = n, kv, n + 1.0
        self._a1[j] = a1 = k1 * kv + (k2 if k2 > k3 * (n + 1.0) else k3 * (n + 1.0)) + k4
        self._t0[j] = t0 = n / (k1 * kv + (k2 if k2 > k3 * n else k3 * n) + k4)
        self._headroom[j] = headroom = budget - kv
        if length == self._length:
            fits = headroom >= k5 * length
            self._g[j] = (n + 1.0) / (a1 + self._k1k5 * length) - t0 if fits else -np.inf
