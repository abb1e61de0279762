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

Speculative decoding (docs/speculation.md): with a :class:`SpeculationProfile` each of the
``n`` running trajectories verifies ``k = draft_length(n)`` draft tokens per step (the
engines' adaptive rule), so a step computes ``n * (1 + k)`` tokens and keeps ``1 + E[a|k]``
per trajectory, ``E[a|k] = alpha * (1 - alpha**k) / (1 - alpha)`` at per-token acceptance
``alpha``::

    L_spec(n, kv) = k1 * kv + max(k2, k3 * n * (1 + k)) + k4   (seconds per step)
    T_spec(n, kv) = n * (1 + E[a|k]) / L_spec(n, kv)             (tokens per second)

Every rule turns a step into time per token through :meth:`CostModel.step` (or its
vector form :meth:`CostModel.steps`): the step's seconds and the tokens it keeps per
trajectory. Without a profile those are Eq. 11 and exactly ``1.0``, and every formula here
multiplies or divides by that ``1.0`` where the plain formula has nothing, which IEEE
arithmetic leaves exact: decisions are bit for bit those of the plain model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
BoolArray = npt.NDArray[np.bool_]


def expected_accepted(alpha: float, draft: float) -> float:
    """Mean accepted draft tokens of a ``draft``-token draft at per-token acceptance
    ``alpha`` (accepted until the first rejection)."""
    if draft <= 0 or alpha <= 0.0:
        return 0.0
    if alpha >= 1.0:
        return float(draft)
    return alpha * (1.0 - alpha**draft) / (1.0 - alpha)


def fit_acceptance(samples: Sequence[tuple[float, float]]) -> float:
    """The per-token acceptance whose :func:`expected_accepted` best fits measured
    (draft length, accepted per verification) pairs (least squares, by bisection on the
    monotone residual's derivative; the model is increasing in ``alpha``). A draft
    length may be a mean (counters: drafted / verifications)."""
    if not samples:
        raise ValueError("fit_acceptance needs at least one (draft, accepted) measurement")
    for draft, accepted in samples:
        if not draft > 0 or not 0.0 <= accepted <= draft:
            raise ValueError(
                f"measurement (draft={draft}, accepted={accepted}): need draft > 0 and "
                "0 <= accepted <= draft (accepted tokens per verification)"
            )

    def slope(alpha: float) -> float:  # d/d(alpha) of the squared error, up to a factor
        h = 1e-6
        return sum(
            (expected_accepted(alpha, k) - a)
            * (expected_accepted(alpha + h, k) - expected_accepted(alpha - h, k))
            for k, a in samples
        )

    lo, hi = 1e-6, 1.0 - 1e-6
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if slope(mid) > 0.0:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2.0


@dataclass(frozen=True, slots=True)
class SpeculationProfile:
    """What speculative decoding does to a step (module docstring): the per-token
    acceptance and the engines' adaptive draft length, ``min(max_draft,
    batch_draft_tokens // running)`` (``rollout.speculation``, the rule of
    ``staleflow.engines.drafts.SpeculationSettings.draft_length``)."""

    acceptance: float
    max_draft: int = 8
    batch_draft_tokens: int = 32
    # 1 + E[a|k] for k = 0..max_draft, computed once: the scalar and the vector forms
    # read the same floats, so routing's table and Algorithm 4's probe agree on ties
    _kept: tuple[float, ...] = field(init=False, repr=False, compare=False)
    _kept_array: FloatArray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance < 1.0:
            raise ValueError(
                f"speculation acceptance must be in [0, 1), got {self.acceptance!r} "
                "(fit it from measurements with fit_acceptance)"
            )
        if self.max_draft < 1 or self.batch_draft_tokens < 1:
            raise ValueError(
                f"speculation max_draft={self.max_draft} and batch_draft_tokens="
                f"{self.batch_draft_tokens} must be >= 1 (rollout.speculation's)"
            )
        kept = tuple(1.0 + expected_accepted(self.acceptance, k) for k in range(self.max_draft + 1))
        object.__setattr__(self, "_kept", kept)
        object.__setattr__(self, "_kept_array", np.array(kept))

    def draft_length(self, running: float) -> int:
        """Draft tokens each trajectory verifies when ``running`` decode (a mean count is
        floored by the division, as the engine's integer one)."""
        return int(min(self.max_draft, self.batch_draft_tokens // max(running, 1.0)))

    def kept(self, draft: int) -> float:
        """Tokens a trajectory keeps per step with ``draft`` draft tokens: 1 + E[a|k]."""
        return self._kept[draft]

    def draft_lengths(self, running: FloatArray | float) -> FloatArray:
        """:meth:`draft_length` for many running counts."""
        per = self.batch_draft_tokens // np.maximum(running, 1.0)
        out: FloatArray = np.minimum(float(self.max_draft), per)
        return out

    def kept_per_step(self, draft: FloatArray) -> FloatArray:
        """:meth:`kept` for many draft lengths (whole numbers, as :meth:`draft_lengths`)."""
        out: FloatArray = self._kept_array[draft.astype(np.intp)]
        return out


# Per-token acceptance fitted to experiments/bench_speculation.py (docs/speculation.md,
# "Measurements", 2026-11-29), accepted per verification at batch 1 and 4 (8-token drafts)
# and 16 (2-token drafts): grouped drafts 3.24, 3.90, 1.67; own-history 2.78, 3.09, 1.54.
# A stand-in policy whose siblings agree about as a trained one's do: the prior of a run
# until its engines' counters measure its own (learned_speculation).
MEASURED_ACCEPTANCE: dict[str, float] = {
    "group": fit_acceptance([(8, 3.24), (8, 3.90), (2, 1.67)]),
    "own": fit_acceptance([(8, 2.78), (8, 3.09), (2, 1.54)]),
}


# A measured acceptance is held below 1 (E[a|k] = k there, and the profile refuses 1).
MAX_ACCEPTANCE = 0.999


def learned_speculation(
    prior: SpeculationProfile,
    verifications: int,
    drafted: int,
    accepted: int,
    min_verifications: int = 64,
) -> SpeculationProfile:
    """``prior`` with the acceptance the engines' counters measure (drafts verified,
    draft tokens, accepted ones, as the step record sums them): the ``alpha`` whose
    ``E[a|k]`` at the mean draft length gives the accepted tokens per verification. The
    prior until ``min_verifications`` drafts were verified. Pure: what the caller passes."""
    if verifications < min_verifications or drafted <= 0:
        return prior
    draft = drafted / verifications
    accepted_per = min(max(accepted / verifications, 0.0), draft)
    alpha = min(fit_acceptance([(draft, accepted_per)]), MAX_ACCEPTANCE)
    return replace(prior, acceptance=alpha)


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
    # speculative decoding on the engines (module docstring); None: off
    speculation: SpeculationProfile | None = None

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
        """``k2 / k3``: the tokens per step above which a step turns compute-bound."""
        return self.k2 / self.k3 if self.k3 > 0.0 else float("inf")

    def with_speculation(self, profile: SpeculationProfile | None) -> CostModel:
        """This model with ``profile``'s speculation (None: off)."""
        return self if profile == self.speculation else replace(self, speculation=profile)

    # -- one step: its seconds and the tokens it keeps (module docstring) ---------------

    def decode_term(self, n: float) -> tuple[float, float]:
        """``max(k2, k3 * verified)`` of ``n`` running, and the tokens each keeps per step
        (``verified``: ``n``, or ``n * (1 + k)`` with speculation; kept: 1, or
        ``1 + E[a|k]``). Every step of this model is built from it."""
        spec = self.speculation
        if spec is None:
            return max(self.k2, self.k3 * n), 1.0
        k = spec.draft_length(n)
        return max(self.k2, self.k3 * (n * (1 + k))), spec.kept(k)

    def decode_terms(self, n: FloatArray | float) -> tuple[FloatArray, FloatArray | float]:
        """:meth:`decode_term` for many instances (kept is the float 1.0 without a profile)."""
        spec = self.speculation
        if spec is None:
            return np.maximum(self.k2, self.k3 * n), 1.0
        k = spec.draft_lengths(n)
        return np.maximum(self.k2, self.k3 * (n * (1.0 + k))), spec.kept_per_step(k)

    def step(self, n: float, kv: float) -> tuple[float, float]:
        """(seconds of one decode step of ``n`` running over ``kv`` cached tokens, tokens
        each running trajectory keeps from it)."""
        term, kept = self.decode_term(n)
        return self.k1 * kv + term + self.k4, kept

    def steps(
        self, n: FloatArray | float, kv: FloatArray | float
    ) -> tuple[FloatArray, FloatArray | float]:
        """:meth:`step` for many instances."""
        term, kept = self.decode_terms(n)
        return self.k1 * kv + term + self.k4, kept

    def step_latency(self, n: float, kv: float) -> float:
        """Eq. 11: seconds per decode step."""
        return self.step(n, kv)[0]

    def token_latency(self, n: float, kv: float) -> float:
        """Seconds per token of each of ``n`` running trajectories (Eq. 11 without
        speculation; ``L_spec / (1 + E[a|k])`` with it)."""
        latency, kept = self.step(n, kv)
        return latency / kept

    def token_latencies(self, n: FloatArray | float, kv: FloatArray | float) -> FloatArray:
        """:meth:`token_latency` for many instances."""
        latency, kept = self.steps(n, kv)
        out: FloatArray = latency / kept
        return out

    def kv_slope(self, n: float) -> float:
        """Seconds per token added by one more cached token (at ``n`` running): ``k1``,
        over the tokens kept per step with speculation."""
        return self.k1 / self.decode_term(n)[1]

    def kv_slopes(self, n: FloatArray | float) -> FloatArray | float:
        """:meth:`kv_slope` for many instances (the float ``k1`` without a profile)."""
        spec = self.speculation
        if spec is None:
            return self.k1
        out: FloatArray = self.k1 / spec.kept_per_step(spec.draft_lengths(n))
        return out

    def verified(self, n: float) -> float:
        """Tokens one step of ``n`` running computes (``n * (1 + k)`` with speculation),
        the count :attr:`knee` compares with."""
        spec = self.speculation
        return n if spec is None else n * (1 + spec.draft_length(n))

    def throughput(self, n: float, kv: float) -> float:
        """Eq. 2: tokens per second of an instance running ``n`` trajectories."""
        latency, kept = self.step(n, kv)
        return n * kept / latency

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
        n1 = n + 1.0
        latency1, kept1 = self.step(n1, kv)
        latency1 = latency1 + self.k1 * self.k5 * length
        return n1 * kept1 / latency1 - self.throughput(n, kv)

    def ideal_gain(self, length: float | FloatArray) -> float | FloatArray:
        """Eq. 4: the gain of routing to an idle instance, an upper bound for any instance
        (for many lengths at once, by broadcasting).

        Algorithm 3 line 21 writes ``k1 * k2 * length + max(k2, k3) + k4``; that mixes a
        latency into a token count and is dimensionally wrong. We use Eq. 4, which is the
        marginal gain of Eq. 3 on an idle instance.
        """
        # routing.py _ideal_gain computes the same expression, constants bound once
        top, kept = self.decode_term(1.0)
        return kept / (self.k1 * self.k5 * length + top + self.k4)

    def throughputs(self, n: FloatArray, kv: FloatArray) -> FloatArray:
        """Eq. 2 for many instances at once."""
        latency, kept = self.steps(n, kv)
        out: FloatArray = n * kept / latency
        return out

    def marginal_gains(
        self, n: FloatArray, kv: FloatArray, queued: BoolArray, length: float | FloatArray
    ) -> FloatArray:
        """Eq. 3 for many instances (and lengths, by broadcasting); ``-inf`` where the
        trajectory would queue."""
        n1 = n + 1.0
        latency1, kept1 = self.steps(n1, kv)
        gain: FloatArray = n1 * kept1 / (latency1 + self.k1 * self.k5 * length) - self.throughputs(
            n, kv
        )
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
