"""Agentic (multi-turn, tool-using) work in the simulator: the drawn plans, and whole
runs that conserve every trajectory (instances, tools, TS and trainer) and hold eta by
the independent audit, for StaleFlow with and without its agentic rules and for the
baselines. Tiny scale: seconds."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from staleflow.sim import SimCluster, system
from staleflow.sim.agentic import AgenticConfig, AgenticWorkload, TurnPlan, draw_plan
from staleflow.sim.audit import StalenessAudit
from staleflow.sim.presets import AGENTIC, WORKLOADS, Layout
from staleflow.sim.summary import decision_figures


def test_a_plan_alternates_turns_and_tool_calls_within_the_context() -> None:
    c = AgenticConfig(
        turns_median=30,
        max_turns=40,
        turn_tokens_median=400,
        obs_tokens_median=800,
        max_context=8_000,
        latency_timeout_s=5.0,
        latency_sigma=2.0,
        fail_prob=0.3,
        max_retries=2,
    )
    rng = np.random.default_rng(0)
    for _ in range(200):
        p = draw_plan(c, rng, prompt=500, median=30.0)
        assert len(p.obs) == len(p.latency) == len(p.attempts) == p.turns - 1
        assert all(a < b for a, b in zip(p.ends, p.ends[1:], strict=False))
        assert 500 + p.total <= c.max_context  # the context cap ends the episode
        # each next turn starts after its observation
        for k, obs in enumerate(p.obs):
            assert p.turn_end(p.ends[k] + obs) == p.ends[k + 1]
            assert p.call_after(p.ends[k]) == k
        assert p.call_after(p.total) is None
        # retries: 1..3 attempts, each cut at the timeout
        assert all(1 <= a <= 3 for a in p.attempts)
        assert all(
            0 < w <= a * c.latency_timeout_s for w, a in zip(p.latency, p.attempts, strict=True)
        )


def test_plans_are_the_seeds_alone() -> None:
    c = WORKLOADS["swe-agent"].agentic
    assert c is not None
    a, b = AgenticWorkload(c, 8, seed=3), AgenticWorkload(c, 8, seed=3)
    for _ in range(5):
        sa, sb = a.next_sample(), b.next_sample()
        assert sa.response_lengths == sb.response_lengths
    plan = a.plan(0, 100)
    assert isinstance(plan, TurnPlan) and plan == b.plan(0, 100)
    assert a.plan(0, 100) is plan  # asked again: the same member


def _run(name: str, workload: str, eta: int, **agentic: Any) -> tuple[SimCluster, StalenessAudit]:
    w = WORKLOADS[workload]
    base = w.config(eta, steps=eta + 3, seed=1, rollout_gpus=4, small=True)
    config = system(name, base, Layout(4, 4))
    if agentic:
        co = config.coordinator
        config = replace(config, coordinator=replace(co, agentic=replace(co.agentic, **agentic)))
    cluster = SimCluster(config)
    audit = StalenessAudit().attach(cluster)
    checks: list[list[str]] = []
    cluster.observers.append(lambda c: checks.append(c.check()) if c.now % 7 < 0.5 else None)
    summary = cluster.run()
    assert not summary.stalled
    assert all(not problems for problems in checks), next(p for p in checks if p)
    assert cluster.check() == []
    return cluster, audit


@pytest.mark.parametrize("workload", AGENTIC)
@pytest.mark.parametrize(
    ("name", "rules"),
    [
        ("staleflow", {}),
        ("staleflow", {"kv_locality": False, "expected_returns": False, "tool_pulls": False}),
        ("sticky", {}),
        ("vanilla", {}),
        ("sync", {}),
    ],
)
def test_agentic_runs_conserve_trajectories_and_hold_eta(
    workload: str, name: str, rules: dict[str, Any]
) -> None:
    eta = 2
    cluster, audit = _run(name, workload, eta, **rules)
    assert cluster.envs is not None
    stats = cluster.envs.stats
    assert stats.calls > 0 and stats.wait_s > 0  # tools were called and waited on
    assert audit.trajectories > 0
    bound = 0 if name == "sync" else eta
    assert audit.max_staleness_oldest_token <= bound
    # observations were appended and trained on: the consumed trajectories are longer
    # than their model turns
    turns = sum(i.times.turns for i in cluster.instances.values())
    assert turns >= stats.calls


def test_every_decision_is_recorded_with_its_scene() -> None:
    """The run keeps one record per plan_cycle (a valid snapshot), with what it decided
    over: the trajectories at their tools are counted apart from those on instances."""
    cluster, _ = _run("staleflow", "swe-agent", 2)
    stats = cluster.coordinator.stats
    assert len(cluster.decisions) == stats.decisions == stats.cycles - stats.discarded > 0
    assert all(d.instances == 4 and d.cpu_s >= 0.0 for d in cluster.decisions)
    assert max(d.waiting_on_tools for d in cluster.decisions) > 0
    assert max(d.on_instances for d in cluster.decisions) > 0
    figures = decision_figures(cluster.decisions)
    ms = sorted(d.cpu_s * 1e3 for d in cluster.decisions)
    assert figures["decisions"] == len(ms) and figures["decision_ms_max"] == ms[-1]
    assert ms[0] <= figures["decision_ms_median"] <= figures["decision_ms_p90"] <= ms[-1]
    assert decision_figures([]) == {}


def test_a_cached_prefix_is_reused_when_the_next_turn_comes_back() -> None:
    """keep_kv with KV locality: most of a next turn's prefix comes from the cache."""
    cluster, _ = _run("staleflow", "swe-agent", 2)
    hits = sum(i.times.prefix_hits for i in cluster.instances.values())
    again = sum(i.times.reprefill_tokens for i in cluster.instances.values())
    assert hits > again > 0 or (hits > 0 and again == 0)
