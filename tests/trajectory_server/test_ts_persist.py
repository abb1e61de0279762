"""Checkpoints of the trajectory server: export, pack, restore."""

from __future__ import annotations

import numpy as np
import pytest

from tests.trajectory_server.conftest import CycleSource
from trajectory_server import (
    CorruptState,
    FinishedTrajectory,
    InvalidConfig,
    PartialTrajectory,
    TrajectoryServer,
    TrajectoryServerConfig,
    TrajState,
)
from trajectory_server.wire import pack_plain, unpack_plain


class PositionedSource(CycleSource):
    """A cycle source that can say where it is (like ``PromptSampler.state()``)."""

    def state(self) -> dict[str, int]:
        return {"drawn": self.drawn}


def busy_server(response) -> TrajectoryServer:
    """Every state at once: queued partials and initial ones, routed with and without
    progress, rewarding, completed; one group consumed and one aborted before."""
    ts = TrajectoryServer(
        TrajectoryServerConfig(eta=1, batch_size=2, group_size=2), PositionedSource()
    )
    ts.route([0, 1], 0, "a")
    for t in (0, 1):
        ts.complete(t, *response(2, 0), reward=float(t), finish_reason="stop", info={"n": t})
    ts.take_batch([0])  # group 0 consumed; group 4 sampled
    ts.abort_group(1)  # trajectories 2, 3 aborted; group 5 sampled
    ts.route([4, 5, 6], {4: 1, 5: 1, 6: 0}, "a")
    ts.interrupt_return([PartialTrajectory(6, *response(3, 0))])  # queued partial, V=0
    ts.report_progress([PartialTrajectory(4, *response(4, 1))], "a")  # routed, 4 tokens known
    ts.route([7], 1, "b")
    ts.hand_to_reward([FinishedTrajectory(7, *response(5, 1), "length")], "w")
    ts.route([8], 1, "b")
    ts.complete(8, *response(1, 1), reward=0.5, finish_reason="stop")
    return ts


def test_round_trip_keeps_every_trajectory_and_requeues_the_routed_ones(response):
    ts = busy_server(response)
    live = [t for t in range(12) if t not in (0, 1, 2, 3)]  # consumed or aborted
    before = {t: ts.state_of(t) for t in live}
    assert before[4] is TrajState.ROUTED and before[7] is TrajState.REWARDING
    state = unpack_plain(pack_plain(ts.export_state()))  # what a checkpoint file holds
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    after = {t: restored.state_of(t) for t in live}
    # ROUTED -> QUEUED; everything else as it was
    assert {t for t in after if after[t] != before[t]} == {4, 5}
    assert after[4] is TrajState.QUEUED and after[5] is TrajState.QUEUED
    # the saved queue keeps its order; the requeued ones follow at the back of their level
    assert [(r.traj_id, r.v_traj) for r in restored.routing_view()] == [
        (6, 0),
        (4, 1),
        (5, 1),
        (9, None),
        (10, None),
        (11, None),
    ]
    partial = restored.route([4], None, "c")[0]
    assert partial.v_traj == 1 and partial.tokens.tolist() == response(4, 1)[0].tolist()
    assert partial.logprobs.dtype == np.float32 and partial.versions.tolist() == [1] * 4
    # the rewarding one waits for a worker, its finished response intact
    (task,) = restored.reassign_rewards(None, "w2")
    assert task.traj_id == 7 and task.finish_reason == "length" and len(task.tokens) == 5
    s0, s1 = ts.stats(), restored.stats()
    for key in ("created_trajectories", "consumed_groups", "aborted_trajectories", "completed"):
        assert getattr(s0, key) == getattr(s1, key), key
    # ids continue where they stopped, and the prompts continue from the source
    batch = restored.take_batch([4], select={4: [8]})
    assert batch.groups[0].trajectories[0].reward == 0.5
    assert restored.group_members(6) == (12, 13) and restored.stats().created_groups == 7


def positioned(state) -> PositionedSource:
    source = PositionedSource()
    source.drawn = state["source"]["drawn"]
    return source


def test_export_is_columns_of_arrays_and_a_second_round_trip_is_stable(response):
    ts = busy_server(response)
    state = ts.export_state()
    t = state["trajectories"]
    assert t["tokens"].dtype == np.int32 and t["versions"].dtype == np.int32
    assert t["logprobs"].dtype == np.float32 and t["offsets"][-1] == len(t["tokens"])
    assert state["groups"]["prompt"].dtype == np.int32
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    again = restored.export_state()
    assert sorted(again["trajectories"]["id"].tolist()) == sorted(t["id"].tolist())
    assert set(again["trajectories"]["state"]) == {"queued", "rewarding", "completed"}
    # nothing was ROUTED any more, so a second round trip changes nothing at all
    twice = TrajectoryServer.restore(ts.config, positioned(again), again).export_state()
    assert pack_plain(twice) == pack_plain(again)


def test_restore_refuses_other_settings_and_corrupt_states(response):
    ts = busy_server(response)
    state = ts.export_state()
    other = TrajectoryServerConfig(eta=2, batch_size=2, group_size=2)
    with pytest.raises(InvalidConfig, match="eta=1"):
        TrajectoryServer.restore(other, PositionedSource(), state)
    with pytest.raises(InvalidConfig, match=r"PromptSampler\.from_state"):
        TrajectoryServer.restore(ts.config, PositionedSource(), state)  # drawn=0
    source = positioned(state)
    for corrupt, match in (
        ({**state, "format": 99}, "format"),
        (
            dict(state, trajectories={**state["trajectories"], "offsets": np.zeros(1, np.int64)}),
            "offsets",
        ),
        (dict(state, trajectories={**state["trajectories"], "tokens": [1, 2]}), "tokens"),
        (dict(state, counters={**state["counters"], "next_traj": 3}), "never made"),
        (dict(state, groups={**state["groups"], "answer": []}), "answer"),
    ):
        with pytest.raises(CorruptState, match=match):
            TrajectoryServer.restore(ts.config, source, corrupt)


def test_the_filtered_counts_survive_a_round_trip_and_older_states_read_as_zero(response):
    ts = busy_server(response)
    ts.route([9], 1, "b")
    ts.complete(9, *response(1, 1), reward=0.0, finish_reason="stop")
    ts.filter_group(4)  # trajectories 8 and 9: completed, both
    state = unpack_plain(pack_plain(ts.export_state()))
    restored = TrajectoryServer.restore(ts.config, positioned(state), state)
    s = restored.stats()
    assert (s.filtered_groups, s.filtered_trajectories) == (1, 2)
    assert s.aborted_trajectories == ts.stats().aborted_trajectories
    del state["counters"]["filtered_trajs"], state["counters"]["filtered_groups"]
    older = TrajectoryServer.restore(ts.config, positioned(state), state)
    assert older.stats().filtered_trajectories == 0
