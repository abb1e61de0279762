"""The simulated cluster runs the real staleness manager, TS and coordinator: every run
keeps the staleness bound, conserves trajectories and is deterministic for a seed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from staleflow.sim import SimCluster, TrainerCosts, paper_6_5, system, tiny
from staleflow.sim.presets import Layout
from trajectory_server.errors import TrajectoryGone


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("name", ["staleflow", "vanilla"])
def test_bound_and_conservation(name: str, eta: int, seed: int) -> None:
    cluster = SimCluster(system(name, tiny(eta=eta, steps=5, seed=seed)))
    # Check conservation after every period, not only at the end.
    while cluster.trainer.steps < cluster.config.steps:
        cluster.step()
        assert cluster.check() == []
        assert cluster.now < 10_000, "the simulated run stalled"
    assert cluster.batches, "nothing was consumed"
    for batch in cluster.batches:
        assert len(batch.groups) == cluster.config.batch_size
        assert max(batch.staleness) <= eta, (batch.version, batch.staleness)
        for g in batch.groups:
            assert len(g.trajectories) == cluster.config.group_size
    consumed = [t for b in cluster.batches for g in b.groups for t in g.trajectories]
    assert len(consumed) == len(set(consumed)) == len(cluster.consumed)


def test_eta_zero_is_on_policy() -> None:
    summary = SimCluster(tiny(eta=0, steps=5, seed=3)).run()
    assert summary.steps == 5
    assert set(summary.staleness) == {0}
    assert summary.max_staleness_per_batch == (0,) * 5


def test_staleness_is_used_when_allowed() -> None:
    summary = SimCluster(tiny(eta=2, steps=6, seed=0)).run()
    assert max(summary.staleness) == 2


def test_same_seed_same_summary() -> None:
    a = SimCluster(tiny(eta=2, steps=4, seed=7)).run()
    b = SimCluster(tiny(eta=2, steps=4, seed=7)).run()
    c = SimCluster(tiny(eta=2, steps=4, seed=8)).run()
    assert a == b
    assert a != c


@pytest.mark.parametrize("name", ["sync", "R1S0M1", "R0S1M0"])
def test_other_systems_run(name: str) -> None:
    cluster = SimCluster(system(name, tiny(eta=2, steps=3)))
    summary = cluster.run()
    assert summary.steps == 3 and summary.name == name
    assert cluster.check() == []
    if name == "sync":
        assert set(summary.staleness) == {0}


def test_unknown_system_names_the_choices() -> None:
    with pytest.raises(ValueError, match="R1S0M1"):
        system("R2S0M1", tiny())


def test_summary_figures_are_consistent() -> None:
    s = SimCluster(tiny(eta=1, steps=4)).run()
    assert s.tokens_per_s == pytest.approx(s.tokens / s.elapsed_s)
    assert sum(s.staleness.values()) == 4 * 4
    for ratio in (s.rollout_idle_ratio, s.rollout_prefill_ratio, s.trainer_idle_ratio):
        assert 0.0 <= ratio <= 1.0
    assert 0 < s.mean_response_len <= 2_000
    assert set(s.as_dict()) >= {"tokens_per_s", "staleness", "steps"}


@pytest.mark.slow
def test_paper_scale_runs_and_keeps_the_bound() -> None:
    cluster = SimCluster(paper_6_5(eta=1, steps=3))
    summary = cluster.run()
    assert summary.steps == 3 and max(summary.staleness) <= 1
    assert cluster.check() == []


def test_a_run_without_progress_stops_and_says_so() -> None:
    config = tiny(eta=1, steps=3).with_(
        trainer=TrainerCosts(step_overhead_s=1e6), stall_timeout_s=50.0
    )
    summary = SimCluster(config).run()
    assert summary.stalled and summary.steps == 0


def test_vanilla_routing_with_throughput_sync_does_not_stall() -> None:
    """R0S1M0 at eta = 3 used to stop at step 4: least-loaded routing put every group that
    only version 1 admits on the one instance Algorithm 4 had Pulled to version 1 (about
    a thousand queued trajectories), and with no migration and nothing in the TS for it,
    no Pull ever returned that queue to the TS. ``ThroughputSync`` now releases such a
    queue (coordinator/sync.py). A scaled-down §6.5 cluster (8 instances, batch 16) shows
    it in about a second; with the release disabled (phi_wait huge) it stalls."""
    config = system("R0S1M0", paper_6_5(eta=3, steps=5, seed=0, layout=Layout(8, 8)))
    config = config.with_(batch_size=16, stall_timeout_s=2000.0)
    cluster = SimCluster(config)
    summary = cluster.run()
    assert not summary.stalled and summary.steps == 5
    assert max(summary.staleness) <= 3 and cluster.check() == []
    off = config.with_(coordinator=replace(config.coordinator, phi_wait=10**6))
    assert SimCluster(off).run().stalled


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_redundancy_keeps_the_bound_aborts_the_surplus_and_conserves(eta: int) -> None:
    """Batch and group redundancy (§4.3, App. C): 5 groups run per buffer of 4 and 5
    members per group of 4; once a group or buffer is full, the surplus is dropped from
    the TS at once and Aborted on its instance at the next valid cycle."""
    config = tiny(eta=eta, steps=5, seed=eta).with_(batch_redundancy=0.25, group_redundancy=0.25)
    cluster = SimCluster(config)
    stats = cluster.coordinator.stats
    first_seen: dict[int, int] = {}  # dropped but still on an instance -> valid cycles then
    while cluster.trainer.steps < config.steps:
        cluster.step()
        assert cluster.check() == []
        valid = stats.cycles - stats.discarded
        for inst in cluster.instances.values():
            for tid in inst.holds():
                try:
                    cluster.ts.state_of(tid)
                except TrajectoryGone:
                    since = first_seen.setdefault(tid, valid)
                    assert valid == since, f"trajectory {tid} outlived a valid cycle"
        assert cluster.now < 10_000, "the simulated run stalled"
    for batch in cluster.batches:
        assert len(batch.groups) == config.batch_size
        assert max(batch.staleness) <= eta
        assert all(len(g.trajectories) == config.group_size for g in batch.groups)
    consumed = [t for b in cluster.batches for g in b.groups for t in g.trajectories]
    assert len(consumed) == len(set(consumed)) == len(cluster.consumed)
    s = cluster.ts.stats()
    # every consumed group left one of its five members behind, and some groups were dropped
    assert s.aborted_trajectories >= len(consumed) // config.group_size
    assert cluster.manager.aborted_groups > 0
    assert first_seen and cluster.planes.commands["abort"] > 0
