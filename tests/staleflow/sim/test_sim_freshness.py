"""The freshness rule (coordinator/freshness.py) in whole simulated runs: where the trainer
binds it makes the data fresher at the same throughput, where the rollout binds it gives
way, and the bound holds either way (checked on the engines' own token versions)."""

from __future__ import annotations

from dataclasses import replace

from staleflow.sim import SimCluster, system, tiny
from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.summary import Summary, summarise
from tests.staleflow.sim.test_sim_staleness_bound import assert_within_eta, run


def short_responses(trainer_slowdown: float, eta: int = 3, steps: int = 30) -> ClusterConfig:
    """``tiny`` with 400-token responses (a group takes a few seconds) and a trainer
    ``trainer_slowdown`` times slower: 8 makes each step several times a group's time."""
    base = tiny(eta, steps=steps, seed=0)
    return replace(
        base,
        workload=replace(base.workload, max_response=400),
        trainer=base.trainer.sped_up(1.0 / trainer_slowdown),
    )


def mean_staleness(s: Summary) -> float:
    return sum(k * n for k, n in s.staleness.items()) / sum(s.staleness.values())


def both(config: ClusterConfig) -> tuple[Summary, Summary, SimCluster]:
    off = SimCluster(system("staleflow", config))
    on = SimCluster(system("staleflow+fresh", config))
    run(off)
    consumed = run(on)
    assert_within_eta(consumed, config.eta, config.batch_size, config.group_size)
    return summarise(off), summarise(on), on


def test_where_the_trainer_binds_the_data_is_fresher_at_the_same_throughput() -> None:
    off, on, cluster = both(short_responses(8.0))
    assert off.trainer_busy_steady > 0.95  # trainer-bound
    rule = cluster.loop.coordinator.strategies.freshness
    assert rule is not None and rule.state.held_cycles > 0
    assert mean_staleness(on) < mean_staleness(off) - 0.5
    assert on.tokens_per_s >= 0.98 * off.tokens_per_s
    # what the rule takes off is the steps a complete batch waits for the trainer: off,
    # the rollout runs the window ahead and batches wait more than the one step that a
    # batch completed during the step before it waits
    assert off.ready_wait_versions > 1.5
    assert on.ready_wait_versions < off.ready_wait_versions - 0.5


def test_at_eta_0_every_batch_is_complete_only_when_the_trainer_wants_it() -> None:
    off = SimCluster(system("staleflow", short_responses(8.0, eta=0, steps=6)))
    run(off)
    assert off.ready_wait[:6] == [0] * 6
    assert summarise(off).ready_wait_versions == 0.0


def test_where_the_rollout_binds_it_gives_way() -> None:
    off, on, cluster = both(short_responses(0.2))
    assert off.trainer_busy_steady < 0.5  # the trainer waits: rollout-bound
    rule = cluster.loop.coordinator.strategies.freshness
    assert rule is not None and rule.state.giving_way
    assert on.staleness == off.staleness
    assert on.tokens_per_s == off.tokens_per_s
