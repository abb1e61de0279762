"""Speculative decoding in the simulator: what verifying drafts does to a decode step.

An engine with ``rollout.speculation`` on (docs/speculation.md) feeds every running
trajectory up to ``k`` draft tokens per step, where ``k = draft_length(n)`` follows the
adaptive range of :class:`~staleflow.engines.drafts.SpeculationSettings` (the same rule
as the embedded engine: ``min(max_draft, batch_draft_tokens // n)``). The step then
computes ``n * (1 + k)`` tokens and each trajectory keeps ``1 + a`` of them, ``a`` being
its accepted draft tokens. Drafts are accepted token by token until the first rejection,
so with a per-token acceptance ``alpha`` (taken as the same for every position)

    E[a | k] = alpha * (1 - alpha**k) / (1 - alpha)

and one step of the engine's decode model at ``n`` running and ``kv`` cached tokens
becomes, per token of every running trajectory,

    L_spec(n, kv) = L(n * (1 + k), kv) / (1 + E[a | k])

(the base step's compute term sees the verified tokens; its KV term reads the cache once
per step, as a verification forward does). Modelled in expectation: the engine's
chunked arithmetic (``sim/engine.py``) needs a latency per token-step, and the variance
of ``a`` only moves completions by a few steps. At ``k = 0`` (a full batch) the step is
the plain one.

``alpha`` comes from measured profiles: :func:`fit_acceptance` takes (draft length,
accepted per verification) pairs as ``experiments/bench_speculation.py`` prints them;
:data:`MEASURED_GROUP` is its grouped-draft figures of 2026-11-29.

The coordinator is not told: its cost model stays the profiled plain one and its online
per-instance estimator (``coordinator/estimation.py``) measures a step latency as time per
token gained by an anchor trajectory, which is exactly ``L_spec``. How far that leaves
its estimates is what ``tests/staleflow/sim/test_sim_speculation.py`` and
docs/speculation.md report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from staleflow.engines.drafts import SpeculationSettings
from staleflow.sim.truth import InstanceTruth, StepModel


def expected_accepted(alpha: float, draft: int) -> float:
    """Mean accepted draft tokens of a ``draft``-token draft at per-token acceptance
    ``alpha`` (accepted until the first rejection)."""
    if draft <= 0 or alpha <= 0.0:
        return 0.0
    if alpha >= 1.0:
        return float(draft)
    return alpha * (1.0 - alpha**draft) / (1.0 - alpha)


def fit_acceptance(samples: Sequence[tuple[int, float]]) -> float:
    """The per-token acceptance whose :func:`expected_accepted` best fits measured
    (draft length, accepted per verification) pairs (least squares, by bisection on the
    monotone residual's derivative; the model is increasing in ``alpha``)."""
    if not samples:
        raise ValueError("fit_acceptance needs at least one (draft, accepted) measurement")
    for draft, accepted in samples:
        if draft < 1 or not 0.0 <= accepted <= draft:
            raise ValueError(
                f"measurement (draft={draft}, accepted={accepted}): need draft >= 1 and "
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
    """What speculation does on the simulated engines: the adaptive draft length and a
    per-token acceptance."""

    acceptance: float
    settings: SpeculationSettings = field(default_factory=SpeculationSettings)

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance < 1.0:
            raise ValueError(
                f"speculation acceptance must be in [0, 1), got {self.acceptance!r} "
                "(fit it from measurements with fit_acceptance)"
            )

    def draft_length(self, running: int) -> int:
        return self.settings.draft_length(running)

    def tokens_per_step(self, running: int) -> float:
        """Tokens each running trajectory gains per verification step, on average."""
        return 1.0 + expected_accepted(self.acceptance, self.draft_length(running))


@dataclass(frozen=True, slots=True)
class SpeculativeStep:
    """An engine's step model with speculation: ``L_spec`` of the module docstring."""

    base: StepModel
    profile: SpeculationProfile

    def latency(self, n: int, kv: float) -> float:
        k = self.profile.draft_length(n)
        return self.base.latency(n * (1 + k), kv) / self.profile.tokens_per_step(n)

    def kv_slope(self, n: int) -> float:
        k = self.profile.draft_length(n)
        return self.base.kv_slope(n * (1 + k)) / self.profile.tokens_per_step(n)


def speculative(truth: InstanceTruth, profile: SpeculationProfile | None) -> InstanceTruth:
    """``truth`` with speculation on its steps (unchanged when ``profile`` is None)."""
    if profile is None:
        return truth
    return InstanceTruth(SpeculativeStep(truth.step, profile), truth.slowdowns, truth.speed)


# The grouped drafts of experiments/bench_speculation.py (docs/speculation.md,
# "Measurements", 2026-11-29): accepted per verification 3.24 at batch 1 and 3.90 at
# batch 4 (8-token drafts), 1.67 at batch 16 (2-token drafts), with the default adaptive
# range (8 / 32). A stand-in policy whose siblings agree about as a trained one's do.
MEASURED_GROUP = SpeculationProfile(fit_acceptance([(8, 3.24), (8, 3.90), (2, 1.67)]))
