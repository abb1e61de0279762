"""The throughput cost model of Eq. 2-4 / Appendix B.

Step latency of an instance with ``n`` running trajectories and ``kv`` cached tokens::

    L(n, kv) = k1 * kv + max(k2, k3 * n) + k4          (seconds per decode step)
    T(n, kv) = n / L(n, kv)                             (tokens per second)

Units (see ``coordinator.types``): ``kv`` and the budget ``kv_budget`` (M) are KV tokens;
``k5`` is KV tokens per trajectory token; k1 is s/token, k2 and k4 are s, k3 is s per
running trajectory.

Prefill (beyond Eq. 2, for multi-turn work): a prefix of ``L`` tokens costs
``p1 * L + p2 * L**2`` seconds to prefill, during which the instance's batch does not
decode. Eq. 2 leaves it out (its trajectories are prefilled once); a next turn that
leaves the instance caching its prefix pays it again, so KV-locality routing weighs it
(``coordinator.agentic``). 0 (the default) makes every move free.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class CostModel:
    k1: float
    k2: float
    k3: float
    k4: float
    k5: float
    kv_budget: float  # M
    prefill_s_per_token: float = 0.0  # p1
    prefill_s_per_token_sq: float = 0.0  # p2

    def __post_init__(self) -> None:
        for name in ("k1", "k2", "k3", "k4", "prefill_s_per_token", "prefill_s_per_token_sq"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"cost model {name} must be >= 0 (got {getattr(self, name)})")
        if not self.k2 + self.k4 > 0.0:
            raise ValueError("cost model k2 + k4 must be > 0: an empty step still takes time")
        if not self.k5 > 0.0:
            raise ValueError(f"cost model k5 must be > 0 KV tokens per token (got {self.k5})")
        if not self.kv_budget > 0.0:
            raise ValueError(f"cost model kv_budget must be > 0 tokens (got {self.kv_budget})")

    def prefill_seconds(self, length: float, cached: float = 0.0) -> float:
        """Seconds to prefill a prefix of ``length`` tokens of which the first ``cached``
        are in the instance's KV cache already (only the rest is computed; each of its
        tokens attends to everything before it)."""
        new = max(0.0, length - cached)
        return new * self.prefill_s_per_token + self.prefill_s_per_token_sq * (
            length * length - cached * cached
        )

    @property
    def knee(self) -> float:
        """``k2 / k3``: the running count above which a step turns compute-bound."""
        return self.k2 / self.k3 if self.k3 > 0.0 else float("inf")

    def step_latency(self, n: float, kv: float) -> float:
        """Eq. 11: seconds per decode step."""
        return self.k1 * kv + max(self.k2, self.k3 * n) + self.k4

    def throughput(self, n: float, kv: float) -> float:
        """Eq. 2: tokens per second of an instance running ``n`` trajectories."""
        return n / (self.k1 * kv + max(self.k2, self.k3 * n) + self.k4)

    def runnable(self, kv: float, n_wait: float, length: float) -> bool:
        """Eq. 3's ``y``: a routed trajectory runs at once (it fits, nothing is queued)."""
        return n_wait == 0 and kv + self.k5 * length <= self.kv_budget

    def marginal_gain(self, n: float, kv: float, n_wait: float, length: float) -> float:
        """Eq. 3: throughput gained by routing a trajectory of ``length`` tokens here.

        A trajectory that must queue adds nothing to T; 0 is returned for it. (All gain
        functions here evaluate in the same operation order, so that equal states give
        bit-identical gains and ties break the same way everywhere.)
        """
        if n_wait != 0 or kv + self.k5 * length > self.kv_budget:
            return 0.0
        k1, k2, k3, k4 = self.k1, self.k2, self.k3, self.k4
        n1 = n + 1.0
        latency1 = k1 * kv + max(k2, k3 * n1) + k4 + k1 * self.k5 * length
        return n1 / latency1 - n / (k1 * kv + max(k2, k3 * n) + k4)

    def ideal_gain(self, length: float) -> float:
        """Eq. 4: the gain of routing to an idle instance, an upper bound for any instance.

        Algorithm 3 line 21 writes ``k1 * k2 * length + max(k2, k3) + k4``; that mixes a
        latency into a token count and is dimensionally wrong. We use Eq. 4, which is the
        marginal gain of Eq. 3 on an idle instance.
        """
        # routing.py _ideal_gain computes the same expression, constants bound once
        return 1.0 / (self.k1 * self.k5 * length + max(self.k2, self.k3) + self.k4)

    def throughputs(self, n: FloatArray, kv: FloatArray) -> FloatArray:
        """Eq. 2 for many instances at once."""
        latency = self.k1 * kv + np.maximum(self.k2, self.k3 * n) + self.k4
        out: FloatArray = n / latency
        return out

    def marginal_gains(
        self, n: FloatArray, kv: FloatArray, queued: BoolArray, length: float | FloatArray
    ) -> FloatArray:
        """Eq. 3 for many instances (and lengths, by broadcasting); ``-inf`` where the
        trajectory would queue."""
        n1 = n + 1.0
        latency1 = self.k1 * kv + np.maximum(self.k2, self.k3 * n1) + self.k4
        gain: FloatArray = n1 / (latency1 + self.k1 * self.k5 * length) - self.throughputs(n, kv)
        return np.where(queued | (kv + self.k5 * length > self.kv_budget), -np.inf, gain)


# Qwen3-30B-A3B on one H20 (96 GB) per rollout instance, bf16, k1..k4 from Table 4.
# k5: one KV token per trajectory token (kv_cache is counted in tokens).
# M: 48 layers x 4 KV heads x 128 head dim x (K, V) x 2 bytes = 96 KiB per token; with
# SGLang's default static memory fraction (0.85 of ~95.6 GiB) minus ~57 GiB of weights
# about 24 GiB remain for the KV pool, i.e. ~262K tokens.
# Prefill: 2 x 3.3B active parameters per token and 2 x 48 layers x 4096 per token pair of
# causal attention, at 47% of an H20's 148 dense bf16 TFLOP/s (the simulator's calibration
# on Table 3, staleflow/sim/presets.py: qwen3_prefill).
QWEN3_30B_A3B_H20 = CostModel(
    k1=7.28e-8,
    k2=1.72e-3,
    k3=1.25e-4,
    k4=1.07e-2,
    k5=1.0,
    kv_budget=262_144.0,
    prefill_s_per_token=6.6e9 / (0.47 * 148e12),
    prefill_s_per_token_sq=2 * 48 * 4096 / (0.47 * 148e12),
)

PRESETS: dict[str, CostModel] = {"qwen3-30b-a3b-h20": QWEN3_30B_A3B_H20}
