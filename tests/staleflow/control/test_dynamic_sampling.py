"""Dynamic sampling: the filter decision, and the control loop dropping uniform groups
on a small simulated cluster (its loop, TS and manager are the real ones), with the
drops counted apart in the trajectory server (what the run's audit reads)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from coordinator import CoordinatorConfig
from staleflow.control import ControlLoop, Occupied
from staleflow.control.dynamic_sampling import (
    DynamicSampling,
    SamplingConfig,
    graded_reward,
    has_signal,
)
from staleflow.control.late import complete_live
from staleflow.runtime.interface import Rewarded
from staleflow.sim import SimCluster
from staleflow.sim.cluster import ClusterConfig
from staleflow.sim.workload import WorkloadConfig
from trajectory_server.types import Completion


@pytest.mark.parametrize(
    ("rewards", "signal"),
    [
        ([1.0, 1.0, 1.0, 1.0], False),  # all right: no advantage
        ([0.0, 0.0], False),  # all wrong
        ([0.0, 1.0], True),
        ([0.5, 0.5000001], True),  # any difference: the trainer's advantages are not 0
        ([1.0, None, 1.0], False),  # a failed reward is left out, as in the advantages
        ([None, 0.0, 1.0], True),
        ([1.0, None], False),  # one graded reward: its advantage is 0
        ([None, None], False),
        ([], False),
    ],
)
def test_a_group_has_a_signal_unless_its_graded_rewards_are_all_equal(rewards, signal):
    assert has_signal(rewards) is signal


def test_the_reward_a_completion_reports_is_graded_unless_its_function_failed():
    ok = Rewarded(1, 0, 0, 0.5, "", 3, "stop", 0)
    failed = Rewarded(2, 0, 0, 0.0, "ZeroDivisionError", 3, "stop", 0)
    assert graded_reward(ok) == 0.5 and graded_reward(failed) is None
    assert graded_reward(object()) is None  # carries none (the simulator's trajectories)


@pytest.mark.parametrize(("max_drop", "budget"), [(0.75, 96), (0.5, 32), (0.0, 0), (0.9, 288)])
def test_the_budget_is_the_share_of_a_steps_groups_that_may_be_dropped(max_drop, budget):
    assert SamplingConfig(32, max_drop).budget == budget
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        SamplingConfig(32, 1.0)


# -- in the control loop ------------------------------------------------------------------


@dataclass(frozen=True)
class _Done:
    """A rewarded trajectory as the reward path reports it (``Rewarded``'s fields the loop
    reads)."""

    group_id: int
    traj_id: int
    reward: float
    error: str = ""
    response_len: int = 2


def _cluster(max_drop: float = 0.75, **changes) -> SimCluster:
    config = ClusterConfig(
        instances=2,
        eta=1,
        batch_size=1,
        group_size=2,
        coordinator=CoordinatorConfig(period_s=1.0),
        workload=WorkloadConfig(max_response=200, prompt_median=20, max_prompt=50),
    ).with_(**changes)
    cluster = SimCluster(config)
    cluster.loop.sampling = DynamicSampling(SamplingConfig(config.batch_size, max_drop))
    return cluster


def _start(cluster: SimCluster, group: int, trajs: list[int], v: int = 0) -> None:
    """Reserve and route ``trajs`` as a Route would (on instance 0, at version ``v``)."""
    for t in trajs:
        cluster.manager.reserve(group, t, v)
    cluster.ts.route(trajs, v, 0)


def _store(cluster: SimCluster, rewards: dict[int, float], v: int = 0) -> None:
    """The reward path's first half: the TS holds them as completed with these rewards."""
    one = np.ones(2, np.int32)
    done = [
        Completion(t, one, np.zeros(2, np.float32), np.full(2, v, np.int32), r, "stop", {})
        for t, r in rewards.items()
    ]
    assert len(complete_live(cluster.ts, done)) == len(done)


def _reward(cluster: SimCluster, group: int, rewards: dict[int, float], v: int = 0) -> None:
    """Start the group, store its completions, and report them to the loop."""
    _start(cluster, group, list(rewards), v)
    _store(cluster, rewards, v)
    cluster.loop.occupy([_Done(group, t, r) for t, r in rewards.items()])


def _balanced(cluster: SimCluster) -> bool:
    s = cluster.ts.stats()
    where = s.queued + s.routed + s.rewarding + s.completed
    ended = s.consumed_trajectories + s.aborted_trajectories + s.filtered_trajectories
    return s.created_trajectories == where + ended


