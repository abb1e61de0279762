"""SpecActor's tail race in the simulator (coordinator.race, staleflow/sim/race.py).

- whole runs at eta 0, 1 and 3 keep the staleness bound and conserve trajectories, checked
  after every cycle while copies run, and races happen on the skewed workloads;
- unbiased: every trained response is as long as the target the workload drew for it,
  whichever copy won, and per prompt the trained lengths are those of the same seed without
  racing;
- a slow holder and an idle instance: the copy wins, the trajectory completes as the
  holder's, and the holder's tokens after the fork are race-wasted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from coordinator import RaceConfig
from staleflow.sim import ClusterConfig, SimCluster, system, tiny
from staleflow.sim.presets import WORKLOADS
from staleflow.sim.truth import InstanceTruth, ScaledCost
from tests.staleflow.sim.test_sim_staleness_bound import assert_within_eta, run


def _race(config: ClusterConfig, copies: int = 1) -> ClusterConfig:
    race = RaceConfig(enabled=True, copies=copies)
    return replace(config, coordinator=replace(config.coordinator, race=race))


def _recorded(cluster: SimCluster) -> tuple[dict[int, int], dict[int, int], list[str]]:
    """Record the drawn targets (traj -> response length), the trained lengths and the
    conservation problems seen after every cycle."""
    drawn: dict[int, int] = {}
    trained: dict[int, int] = {}
    problems: list[str] = []
    target, take = cluster.planes._target, cluster.ts.take_batch

    def drawing(sample_id: int, traj_id: int) -> int:
        drawn[traj_id] = target(sample_id, traj_id)
        return drawn[traj_id]

    def taking(*args: Any, **kwargs: Any) -> Any:
        taken = take(*args, **kwargs)
        for g in taken.groups:
            trained.update((tr.traj_id, len(tr.tokens)) for tr in g.trajectories)
        return taken

    cluster.planes._target = drawing  # type: ignore[method-assign]
    cluster.ts.take_batch = taking  # type: ignore[method-assign]
    cluster.observers.append(lambda c: problems.extend(c.check()))
    return drawn, trained, problems


CASES = [("bimodal", 0), ("bimodal", 1), ("heavy-tail", 0), ("outliers", 1)]


@pytest.mark.parametrize("eta", [0, 1, 3])
def test_the_bound_and_conservation_hold_while_racing(eta: int) -> None:
    configs = [_race(tiny(eta=eta, steps=4, seed=s)) for s in range(2)]
    configs += [_race(system("staleflow", WORKLOADS["bimodal"].config(eta, steps=4, small=True)))]
    configs += [_race(tiny(eta=eta, steps=3, seed=0), copies=2)]
    started = 0
    for config in configs:
        cluster = SimCluster(config)
        _, _, problems = _recorded(cluster)
        consumed = run(cluster)  # checks conservation at the end
        assert problems == []
        assert_within_eta(consumed, config.eta, config.batch_size, config.group_size)
        assert cluster.races is not None
        started += cluster.races.started
    assert started > 0


def test_races_happen_on_skewed_workloads_and_are_unbiased() -> None:
    started = won = compared = 0
    for workload, eta in CASES:
        base = system("staleflow", WORKLOADS[workload].config(eta, steps=4, seed=0, small=True))
        cluster = SimCluster(_race(base))
        drawn, trained, problems = _recorded(cluster)
        summary = cluster.run()
        assert not summary.stalled and problems == [] and cluster.check() == []
        assert trained and all(trained[t] == drawn[t] for t in trained), workload
        races = cluster.races
        assert races is not None
        raced = races.raced & trained.keys()
        assert Counter(trained[t] for t in raced) == Counter(drawn[t] for t in raced)
        compared += len(raced)
        assert summary.races_started == races.started >= len(races.raced)
        started, won = started + summary.races_started, won + summary.races_won
        # per prompt, the trained lengths are those of the same seed without racing
        off = SimCluster(base)
        off.run()
        racing = {sid: sorted(lengths) for sid, _, lengths in cluster.trained}
        plain = {sid: sorted(lengths) for sid, _, lengths in off.trained}
        common = racing.keys() & plain.keys()
        assert common and all(racing[s] == plain[s] for s in common), workload
    assert started > 0 and won > 0 and compared > 0


def test_a_slow_holder_loses_to_its_copy() -> None:
    config = _race(tiny(eta=0, steps=1)).with_(instances=2, batch_size=1, group_size=1)
    config = config.with_(engine=replace(config.engine, noise=0.0))
    cluster = SimCluster(config)
    drawn, trained, problems = _recorded(cluster)
    cluster.step()  # the one trajectory is routed, and raced on the other, idle instance
    races = cluster.races
    assert races is not None and races.started == 1
    ((tid, race),) = races.active.items()
    holder, dest = cluster.instances[race.holder], cluster.instances[race.dests[0]]
    assert tid in holder.holds() and tid not in dest.holds() and tid in dest.copies
    assert [t.traj_id for t in dest.snapshot().run_trajs + dest.snapshot().wait_trajs] == []
    holder.truth = InstanceTruth(ScaledCost(holder.cost, 20.0))  # it slows down
    summary = cluster.run()
    assert summary.steps == 1 and problems == [] and cluster.check() == []
    assert (summary.races_started, summary.races_won) == (1, 1)
    assert summary.race_wasted_tokens > 0 and summary.wasted_tokens == 0
    assert trained == {tid: drawn[tid]}
    assert tid in holder.completed and not dest.copies and not races.active
    assert cluster.coordinator.stats.discarded == 0  # Eq. 1 held throughout


def test_off_nothing_races() -> None:
    summary = SimCluster(tiny(eta=0, steps=2)).run()
    assert (summary.races_started, summary.races_won, summary.race_wasted_tokens) == (0, 0, 0)
