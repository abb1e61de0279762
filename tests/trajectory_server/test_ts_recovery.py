"""Recovery primitives of the trajectory server: progress reports, a lost instance, a lost
reward worker, and late messages from an instance that no longer holds a trajectory."""

from __future__ import annotations

import numpy as np
import pytest

from trajectory_server import (
    Completion,
    FinishedTrajectory,
    InvalidPayload,
    InvalidTransition,
    NotHolder,
    PartialTrajectory,
    TrajectoryGone,
    TrajState,
)


def ids(ts) -> list[int]:
    return [r.traj_id for r in ts.routing_view()]


def state(ts) -> tuple[object, ...]:
    return (tuple(ts.routing_view()), ts.stats())


def test_a_lost_instance_returns_its_trajectories_with_the_longest_known_prefix(ts, response):
    ts.route([0, 1], 2, "a")
    ts.route([2], 1, "b")
    # "a" reports 5 tokens of trajectory 0; trajectory 1 has no report yet
    assert ts.report_progress([PartialTrajectory(0, *response(5, 2))], "a") == (0,)
    assert ts.routed_to("a") == (0, 1) and ts.routed_to("b") == (2,)
    assert ts.instance_lost("a") == (0, 1)
    assert ts.routed_to("a") == () and ts.state_of(2) is TrajState.ROUTED  # "b" untouched
    view = {r.traj_id: r for r in ts.routing_view()}
    assert view[0].v_traj == 2 and view[0].length == view[0].prompt_len + 5
    assert view[1].v_traj == 2 and view[1].length == view[1].prompt_len  # routed, no tokens
    assert ids(ts)[:2] == [0, 1]  # their level (V_traj=2) comes before the initial ones
    # routed again, elsewhere: the instance continues after the 5 reported tokens
    again = ts.route([0], None, "c")[0]
    assert again.v_traj == 2 and again.tokens.tolist() == response(5, 2)[0].tolist()
    assert again.versions.tolist() == [2] * 5


def test_progress_only_grows_and_only_from_the_holder(ts, response):
    ts.route([0], 1, "a")
    ts.route([1], 1, "b")
    assert ts.report_progress([PartialTrajectory(0, *response(4, 1))], "a") == (0,)
    # shorter or equal reports, reports from another instance, and reports about queued or
    # gone trajectories are ignored
    stale = [PartialTrajectory(0, *response(2, 1)), PartialTrajectory(1, *response(3, 1))]
    assert ts.report_progress(stale, "a") == ()
    assert ts.report_progress([PartialTrajectory(2, *response(1, 1))], "a") == ()
    ts.abort([1])
    assert ts.report_progress([PartialTrajectory(1, *response(3, 1))], "b") == ()
    # a report that does not extend what the TS holds is a bug in the instance: refused
    before = state(ts)
    wrong = response(6, 1, start=1)
    with pytest.raises(InvalidPayload, match="does not start with"):
        ts.report_progress([PartialTrajectory(0, *wrong)], "a")
    too_old = response(6, 0)
    with pytest.raises(InvalidPayload, match="older than its V_traj"):
        ts.report_progress([PartialTrajectory(0, *too_old)], "a")
    assert state(ts) == before
    ts.instance_lost("a")
    assert ts.routing_view()[0].length == ts.routing_view()[0].prompt_len + 4


def test_late_messages_from_a_lost_instance_are_refused(ts, response):
    ts.route([0], 3, "a")
    ts.instance_lost("a")
    ts.route([0], None, "b")
    before = state(ts)
    tokens, logprobs, versions = response(2, 3)
    with pytest.raises(NotHolder, match="not on instance 'a'"):
        ts.interrupt_return([PartialTrajectory(0, tokens, logprobs, versions)], instance_id="a")
    with pytest.raises(NotHolder, match="drop this late message"):
        ts.complete_many([_completion(0, tokens, logprobs, versions)], instance_id="a")
    with pytest.raises(NotHolder):
        ts.hand_to_reward([FinishedTrajectory(0, *response(2, 3), "stop")], "w", instance_id="a")
    assert ts.report_progress([PartialTrajectory(0, tokens, logprobs, versions)], "a") == ()
    assert state(ts) == before
    # the new holder's messages are accepted
    ts.interrupt_return([PartialTrajectory(0, tokens, logprobs, versions)], instance_id="b")
    assert ts.state_of(0) is TrajState.QUEUED


def _completion(tid, tokens, logprobs, versions, reward=1.0):
    return Completion(tid, tokens, logprobs, versions, reward, "stop")


def test_a_lost_reward_worker_costs_only_the_scoring(ts, response):
    ts.route([0, 1, 2], 1, "a")
    finished = [FinishedTrajectory(t, *response(3 + t, 1), "stop") for t in (0, 1)]
    ts.hand_to_reward(finished, "w1", instance_id="a")
    assert ts.state_of(0) is TrajState.REWARDING and ts.stats().rewarding == 2
    entry = ts.ledger()[0]  # identifiable in the TS: its state, worker and response
    assert (entry.state, entry.holder, entry.v_traj, entry.tokens) == ("rewarding", "w1", 1, 3)
    assert ts.instance_lost("a") == (2,)  # the instance no longer has the finished ones
    tasks = ts.reassign_rewards("w1", "w2")  # w1 died: score them on w2
    assert [t.traj_id for t in tasks] == [0, 1]
    task = tasks[1]
    assert (task.group_id, task.v_traj, task.sample_id, task.answer) == (0, 1, 0, "0")
    assert task.tokens.tolist() == response(4, 1)[0].tolist() and task.finish_reason == "stop"
    assert task.prompt.tolist() == [10, 11] and task.versions.dtype == np.int32
    assert ts.reassign_rewards("w1", "w3") == ()  # nothing left on w1
    # the completion must carry the finished response, unchanged
    before = state(ts)
    longer = response(5, 1)
    with pytest.raises(InvalidPayload, match="handed to reward has 4"):
        ts.complete(1, *longer, reward=1.0, finish_reason="stop")
    assert state(ts) == before
    status = ts.complete(1, task.tokens, task.logprobs, task.versions, 0.5, "stop")
    assert status.completed == 1 and ts.stats().rewarding == 1
    # a second score of the same trajectory (the "dead" worker was only slow) is refused
    with pytest.raises(InvalidTransition, match="COMPLETED"):
        ts.complete(1, task.tokens, task.logprobs, task.versions, 0.5, "stop")
    # an aborted REWARDING trajectory is on no instance
    assert ts.abort([0])[0].instance_id is None


def test_recovery_calls_validate_their_input_and_change_nothing(ts, response):
    ts.route([0], 1, "a")
    before = state(ts)
    with pytest.raises(InvalidTransition, match="ROUTED"):
        ts.requeue([0, 1])  # 1 is QUEUED
    with pytest.raises(InvalidTransition, match="more than once"):
        ts.requeue([0, 0])
    with pytest.raises(InvalidPayload, match="worker_id"):
        ts.hand_to_reward([FinishedTrajectory(0, *response(1, 1), "stop")], worker_id=None)
    with pytest.raises(InvalidPayload, match="finish_reason"):
        ts.hand_to_reward([FinishedTrajectory(0, *response(1, 1), None)], "w")
    assert state(ts) == before
    ts.abort([0])
    with pytest.raises(TrajectoryGone):
        ts.requeue([0])