def test_a_uniform_group_is_filtered_out_and_the_batch_fills_with_the_next():
    cluster = _cluster()
    seen: list[Occupied] = []
    cluster.loop.on_decision = lambda d: seen.append(d) if isinstance(d, Occupied) else None
    _reward(cluster, 0, {0: 1.0, 1: 1.0})  # all right: no signal
    assert seen[-1].outcome.filtered and not cluster.manager.is_ready()
    s = cluster.ts.stats()
    assert (s.filtered_groups, s.filtered_trajectories, s.aborted_trajectories) == (1, 2, 0)
    assert _balanced(cluster) and cluster.check() == []
    _reward(cluster, 1, {2: 0.0, 3: 1.0})
    batch = cluster.loop.consume()
    assert batch is not None and [g.group_id for g in batch.groups] == [1]
    window = cluster.loop.sampling.take_window()
    assert (window.completed, window.filtered, window.flat_kept) == (2, 1, 0)
    assert cluster.loop.sampling.take_window().completed == 0  # a new window


def test_the_group_redundancys_surplus_is_aborted_and_the_kept_ones_filtered():
    cluster = _cluster(group_redundancy=0.5)  # 3 members, 2 kept
    _start(cluster, 0, [0, 1, 2])
    _store(cluster, {0: 0.0, 1: 0.0})
    cluster.loop.occupy([_Done(0, 0, 0.0), _Done(0, 1, 0.0)])
    s = cluster.ts.stats()
    assert (s.filtered_trajectories, s.aborted_trajectories) == (2, 1)  # 2 was running
    assert _balanced(cluster)


def test_a_failed_reward_leaves_the_group_with_too_few_graded_to_learn_from():
    cluster = _cluster()
    _start(cluster, 0, [0, 1])
    _store(cluster, {0: 0.0, 1: 1.0})
    cluster.loop.occupy([_Done(0, 0, 0.0, error="boom"), _Done(0, 1, 1.0)])
    assert cluster.ts.stats().filtered_groups == 1


def test_beyond_the_budget_uniform_groups_are_kept_until_the_next_consume(caplog):
    """max_drop 0.5 with one group a step: one filtered between two Consumes, then kept
    (the run trains on rather than generating forever)."""
    cluster = _cluster(max_drop=0.5)
    assert cluster.loop.sampling.config.budget == 1
    _reward(cluster, 0, {0: 0.0, 1: 0.0})  # filtered
    with caplog.at_level("WARNING"):
        _reward(cluster, 1, {2: 0.0, 3: 0.0})  # kept: the budget is spent
    assert "dynamic_sampling_max_drop=0.5" in caplog.text
    assert cluster.manager.filtered_this_step == 1 and cluster.manager.is_ready()
    window = cluster.loop.sampling.take_window()
    assert (window.completed, window.filtered, window.flat_kept) == (2, 1, 1)
    assert [g.group_id for g in cluster.loop.consume().groups] == [1]  # type: ignore[union-attr]
    assert cluster.manager.filtered_this_step == 0
    _reward(cluster, 2, {4: 1.0, 5: 1.0}, v=1)  # a new step: filtered again
    assert cluster.ts.stats().filtered_groups == 2


def test_a_resumed_loop_takes_the_rewards_completed_before_the_stop_from_the_ts():
    """Member 0 completed before the stop; the new loop (a resumed run's: same manager and
    TS) learns its reward from the TS's ledger and drops the group at member 1."""
    cluster = _cluster()
    cluster.loop.sampling = None  # the loop before the stop (its rewards are lost)
    _start(cluster, 0, [0, 1])
    _store(cluster, {0: 1.0})
    cluster.loop.occupy([_Done(0, 0, 1.0)])
    resumed = ControlLoop(
        cluster.manager.config,
        CoordinatorConfig(period_s=1.0),
        ts=cluster.ts,
        planes=cluster.planes,
        snapshots=lambda: [],
        ps_version=lambda: 0,
        instances=cluster.instances,
        clock=lambda: 0.0,
        manager=cluster.manager,
        sampling=DynamicSampling(SamplingConfig(1)),
    )
    _store(cluster, {1: 1.0})
    resumed.occupy([_Done(0, 1, 1.0)])
    assert cluster.ts.stats().filtered_groups == 1 and cluster.manager.filtered_groups == 1


def test_the_simulator_draws_its_drops_and_keeps_the_batch_full():
    """filtered_share: each completed group is dropped with that probability; every step
    still trains a full batch, the bound holds and the TS's counts add up."""
    cluster = SimCluster(
        ClusterConfig(
            instances=2,
            eta=1,
            batch_size=2,
            group_size=2,
            steps=6,
            coordinator=CoordinatorConfig(period_s=1.0),
            workload=WorkloadConfig(max_response=200, prompt_median=20, max_prompt=50),
            filtered_share=0.4,
        )
    )
    summary = cluster.run()
    assert summary.steps == 6 and not summary.stalled
    assert all(len(b.groups) == 2 for b in cluster.batches)
    assert max(summary.staleness) <= 1
    assert summary.filtered_groups == cluster.ts.stats().filtered_groups > 0
    assert 0.0 < summary.filtered_frac < 1.0
    assert cluster.check() == []
