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


def test_a_route_to_an_instance_declared_lost_is_refused(ts, response):
    """A Route the lost instance sent before it died may reach the TS after the loss was
    handled: it must not strand trajectories on the dead instance."""
    ts.route([0], 2, "a.0")
    assert ts.instance_lost("a.0") == (0,)
    before = state(ts)
    with pytest.raises(NotHolder, match="declared lost"):
        ts.route([0, 1], {1: 2}, "a.0", skip_unavailable=True)
    assert state(ts) == before
    # its successor has an id of its own and takes work
    assert [r.traj_id for r in ts.route([0, 1], {1: 2}, "a.1")] == [0, 1]


def test_a_completion_names_its_worker_and_a_reassigned_one_is_late(ts, response):
    ts.route([0, 1], 1, "a")
    finished = [FinishedTrajectory(t, *response(3, 1), "stop") for t in (0, 1)]
    ts.hand_to_reward(finished, "w1", instance_id="a")
    tasks = {t.traj_id: t for t in ts.reassign_rewards("w1", "w2")}
    t0 = tasks[0]
    done = Completion(0, t0.tokens, t0.logprobs, t0.versions, 1.0, "stop")
    before = state(ts)
    with pytest.raises(NotHolder, match="reassigned"):  # w1 was only slow
        ts.complete_many([done], worker_id="w1")
    assert state(ts) == before
    assert ts.complete_many([done], worker_id="w2")[0].completed == 1
    with pytest.raises(NotHolder, match="already scored"):  # scored twice: late
        ts.complete_many([done], worker_id="w2")
    assert ts.state_of(1) is TrajState.REWARDING


def test_a_race_copy_forks_the_reported_response_and_completes_in_the_holders_name(ts, response):
    """runtime/controller/races.py: fork reads what a copy starts from and changes nothing; the copy's
    hand-off names the holder, so the first side to finish completes the trajectory and
    the other's is a late message."""
    ts.route([0], 2, "a")
    assert ts.report_progress([PartialTrajectory(0, *response(3, 2))], "a") == (0,)
    before = state(ts)
    fork = ts.fork(0, "a")
    assert (
        fork is not None and fork.v_traj == 2 and fork.tokens.tolist() == response(3, 2)[0].tolist()
    )
    assert state(ts) == before and ts.routed_to("a") == (0,)
    assert ts.fork(0, "b") is None and ts.fork(1, "a") is None  # not routed there
    # the copy finishes first: it hands off in "a"'s name, from its own (longer) response
    ts.hand_to_reward([FinishedTrajectory(0, *response(6, 2), "stop")], "w0", instance_id="a")
    assert ts.state_of(0) is TrajState.REWARDING and ts.fork(0, "a") is None
    # the original on "a" finishing later is refused as late
    with pytest.raises(NotHolder):
        ts.hand_to_reward([FinishedTrajectory(0, *response(6, 2), "stop")], "w1", instance_id="a")
