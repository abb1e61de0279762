"""The TS over Ray: one integration test that drives the actor through a full cycle."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from trajectory_server import (
    FinishedTrajectory,
    InvalidTransition,
    NotHolder,
    PartialTrajectory,
    TrajectoryGone,
    TrajectoryServerConfig,
    TrajState,
)


def test_importing_the_package_does_not_import_ray():
    code = (
        "import sys, trajectory_server, trajectory_server.actor, trajectory_server.wire;"
        "print('ray' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.ray
def test_actor_round_trip():
    ray = pytest.importorskip("ray")
    from staleflow.data import ALPHABET, CharTokenizer, PromptSampler, synthetic_dataset
    from trajectory_server.actor import spawn_trajectory_server

    dataset = synthetic_dataset(CharTokenizer(ALPHABET), size=50)
    # address="local": a new instance even if another `ray start` runs on this machine
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = TrajectoryServerConfig(eta=1, batch_size=2, group_size=2)
        client = spawn_trajectory_server(config, PromptSampler(dataset, seed=3))
        view = client.routing_view()
        assert [r.traj_id for r in view] == list(range(8)) and view[0].v_traj is None
        first = PromptSampler(dataset, seed=3).next_sample()
        assert view[0].prompt_len == view[0].length == len(first.prompt_ids)

        routed = client.route([0, 1, 2], {0: 1, 1: 1, 2: 0}, "inst-0")
        assert [p.v_traj for p in routed] == [1, 1, 0]
        assert routed[0].prompt.dtype == np.int32 and routed[0].answer

        tokens = np.arange(4, dtype=np.int32) + 3
        client.interrupt_return(
            [PartialTrajectory(2, tokens, np.zeros(4, np.float32), np.zeros(4, np.int32))]
        )
        assert [(r.traj_id, r.v_traj) for r in client.routing_view()][:1] == [(2, 0)]
        assert client.routing_view()[0].length == routed[2].length + 4

        for tid in (0, 1):
            status = client.complete(
                tid, tokens, np.full(4, -0.1, np.float32), np.ones(4, np.int32), 1.0, "stop"
            )
        assert status.all_completed
        with pytest.raises(InvalidTransition, match="ROUTED trajectories only"):
            client.complete(3, tokens, np.zeros(4, np.float32), np.ones(4, np.int32), 1.0, "stop")

        batch = client.take_batch([0])
        trajs = batch.groups[0].trajectories
        assert [t.traj_id for t in trajs] == [0, 1] and trajs[0].tokens.tolist() == tokens.tolist()
        with pytest.raises(TrajectoryGone):
            client.state_of(0)
        assert client.state_of(2) is TrajState.QUEUED
        assert [a.traj_id for a in client.abort_group(1)] == [2, 3]
        assert client.abort([4])[0].state is TrajState.QUEUED
        stats = client.stats()
        assert (stats.groups, stats.consumed_trajectories, stats.aborted_trajectories) == (4, 2, 3)
        assert client.group_members(2) == (5,) and client.refill() == ()
        assert client.group_status(2).live == 1

        # recovery calls and the checkpoint state over the actor
        client.route([5, 6], 1, "inst-1")
        ones = (tokens, np.zeros(4, np.float32), np.ones(4, np.int32))
        assert client.report_progress([PartialTrajectory(5, *ones)], "inst-1") == (5,)
        fork = client.fork(5, "inst-1")  # a race copy's start: the reported response
        assert fork is not None and fork.tokens.tolist() == tokens.tolist()
        assert client.fork(5, "inst-2") is None
        client.hand_to_reward([FinishedTrajectory(6, *ones, "stop")], "w0", instance_id="inst-1")
        assert client.routed_to("inst-1") == (5,)
        assert client.instance_lost("inst-1") == (5,)
        with pytest.raises(NotHolder):
            client.interrupt_return([PartialTrajectory(5, *ones)], instance_id="inst-1")
        (task,) = client.reassign_rewards("w0", "w1")
        assert task.traj_id == 6 and task.tokens.tolist() == tokens.tolist()
        state = client.export_state()
        assert state["trajectories"]["tokens"].dtype == np.int32
        restored = spawn_trajectory_server(
            config, PromptSampler.from_state(dataset, state["source"]), state
        )
        assert restored.routing_view() == client.routing_view()
        assert restored.state_of(6) is TrajState.REWARDING
    finally:
        ray.shutdown()
