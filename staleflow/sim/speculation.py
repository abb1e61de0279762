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

The coordinator is told (``ClusterConfig.engine.speculation`` reaches its cost model,
``coordinator/cost_model.py``, whose ``step`` is this model's: the profile type, the draft
length and ``E[a|k]`` are the coordinator's, one implementation), unless
``EngineCosts.tell_coordinator`` is off: then its cost model stays the plain one and its
online per-instance estimator (``coordinator/estimation.py``) has to learn the speed-up as
a per-instance factor. ``tests/staleflow/sim/test_sim_speculation.py`` and
docs/speculation.md report both.
"""

from __future__ import annotations

from dataclasses import dataclass

from coordinator.cost_model import (
    MEASURED_ACCEPTANCE,
    SpeculationProfile,
    expected_accepted,
    fit_acceptance,
)
from staleflow.sim.truth import InstanceTruth, StepModel

__all__ = [
    "MEASURED_GROUP",
    "SpeculationProfile",
    "SpeculativeStep",
    "expected_accepted",
    "fit_acceptance",
    "speculative",
]


@dataclass(frozen=True, slots=True)
class SpeculativeStep:
    """An engine's step model with speculation: ``L_spec`` of the module docstring."""

    base: StepModel
    profile: SpeculationProfile

    def latency(self, n: int, kv: float) -> float:
        k = self.profile.draft_length(n)
        return self.base.latency(n * (1 + k), kv) / self.profile.kept(k)

    def kv_slope(self, n: int) -> float:
        k = self.profile.draft_length(n)
        return self.base.kv_slope(n * (1 + k)) / self.profile.kept(k)


def speculative(truth: InstanceTruth, profile: SpeculationProfile | None) -> InstanceTruth:
    """``truth`` with speculation on its steps (unchanged when ``profile`` is None)."""
    if profile is None:
        return truth
    return InstanceTruth(SpeculativeStep(truth.step, profile), truth.slowdowns, truth.speed)


# The grouped drafts of experiments/bench_speculation.py with the default adaptive range
# (8 / 32): coordinator.cost_model.MEASURED_ACCEPTANCE says where the figures come from.
MEASURED_GROUP = SpeculationProfile(MEASURED_ACCEPTANCE["group"])
